"""Muon's orthogonalisation: Newton–Schulz's quintic iteration, which maps a matrix G = U S V^T to
roughly U S' V^T with S' near 1 (Jordan et al., "Muon: An optimizer for hidden layers in neural
networks", 2024), on each matrix of a stack (..., rows, cols)."""

from __future__ import annotations

import math

import torch

# The quintic's coefficients, chosen in the Muon post to maximise the slope at zero.
COEFFICIENTS = (3.4445, -4.7750, 2.0315)
STEPS = 5
EPS = 1e-7


def _mm_add(input: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float, alpha: float = 1.0) -> torch.Tensor:
    """beta * input + alpha * (a @ b), per matrix of a stack."""
    if input.ndim == 2:
        return torch.addmm(input, a, b, beta=beta, alpha=alpha)
    return torch.baddbmm(input.flatten(0, -3), a.flatten(0, -3), b.flatten(0, -3), beta=beta, alpha=alpha).view(input.shape)


def orthogonalise(update: torch.Tensor, *, coefficients: tuple[float, float, float] = COEFFICIENTS, steps: int = STEPS,
                  eps: float = EPS, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """X <- a X + (b X X^T + c (X X^T)^2) X, steps times, from X = G / ||G||_F (spectral norm at most
    1), on the wide orientation of each matrix. On a 2-D matrix this is torch.optim.Muon's operation
    by operation, so the two agree to the bit; dtype is the iteration's (bfloat16 in the post and
    in torch)."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    norm = x.norm() if x.ndim == 2 else x.norm(dim=(-2, -1), keepdim=True)
    x = x / norm.clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = _mm_add(x, _mm_add(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, rows: int, cols: int, rule: str) -> float:
    """The step size of a rows x cols matrix's orthogonalised update. "original" (the post's):
    lr * sqrt(max(1, rows / cols)); "match_rms_adamw" (Liu et al., "Muon is Scalable for LLM
    Training", 2025): lr * 0.2 * sqrt(max(rows, cols)), an update RMS like AdamW's, so AdamW's lr
    and weight decay carry over."""
    if rule == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Muon adjust_lr_fn must be 'original' or 'match_rms_adamw', not {rule!r}")
