"""tessera.optim.Muon on one process: torch.optim.Muon to the bit on matrices, the update written
from the formula in float64, and stacks of matrices (experts) updated one matrix at a time."""

import pytest
import torch

from tessera.optim import Muon, adjusted_lr, orthogonalise


def _steps(optimizer_cls, params, grads, **kwargs):
    params = [p.clone().requires_grad_() for p in params]
    optimizer = optimizer_cls(params, **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_equals_torch_muon(adjust_lr_fn, nesterov):
    torch.manual_seed(0)
    shapes = [(16, 24), (40, 12), (8, 8)]  # wide, tall (transposed inside), square
    params = [torch.randn(s) * 0.1 for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(4)]
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    for ours, theirs in zip(_steps(Muon, params, grads, **kwargs), _steps(torch.optim.Muon, params, grads, **kwargs)):
        assert torch.equal(ours, theirs)


def _formula_step(p, buf, g, lr, wd, mu, a, b, c, steps):
    """One Muon step as its paper states it, in float64: B = mu B + (1 - mu) g (torch's lerp
    form), Nesterov's g + mu (B - g), X0 = update / ||update||_F on the wide side, then
    X <- a X + b (X X^T) X + c (X X^T)^2 X, decay, and the step lr * 0.2 sqrt(max(m, n))."""
    buf = mu * buf + (1 - mu) * g
    x = g + mu * (buf - g)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / torch.linalg.matrix_norm(x)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    x = x.T if tall else x
    p = p * (1 - lr * wd) - lr * 0.2 * max(p.shape) ** 0.5 * x
    return p, buf


def test_equals_the_formula_in_float64():
    torch.manual_seed(1)
    p = torch.randn(12, 20, dtype=torch.float64) * 0.1
    grads = [[torch.randn(12, 20, dtype=torch.float64)] for _ in range(3)]
    coefficients = (3.4445, -4.7750, 2.0315)
    (ours,) = _steps(Muon, [p], grads, lr=0.01, weight_decay=0.05, momentum=0.95, adjust_lr_fn="match_rms_adamw",
                     ns_dtype=torch.float64, ns_coefficients=coefficients)
    ref, buf = p, torch.zeros_like(p)
    for (g,) in grads:
        ref, buf = _formula_step(ref, buf, g, 0.01, 0.05, 0.95, *coefficients, 5)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


def test_orthogonalise_brings_singular_values_near_one():
    torch.manual_seed(2)
    g = torch.randn(32, 48) @ torch.diag(torch.logspace(-2, 1, 48))  # badly conditioned
    s = torch.linalg.svdvals(orthogonalise(g, dtype=torch.float32))
    assert s.min() > 0.5 and s.max() < 1.3, s


def test_stack_updates_each_matrix_as_its_own():
    torch.manual_seed(3)
    experts = torch.randn(3, 10, 6) * 0.1
    grads = [[torch.randn(3, 10, 6)] for _ in range(3)]
    kwargs = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32)
    (stacked,) = _steps(Muon, [experts], grads, **kwargs)
    for e in range(3):
        (alone,) = _steps(Muon, [experts[e]], [[g[e]] for (g,) in grads], **kwargs)
        torch.testing.assert_close(stacked[e], alone, rtol=1e-5, atol=1e-6)


def test_refusals():
    with pytest.raises(ValueError, match=r"Muon takes matrices .*shape \(4,\)"):
        Muon([torch.zeros(4, requires_grad=True)])
    with pytest.raises(ValueError, match="adjust_lr_fn must be 'original' or 'match_rms_adamw', not 'spectral'"):
        Muon([torch.zeros(4, 4, requires_grad=True)], adjust_lr_fn="spectral")


def test_adjusted_lr_rules():
    assert adjusted_lr(0.1, 40, 10, "original") == pytest.approx(0.2)
    assert adjusted_lr(0.1, 10, 40, "original") == pytest.approx(0.1)
    assert adjusted_lr(0.1, 10, 400, "match_rms_adamw") == pytest.approx(0.4)
