"""The trainer itself under FSDP, HSDP, DDP and TP on local gloo ranks, against its own
single-process run on the same global batch: fp32 losses and grad norms within 1e-5 relative,
every parameter after the last step within 2e-5 absolute (measured 2.1e-6 to 1.1e-5: the
reduction order differs, tensor-parallel norms run F.rms_norm where one process runs Tessera's
CPU RMSNorm — the same arithmetic in another order — and Adam magnifies it on near-zero
gradients). No layout warns (a UserWarning, or torch.distributed's log)."""

import contextlib
import logging
import os
import subprocess
import sys
import warnings

import pytest
from final_params import assert_params_close, final_params

from tessera.mesh.testing import run_on_ranks
from tessera.trainer.config import load_config
from tessera.trainer.train import train

STEPS = 3
BASE = ["--training.seq_len", "32", "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1",
        "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "1", "--model.flavor", "debugmodel"]


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


@contextlib.contextmanager
def _torch_warnings():
    """What is warned of meanwhile: UserWarnings (torch's or any library's) and torch.distributed's
    log lines (heard where they stop: torch's loggers that print themselves do not propagate)."""
    handler = _Said()
    logs = [logging.getLogger(name) for name, log in list(logging.root.manager.loggerDict.items())
            if name == "torch.distributed" or (name.startswith("torch.distributed.") and not getattr(log, "propagate", True))]
    for log in logs:
        log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            yield handler.said
        handler.said += [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    finally:
        for log in logs:
            log.removeHandler(handler)


def _train_rank(rank, world_size, argv):
    """Per logged step (loss, grad norm); on rank 0 the full parameters after the last step; what
    torch warned of."""
    with final_params() as params, _torch_warnings() as said:
        history = [(h["loss"], h["grad_norm"]) for h in train(load_config(argv))]
    return history, params if rank == 0 else None, said


def _single(tmp_path, global_batch):
    argv = [*BASE, "--job.dump_folder", str(tmp_path / "single"), "--training.local_batch_size", str(global_batch)]
    return _train_rank(0, 1, argv)[:2]


LAYOUTS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"], 2),
    "ddp2": (2, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"], 2),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"], 1),
    "tp2_no_loss_parallel": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                                 "--parallelism.disable_loss_parallel", "true"], 1),
    "hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"], 4),
    "fsdp2_tp2": (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"], 2),
    # 2 micro-batches a step: one reduce-scatter after the last (whole gradients held), or one each
    "fsdp2_accumulation": (2, ["--parallelism.data_parallel_shard_degree", "2", "--training.global_batch_size", "8"], 4),
    "fsdp2_accumulation_reduce_every": (2, ["--parallelism.data_parallel_shard_degree", "2", "--training.global_batch_size", "8",
                                            "--parallelism.fsdp_reduce_every_microbatch", "true"], 4),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_trainer_layout_matches_single_process(tmp_path, layout):
    ranks, extra, dp = LAYOUTS[layout]
    local_batch = 2
    reference, reference_params = _single(tmp_path, local_batch * dp)
    argv = [*BASE, *extra, "--job.dump_folder", str(tmp_path / layout), "--training.local_batch_size", str(local_batch)]
    per_rank = run_on_ranks(_train_rank, ranks, argv)
    for rank_history, _, said in per_rank:  # every rank logs the same dp-averaged loss and global norm
        for (loss, norm), (ref_loss, ref_norm) in zip(rank_history, reference):
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert said == []
    assert_params_close(per_rank[0][1], reference_params, 2e-5, layout)


def test_nproc_launch_runs_two_ranks(tmp_path):
    """Two ranks train and leave nothing in the temporary folder but torch's shared cache folder
    (torchrun's own launch leaves a folder there a run)."""
    argv = [sys.executable, "-m", "tessera.trainer.main", "--nproc", "2", *BASE, "--training.local_batch_size", "1",
            "--job.dump_folder", str(tmp_path / "dump")]
    (tmp_path / "tmp").mkdir()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cpu x2 {'dp_shard': 2}" in proc.stdout and f"step {STEPS}/{STEPS}" in proc.stdout
    assert [path.name for path in (tmp_path / "tmp").iterdir() if not path.name.startswith("torchinductor_")] == []


def test_nproc_with_bad_config_fails_once_before_spawning(tmp_path):
    argv = [sys.executable, "-m", "tessera.trainer.main", "--nproc", "2", "--training.stepz", "1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: unknown config key training.stepz; did you mean 'steps'?"


def test_tp_degree_that_does_not_divide_is_an_error(tmp_path):
    argv = [*BASE, "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
            "--training.seq_len", "33", "--job.dump_folder", str(tmp_path)]
    with pytest.raises(RuntimeError, match="tensor_parallel_degree 2 does not divide seq_len=33"):
        run_on_ranks(_train_rank, 2, argv)


@pytest.mark.skipif("TRAINER_BINARY" not in os.environ, reason="needs the built trainer (runs under bazel test)")
def test_torchrun_on_the_built_trainer(tmp_path):
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--no-python",
            os.path.abspath(os.environ["TRAINER_BINARY"]), *BASE, "--training.local_batch_size", "1",
            "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
            "--job.dump_folder", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cpu x2 {'tp': 2}" in proc.stdout and f"step {STEPS}/{STEPS}" in proc.stdout
