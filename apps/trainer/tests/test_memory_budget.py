"""activation_checkpoint.mode memory_budget, as torchtitan 0.2.2 means it: compile's min-cut
partitioner chooses what the compiled blocks keep for backward within memory_budget. One
forward and backward of a fixed batch at budgets 0, 0.5 and 1: the loss and every gradient within
1e-5 of the eager run's (inductor sums in another order), the bytes saved for backward growing
with the budget (0 fewer than 1) and all fewer than eager's; visualize_memory_budget_pareto writes the Pareto fronts
under the dump folder; the plan refuses the mode without compile and the keys without the mode."""

import pytest
import torch

from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.parallelize import build_parallel_model
from tessera.trainer.plan import make_plan
from tessera.trainer.step import build_loss, plain_forward_backward

SEQ, ROWS = 32, 2
COMPILED = ["--compile.enable", "true", "--compile.components", "model", "--activation_checkpoint.mode", "memory_budget"]


def _argv(tmp_path, *extra):
    return ["--training.seq_len", str(SEQ), "--training.local_batch_size", str(ROWS),
            "--job.dump_folder", str(tmp_path), *extra]


def _one_step(argv):
    """(loss, {name: gradient}, bytes saved for backward) of one forward and backward."""
    plan = make_plan(load_config(argv), 1, "cpu")
    torch.manual_seed(0)
    loss_fn = build_loss(plan)
    model = build_parallel_model(plan, None, loss_fn).parts[0]
    params = {id(p) for p in model.parameters()}
    tokens = torch.randint(0, plan.model_args.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    saved = [0]

    def pack(t):
        if id(t) not in params:
            saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = plain_forward_backward(model, loss_fn, plan)(tokens[:, :-1], tokens[:, 1:])
    grads = {name.replace("._orig_mod", ""): p.grad for name, p in model.named_parameters()}
    return loss, grads, saved[0]


def test_budgets_keep_less_and_train_as_eager(tmp_path):
    want_loss, want, eager_saved = _one_step(_argv(tmp_path))
    saved = {}
    for budget in (0.0, 0.5, 1.0):
        loss, grads, saved[budget] = _one_step(_argv(tmp_path, *COMPILED, "--activation_checkpoint.memory_budget",
                                                     str(budget), "--activation_checkpoint.visualize_memory_budget_pareto",
                                                     str(budget == 0.5).lower()))
        assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
        assert grads.keys() == want.keys()
        for name, grad in want.items():
            worst, scale = (grads[name] - grad).abs().max().item(), grad.abs().max().item()
            assert worst <= 1e-5 * scale, f"budget {budget} {name}: off by {worst:.3g}, largest entry {scale:.3g}"
    assert saved[0.0] <= saved[0.5] <= saved[1.0] < eager_saved and saved[0.0] < saved[1.0]
    # (the partitioner plots its front only between the ends, where it searches)
    assert list((tmp_path / "memory_budget_pareto").glob("memory_budget_pareto*.svg"))


@pytest.mark.parametrize("extra, message", [
    (["--activation_checkpoint.mode", "memory_budget"], "mode memory_budget lets compile's partitioner choose"),
    (["--activation_checkpoint.mode", "full", "--activation_checkpoint.memory_budget", "0.2"],
     "activation_checkpoint.memory_budget applies only with activation_checkpoint.mode memory_budget"),
    (["--activation_checkpoint.visualize_memory_budget_pareto", "true"], "visualize_memory_budget_pareto applies only"),
])
def test_memory_budget_keys_need_their_mode_and_compile(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        make_plan(load_config(_argv(tmp_path, *extra)), 1, "cpu")


def test_memory_budget_is_a_fraction(tmp_path):
    with pytest.raises(ConfigError, match="memory_budget"):
        load_config(_argv(tmp_path, *COMPILED, "--activation_checkpoint.memory_budget", "1.5"))
