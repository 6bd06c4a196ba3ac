"""The smoke subset under torch 2.11, the oldest torch Tessera supports (the GPU machine's): the
suite's own tests, run by a second venv's interpreter (requirements_torch_2_11.txt) on these
sources. One process; FSDP 2 and TP 2 against one process; a --nproc launch; PP 2 with its checkpoint resumed under
FSDP 2 and one process; an exact resume from an older checkpoint; and the gradient clip of
partial sums, which 2.11's _foreach_mul_ left unscaled (sequence-parallel norm weights); the
blocks' activation checkpointing, whose selective cache 2.11 keeps in lists the policy reads again."""

import os
import subprocess
import sys
from pathlib import Path

# test ids -> how many tests they hold, one process per group: under 2.11 a second file's
# run_on_ranks in one process hung (the first file's ranks had finished), so each file that spawns
# ranks has a process of its own
SUBSET = {
    ("libs/models/tests/test_blocks.py",  # selective AC "op" under split-backward schedules
     "apps/trainer/tests/test_train.py::test_loss_falls_over_30_steps",
     "apps/trainer/tests/test_checkpoint_train.py::test_load_step_resumes_an_older_checkpoint_exactly"): 20,
    ("libs/fsdp/tests/test_grad_norm.py",): 8,
    ("apps/trainer/tests/test_distributed_train.py::test_trainer_layout_matches_single_process[fsdp2]",
     "apps/trainer/tests/test_distributed_train.py::test_trainer_layout_matches_single_process[tp2]",
     # --nproc through 2.11's torchrun, whose options differ from 2.13's (no --shutdown_timeout)
     "apps/trainer/tests/test_distributed_train.py::test_nproc_launch_runs_two_ranks"): 3,
    ("apps/trainer/tests/test_pipeline_train.py::test_checkpoint_under_pp2_resumes_under_fsdp2_and_one_process_and_exports_hf",): 1,
}
TIMEOUT_S = 300  # each group; 12-50 s alone


def test_smoke_subset_passes_under_torch_2_11(tmp_path):
    runfiles = Path(os.environ["TEST_SRCDIR"])
    venv = Path((runfiles / "pypi_torch_2_11" / "venv_path.txt").read_text().strip())
    python = str(venv / "bin" / "python3")
    # the sources' import roots as Bazel laid them out; the 2.13 venv's packages stay out
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p.startswith(str(runfiles)))}
    version = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version.startswith("2.11."), version
    for i, (tests, count) in enumerate(SUBSET.items()):
        log = tmp_path / f"pytest-{i}.log"  # a file, not a pipe, for the output
        with open(log, "w") as out:
            proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
                                   "--basetemp", str(tmp_path / f"pytest-{i}"), *tests], cwd=runfiles / "tessera", env=env,
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
        text = log.read_text()
        assert proc.returncode == 0, f"{tests}:\n{text[-8000:]}"
        summary = text.strip().splitlines()[-1]
        assert summary.startswith(f"{count} passed"), f"{tests}: {summary}"  # nothing deselected or skipped
