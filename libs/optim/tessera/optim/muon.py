"""Muon for plain and sharded (DTensor) matrices: torch.optim.Muon's update, made whole where a
mesh splits the matrices (tessera.optim.owners), and applied to each matrix of a stack (MoE
experts: one update per expert)."""

from __future__ import annotations

from typing import Iterable

import torch

from tessera.optim.newton_schulz import COEFFICIENTS, EPS, STEPS, adjusted_lr, orthogonalise
from tessera.optim.owners import apply_whole, whole_locally
from tessera.optim.stepping import closure_loss, local, local_grad


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update, with its arguments and defaults, for parameters of two or more
    dimensions (the last two the matrix), plain or DTensor under any mesh.

    On plain 2-D tensors it equals torch.optim.Muon to the bit. A DTensor whose mesh splits the
    matrix has each matrix orthogonalised whole by one owner rank (owners taken in turn), so the
    result equals the one-process result; every rank of the mesh must step the same parameters
    (gradients present on all or none). ns_dtype: the Newton–Schulz iteration's dtype (torch
    and the Muon post use bfloat16); the momentum buffer is a DTensor placed like its parameter,
    so checkpoints reshard it.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = COEFFICIENTS, eps: float = EPS,
                 ns_steps: int = STEPS, adjust_lr_fn: str | None = None, ns_dtype: torch.dtype = torch.bfloat16) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"Muon needs lr, momentum and weight_decay >= 0 (got {lr}, {momentum}, {weight_decay})")
        adjusted_lr(1.0, 1, 1, adjust_lr_fn or "original")  # an unknown rule fails here, not at the first step
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        ns_dtype=ns_dtype)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Muon takes matrices (or stacks of them); got a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        sharded = 0  # the owner of the next sharded matrix, in turn
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]

            def ns(u, group=group):
                return orthogonalise(u, coefficients=group["ns_coefficients"], steps=group["ns_steps"],
                                     eps=group["eps"], dtype=group["ns_dtype"])

            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                grad, buf = local_grad(p), local(state["momentum_buffer"])
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                if whole_locally(p):
                    update = ns(update)
                else:
                    update = apply_whole(p, update.to(group["ns_dtype"]), sharded, ns)
                    sharded += 1
                rows, cols = p.shape[-2:]
                param = local(p)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-adjusted_lr(lr, rows, cols, group["adjust_lr_fn"] or "original"))
        return loss
