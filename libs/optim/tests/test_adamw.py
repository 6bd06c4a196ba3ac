"""tessera.optim.AdamW: torch's AdamW update with the moments stored in another dtype."""

import pytest
import torch

from tessera.optim import AdamW


def _run(optimizer_cls, steps=5, **kwargs):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 8) * 0.1), torch.nn.Parameter(torch.randn(8))]
    optimizer = optimizer_cls(params, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, **kwargs)
    grads = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads)
        optimizer.step()
    return params, optimizer


def test_float32_state_equals_torch_adamw():
    ours, _ = _run(AdamW, state_dtype=torch.float32)
    theirs, _ = _run(torch.optim.AdamW, foreach=False)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_param_groups_keep_their_own_lr_weight_decay_and_betas():
    """The trainer's groups (no decay on norms and embeddings, a scaled lr): each group's own
    hyperparameters, as torch's AdamW applies them."""
    def run(optimizer_cls, **kwargs):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(16, 8) * 0.1), torch.nn.Parameter(torch.randn(8))]
        groups = [{"params": [params[0]], "weight_decay": 0.1},
                  {"params": [params[1]], "weight_decay": 0.0, "lr": 0.03, "betas": (0.8, 0.9)}]
        optimizer = optimizer_cls(groups, lr=0.01, betas=(0.9, 0.95), weight_decay=0.5, **kwargs)
        grads = torch.Generator().manual_seed(1)
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads)
            optimizer.step()
        return params

    for a, b in zip(run(AdamW, state_dtype=torch.float32), run(torch.optim.AdamW, foreach=False)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_bfloat16_state_halves_the_moments_and_stays_close():
    ours, optimizer = _run(AdamW, state_dtype=torch.bfloat16)
    theirs, _ = _run(torch.optim.AdamW, foreach=False)
    state = optimizer.state[ours[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16 and ours[0].dtype == torch.float32
    for a, b, start in zip(ours, theirs, _run(AdamW, steps=0)[0]):
        moved = (b - start).abs().max()
        assert (a - b).abs().max() < 0.02 * moved  # bf16 moments: ~2^-8 relative each step


def test_refusals():
    with pytest.raises(ValueError, match="AdamW needs lr, eps, weight_decay >= 0 and betas in"):
        AdamW([torch.nn.Parameter(torch.zeros(2))], betas=(0.9, 1.0))


def test_loading_keeps_the_moments_in_their_dtype():
    params, optimizer = _run(AdamW, state_dtype=torch.bfloat16)
    fresh = AdamW(params, lr=0.01, state_dtype=torch.bfloat16)
    fresh.load_state_dict(optimizer.state_dict())  # torch casts state to the parameter's dtype
    state = fresh.state[params[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert torch.equal(state["exp_avg"], optimizer.state[params[0]]["exp_avg"])
