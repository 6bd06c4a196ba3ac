"""Multi-node launch (issue 30), with two "nodes" on this machine (2 ranks each, c10d rendezvous on
localhost): two torchrun agents started by hand (tools/launch/torchrun --nnodes 2), and
tools/slurm/train.sbatch under a stand-in srun that starts the trainer's launcher on both nodes,
plain and with fault tolerance (two replica groups, one per node). Every run logs the losses of
the single-node 4-rank run."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[3]
TORCHRUN = ROOT / "tools" / "launch" / "torchrun.py"
SBATCH = ROOT / "tools" / "slurm" / "train.sbatch"
ARGS = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
        "--metrics.disable_color_printing", "true", "--training.steps", "2"]
ENV = {key: value for key, value in os.environ.items() if key != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
ENV.update(PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")


def losses(output, prefix=""):
    return re.findall(rf"^{prefix}step +(\d+)/\d+ +loss +(\S+) +grad_norm +(\S+)", output, re.M)


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def both(commands, env=ENV):
    """Runs the two nodes' commands side by side: their outputs (stdout and stderr)."""
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    return outputs


def sbatch(tmp_path, *args):
    """train.sbatch on two nodes: srun starts its command once per node (SLURM_NODEID 0, 1)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stubs = {"scontrol": 'if [ "$1" = show ]; then printf "localhost\\nlocalhost\\n"; fi',
             "srun": 'for node in 0 1; do SLURM_NODEID=$node "$@" & done; status=0; for job in $(jobs -p); do '
                     'wait "$job" || status=$?; done; exit $status'}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = dict(ENV, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="7", SLURM_NNODES="2",
               SLURM_JOB_NODELIST="localhost", SLURM_GPUS_ON_NODE="2", TESSERA_PORT=str(free_port()),
               TESSERA_TRAINER=f"{sys.executable} -m tessera.trainer.main")
    config = tmp_path / "job.toml"
    config.write_text("[job]\ndescription = 'two nodes'\n")
    result = subprocess.run(["bash", str(SBATCH), str(config), *ARGS, *args], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def test_two_nodes_train_as_the_single_node_four_rank_run(tmp_path):
    single = subprocess.run([sys.executable, "-m", "tessera.trainer.main", "--nproc", "4", *ARGS,
                             "--job.dump_folder", str(tmp_path / "single")], env=ENV, capture_output=True, text=True,
                            timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    expected = losses(single.stdout)
    assert [int(step) for step, *_ in expected] == [1, 2]

    endpoint = f"localhost:{free_port()}"
    agents = both([[sys.executable, str(TORCHRUN), "--nnodes", "2", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
                    "--rdzv_endpoint", endpoint, "--rdzv_id", "two-nodes", "-m", "tessera.trainer.main", *ARGS,
                    "--job.dump_folder", str(tmp_path / "torchrun")]] * 2)
    assert sum(losses(output) == expected for output in agents) == 1  # rank 0's agent logs, the other is quiet

    plain = sbatch(tmp_path, "--job.dump_folder", str(tmp_path / "sbatch"))
    assert "x4 {'dp_shard': 4}" in plain and losses(plain) == expected

    ft = sbatch(tmp_path, "--job.dump_folder", str(tmp_path / "sbatch-ft"), "--fault_tolerance.enable", "true",
                "--fault_tolerance.group_size", "2")
    for group in (0, 1):  # a group per node, each FSDP over its node's 2 ranks
        assert losses(ft, rf"\[replica {group}\] ") == expected
    digests = re.findall(r"replica group \d ends at step 2, weights sha256 (\w+)$", ft, re.M)
    assert len(digests) == 2 and digests[0] == digests[1]
