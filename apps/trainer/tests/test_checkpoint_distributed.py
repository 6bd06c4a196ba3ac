"""Checkpoints through the trainer on local gloo ranks: an FSDP 4 checkpoint (saved in the
background) loads under FSDP 2, TP 2 and one process with every weight and optimizer value
intact, and each resume then trains 2 more steps with the uninterrupted FSDP 4 run's losses and
grad norms (fp32, 3e-7 relative: measured up to 1.2e-7, one rounding of a loss near 8; only the
reduction order differs); its Hugging Face export loads under FSDP 2, and a seed checkpoint
starts a 2-rank FSDP run from exactly its weights."""

import shutil

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from tessera.ckpt import load_hf, read_dcp
from tessera.mesh.testing import run_on_ranks
from tessera.models import get_model_spec
from tessera.trainer.checkpointing import Checkpointer
from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.train import train

# One thread, as run_on_ranks sets in its workers: faster on a shared 2-core box.
torch.set_num_threads(1)

BASE = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
        "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--training.steps", "2"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]


def _gathered(state_dict):
    """Full copies: the live tensors change as training goes on after the restore."""
    full = {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state_dict.items()}
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in full.items()}


def _train_and_capture(rank, world_size, runs):
    """train() for each argv in turn. Per run: (history or ConfigError text, the model and
    optimizer state as full tensors right after the checkpoint was restored); rank 0 returns."""
    captured = []
    restore = Checkpointer.restore

    def restore_and_capture(self):
        step = restore(self)
        # An optimizer without state would take a zero-gradient step to build one (torch's
        # get_optimizer_state_dict), changing the run it observes: only a loaded one is read.
        loaded = [name for name in ("model", "optimizer")
                  if name == "model" or any(o.state for part in self.states[name].optimizers for o in part)]
        captured.append({name: _gathered(self.states[name].state_dict()) for name in loaded})
        return step

    Checkpointer.restore = restore_and_capture
    results = []
    try:
        for argv in runs:
            captured.clear()
            try:
                outcome = train(load_config(argv))
            except ConfigError as e:
                outcome = str(e)
            results.append((outcome, captured[0] if captured else None))
    finally:
        Checkpointer.restore = restore
    return results if rank == 0 else None


def _resume(tmp, layout, dp):
    """The argv re-running the FSDP 4 job (global batch 8) on `dp` data-parallel ranks in a folder
    holding only its step-2 checkpoint: the trainer resumes from there and trains steps 3 and 4."""
    shutil.copytree(tmp / "fsdp4" / "checkpoint" / "step-2", tmp / layout / "checkpoint" / "step-2")
    return [*BASE, "--training.steps", "4", "--training.local_batch_size", str(8 // dp),
            "--job.dump_folder", str(tmp / layout), "--checkpoint.enable", "true"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An FSDP 4 run of 4 steps saving step-2 and step-4 in the background plus its HF export, a
    seed checkpoint (seed 7, so not what a seed-0 run builds itself), then every 2-rank run in
    one spawn (starting the processes costs far more than these runs)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    (uninterrupted, _), = run_on_ranks(_train_and_capture, 4, [[
        *BASE, "--training.steps", "4", "--job.dump_folder", str(tmp / "fsdp4"),
        "--parallelism.data_parallel_shard_degree", "4", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
        "--checkpoint.last_save_model_only", "false", "--checkpoint.async_mode", "async",
        "--checkpoint.last_save_in_hf", "true",
    ]])[0]
    seed_run = [*BASE, "--job.dump_folder", str(tmp / "seed"), "--checkpoint.create_seed_checkpoint", "true"]
    assert train(load_config([*seed_run, "--debug.seed", "7"])) == []

    two_ranks = {
        "fsdp2": [*_resume(tmp, "fsdp2", 2), *FSDP2],
        "tp2": [*_resume(tmp, "tp2", 1), *TP2],
        "fsdp2_from_hf": [*BASE, *FSDP2, "--job.dump_folder", str(tmp / "hf"), "--training.steps", "1",
                          "--checkpoint.initial_load_path", str(tmp / "fsdp4" / "checkpoint" / "step-4-hf"),
                          "--checkpoint.initial_load_in_hf", "true"],
        "seed_on_two_ranks": [*seed_run, "--checkpoint.folder", "again"],
        "fsdp2_from_seed": [*BASE, *FSDP2, "--job.dump_folder", str(tmp / "run"), "--training.steps", "1",
                            "--checkpoint.initial_load_path", str(tmp / "seed" / "checkpoint" / "step-0")],
    }
    results = run_on_ranks(_train_and_capture, 2, list(two_ranks.values()))[0]
    return tmp, uninterrupted, dict(zip(two_ranks, results))


def test_fsdp4_checkpoint_resumes_under_fsdp2_tp2_and_one_process(runs):
    tmp, uninterrupted, results = runs
    step_dir = tmp / "fsdp4" / "checkpoint" / "step-2"
    saved = read_dcp(step_dir)
    assert saved["train_state"] == {"step": 2, "model": "llama3/debugmodel", "optimizer": [["default", "adamw", 0.1, 1.0, "all", ""]],
                                    "batch": [8, 32], "routed": 64}  # sequences per step, seq_len; a rank's 2 x 32 tokens
    # One process takes the whole state from initial_load_path into an empty checkpoint folder.
    single = _train_and_capture(0, 1, [[*BASE, "--training.steps", "4", "--training.local_batch_size", "8",
                                        "--job.dump_folder", str(tmp / "single"),
                                        "--checkpoint.enable", "true", "--checkpoint.initial_load_path", str(step_dir),
                                        "--checkpoint.initial_load_model_only", "false"]])[0]
    for layout, (history, state) in (("fsdp2", results["fsdp2"]), ("tp2", results["tp2"]), ("single", single)):
        assert_close(state["model"], saved["model"], rtol=0, atol=0, msg=lambda m: f"{layout} model: {m}")
        assert_close(state["optimizer"], saved["optimizer"], rtol=0, atol=0, msg=lambda m: f"{layout} optimizer: {m}")
        assert [h["step"] for h in history] == [3, 4], layout
        for got, want in zip(history, uninterrupted[2:]):
            assert got["loss"] == pytest.approx(want["loss"], rel=3e-7), layout
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=3e-7), layout


def test_hf_export_under_fsdp4_loads_back_under_fsdp2(runs):
    tmp, _, results = runs
    saved = read_dcp(tmp / "fsdp4" / "checkpoint" / "step-4", only="model")
    spec = get_model_spec("llama3")
    exported = load_hf(tmp / "fsdp4" / "checkpoint" / "step-4-hf")
    assert_close(spec.hf_adapter.from_hf(exported, spec.flavors["debugmodel"]), saved, rtol=0, atol=0)
    history, state = results["fsdp2_from_hf"]
    assert [h["step"] for h in history] == [1]
    assert_close(state["model"], saved, rtol=0, atol=0)


def test_seed_checkpoint_starts_every_rank_from_its_weights(runs):
    tmp, _, results = runs
    seed = read_dcp(tmp / "seed" / "checkpoint" / "step-0")
    assert set(seed) == {"model"}
    assert results["seed_on_two_ranks"][0].startswith("checkpoint.create_seed_checkpoint needs a single process, not 2")
    history, state = results["fsdp2_from_seed"]
    assert [h["step"] for h in history] == [1]
    assert_close(state["model"], seed["model"], rtol=0, atol=0)
    own = _train_and_capture(0, 1, [[*BASE, "--job.dump_folder", str(tmp / "own"), "--training.steps", "1"]])[0][1]
    with pytest.raises(AssertionError):  # a run's own initial weights (seed 0) are other ones
        assert_close(own["model"], seed["model"], rtol=0, atol=0)
