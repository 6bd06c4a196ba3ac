"""activation_checkpoint.mode offload: each block's saved tensors copied to host memory in
forward and back for backward (tessera.models.offload_activations). Nothing is recomputed, so a
run trains as mode none does: on one process losses and grad norms equal, and under FSDP
(resharded after forward: the regathered weights are parameters, never copied), TP and PP (a
split backward reads each copy twice) within 1e-5 relative of the one-process run of mode none."""

import pytest
import torch

from tessera.mesh.testing import run_on_ranks
from tessera.models import offload as offload_module
from tessera.trainer.config import load_config
from tessera.trainer.parallelize import build_parallel_model
from tessera.trainer.plan import make_plan
from tessera.trainer.step import build_loss, plain_forward_backward
from tessera.trainer.train import train

STEPS = 3
TRAIN = ["--training.seq_len", "32", "--metrics.log_freq", "1", "--training.steps", str(STEPS),
         "--lr_scheduler.warmup_steps", "1"]
OFFLOAD = ["--activation_checkpoint.mode", "offload"]
LAYOUTS = {  # 2 ranks each: flags, data-parallel ranks
    "fsdp2_always": (["--parallelism.fsdp_reshard_after_forward", "always"], 2),
    "tp2": (["--parallelism.tensor_parallel_degree", "2"], 1),
    "pp2_zero_bubble": (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                         "ZBVZeroBubble", "--parallelism.pipeline_parallel_microbatch_size", "1"], 1),
}


def _train_rank(rank, world_size, argv):
    return train(load_config(argv))


def _argv(tmp_path, rows, *extra):
    return [*TRAIN, "--training.local_batch_size", str(rows), "--job.dump_folder", str(tmp_path), *extra]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """One process, mode none, per global batch (2 rows per data-parallel rank)."""
    runs = {}

    def run(dp):
        if dp not in runs:
            runs[dp] = run_on_ranks(_train_rank, 1, _argv(tmp_path_factory.mktemp("plain"), 2 * dp))[0]
        return runs[dp]

    return run


def _assert_same(history, reference, rel, label):
    assert [e["step"] for e in history] == [e["step"] for e in reference] == list(range(1, STEPS + 1))
    for entry, ref in zip(history, reference):
        for key in ("loss", "grad_norm"):
            assert entry[key] == pytest.approx(ref[key], rel=rel), f"{label} step {ref['step']} {key}"


def _kept_and_copied(argv, monkeypatch) -> tuple[int, int]:
    """Bytes one forward keeps for backward in place, and bytes it copies to host."""
    plan = make_plan(load_config(argv), 1, "cpu")
    loss_fn = build_loss(plan)
    model = build_parallel_model(plan, None, loss_fn).parts[0]
    params = {id(p) for p in model.parameters()}
    kept, copied, to_host = [0], [0], offload_module.copy_to_host

    def keep(t):
        kept[0] += 0 if id(t) in params else t.numel() * t.element_size()
        return t

    def copy(t):
        copied[0] += t.numel() * t.element_size()
        return to_host(t)

    monkeypatch.setattr(offload_module, "copy_to_host", copy)
    tokens = torch.randint(0, plan.model_args.vocab_size, (2, 33))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):  # the blocks' own hooks come inside
        plain_forward_backward(model, loss_fn, plan)(tokens[:, :-1], tokens[:, 1:])
    return kept[0], copied[0]


def test_the_trainer_offloads_every_block(tmp_path, monkeypatch):
    kept_plain, _ = _kept_and_copied(_argv(tmp_path, 2), monkeypatch)
    kept, copied = _kept_and_copied(_argv(tmp_path, 2, *OFFLOAD), monkeypatch)
    assert copied > 0 and kept < kept_plain / 2  # what stays: the embedding's and the head's


def test_offload_on_a_cpu_is_said_to_save_nothing(tmp_path):
    plan = make_plan(load_config(_argv(tmp_path, 2, *OFFLOAD)), 1, "cpu")
    assert any("offload on a CPU" in w and "saves nothing" in w for w in plan.warnings)
    assert not any("offload" in w for w in make_plan(load_config(_argv(tmp_path, 2, *OFFLOAD)), 1, "cuda",
                                                     check_only=True).warnings)


def test_offload_trains_exactly_as_none_on_one_process(tmp_path, plain_run):
    history = run_on_ranks(_train_rank, 1, _argv(tmp_path, 2, *OFFLOAD))[0]
    _assert_same(history, plain_run(1), 0, "one process")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_offload_trains_as_none_under_every_layout(tmp_path, plain_run, layout):
    extra, dp = LAYOUTS[layout]
    for history in run_on_ranks(_train_rank, 2, _argv(tmp_path, 2, *extra, *OFFLOAD)):
        _assert_same(history, plain_run(dp), 1e-5, layout)
