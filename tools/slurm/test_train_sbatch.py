"""train.sbatch's time-limit handling, with srun, scancel and scontrol stubbed: USR1 reaches the
ranks, the script waits for them and requeues the job; a failure keeps its exit status."""

import os
import signal
import subprocess
import time
from pathlib import Path

SBATCH = Path(__file__).with_name("train.sbatch")


def _stubs(tmp_path, srun_body):
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    stubs = {
        "scontrol": f'echo "scontrol $*" >> {calls}; if [ "$1" = show ]; then echo node1; fi',
        "scancel": f'echo "scancel $*" >> {calls}; kill -USR1 "$(cat {tmp_path}/srun.pid)"',
        "srun": f'echo "srun $*" >> {calls}; {srun_body}',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="42", SLURM_NNODES="1",
               SLURM_JOB_NODELIST="node1", SLURM_GPUS_ON_NODE="1", SLURM_CPUS_PER_TASK="96")
    return subprocess.Popen(["bash", str(SBATCH), "job.toml"], env=env, cwd=tmp_path), calls


def test_time_limit_signal_stops_the_ranks_and_requeues(tmp_path):
    # the pid file once the trap is set: a USR1 before it killed the stub (exit 138) on a loaded machine
    ranks = (f'trap "echo ranks-saved-and-stopped >> {tmp_path}/calls; exit 0" USR1; echo $$ > {tmp_path}/srun.pid; '
             'while true; do sleep 0.05; done')
    proc, calls = _stubs(tmp_path, ranks)
    deadline = time.monotonic() + 30
    while not (tmp_path / "srun.pid").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    time.sleep(0.2)  # the script is now waiting for srun
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=30) == 0
    lines = calls.read_text().splitlines()
    assert lines[1] == ("srun --cpus-per-task 96 bazel-bin/apps/trainer/trainer --nproc 1 --hosts node1 --port 29500 "
                        "--job.config_file job.toml")
    assert lines[2:] == ["scancel --signal=USR1 42", "ranks-saved-and-stopped", "scontrol requeue 42"]


def test_failed_run_keeps_its_status_and_is_not_requeued(tmp_path):
    proc, calls = _stubs(tmp_path, "exit 3")
    assert proc.wait(timeout=30) == 3
    assert not any(line.startswith(("scancel", "scontrol requeue")) for line in calls.read_text().splitlines())
