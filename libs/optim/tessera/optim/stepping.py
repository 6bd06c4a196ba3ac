"""What every optimizer step here shares: the closure contract of torch's optimizers, and the
local shard of a DTensor (elementwise updates run on it)."""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """p's gradient as the local tensor of p's own layout: a gradient may come placed otherwise
    (the vocab-parallel embedding's is the whole vocabulary's, partial over the ranks)."""
    grad = p.grad
    if isinstance(grad, DTensor) and grad.placements != p.placements:
        grad = grad.redistribute(p.device_mesh, p.placements)
    return local(grad)


def closure_loss(closure: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    """step(closure)'s loss: the closure re-evaluated with gradients on, as torch's optimizers do."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
