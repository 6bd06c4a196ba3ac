"""gpu_check's dry run on CPU: its plumbing (launches, seed checkpoint, comparisons, result
file) works, every CPU-capable check passes and every CUDA-only check is skipped by name."""

import os
import signal
import sys
import time

import gpu_check
import torch


def test_dry_run_checks_its_plumbing(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("gpu-check-*-cpu-dry-run.md")
    lines = result.read_text().splitlines()
    assert lines[2].startswith("Python ") and f"torch {torch.__version__}" in lines[2], lines[2]
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in lines[6:]}
    skipped = {name for name, outcome in rows.items() if outcome == "SKIP"}
    assert skipped == {"1 GPU vs CPU, fp32, same seed", "memory snapshot written and loadable",
                       "float8 (bf16) vs fp32 1 GPU", "async TP 2 + compile", gpu_check.GROUPED_MM_ROW}
    assert set(rows.values()) == {"PASS", "SKIP"} and len(rows) == 16, rows
    assert "needs CUDA" in capsys.readouterr().out


def test_every_gpu_job_is_a_valid_trainer_config(tmp_path):
    """The CUDA-only runs cannot run here, but their arguments must parse (names, values)."""
    from tessera.trainer.config import load_config

    runs = {name: tmp_path / name for name in gpu_check.RUNS}
    for gpus in (1, 2):
        for jobs, _, _ in gpu_check._groups(runs, cuda=True, ranks=min(gpus, 2)):
            for job in jobs:
                load_config(job["argv"])


def test_a_launch_past_its_time_leaves_no_rank_running(tmp_path):
    """torchrun's ranks live in sessions of their own: a launch stopped at its timeout must stop
    them too, or they hold the GPU through every later check."""
    script = tmp_path / "hang.py"
    script.write_text("import os, sys, time\n"
                      f"open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\n"
                      "time.sleep(600)\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script)]
    assert gpu_check._run_with_ranks(command, timeout_s=25, env=None) is None
    assert (tmp_path / "pid").exists(), "the rank did not start within 25 s: nothing was tested"
    pid, deadline = int((tmp_path / "pid").read_text()), time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"rank {pid} still running after its launch timed out")
