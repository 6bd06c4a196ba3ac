"""Helpers the parallelism libraries share to act on modules and tensors (their one home;
tessera.models' attention kernels use the K/V repeat too): a class swap that keeps a module's
state-dict keys, hooks and FSDP wrapping; a module's DTensor parameters seen as local tensors
while its own forward runs; K/V heads repeated to the query heads of grouped-query attention
and their gradients folded back."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

_SWAPPED: dict[tuple[str, type], type] = {}


def swapped_class(cls: type, prefix: str, make_forward: Callable[[type], Callable]) -> type:
    """The subclass ``<prefix><cls.__name__>`` of ``cls`` whose forward is ``make_forward(cls)``,
    made once per (prefix, cls): assign it to ``module.__class__``, as ``fully_shard`` does."""
    key = (prefix, cls)
    if key not in _SWAPPED:
        _SWAPPED[key] = type(f"{prefix}{cls.__name__}", (cls,), {"forward": make_forward(cls)})
    return _SWAPPED[key]


@contextmanager
def local_parameters(module: nn.Module, view: Callable[[DTensor], torch.Tensor]):
    """The module's own DTensor parameters replaced by ``view(param)`` (a differentiable local
    tensor) while the block runs; the DTensors are put back after, so optimizers, checkpoints
    and FSDP keep seeing them."""
    saved = dict(module._parameters)
    try:
        for name, param in saved.items():
            if isinstance(param, DTensor):
                module._parameters[name] = view(param)
        yield
    finally:
        module._parameters.update(saved)


def repeat_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, kv_heads, seq, head_dim] -> [batch, heads, seq, head_dim]: each K/V head serves the
    heads // kv_heads consecutive query heads of its group."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def fold_kv_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Gradient of repeat_kv_heads: each K/V head's group of query heads summed."""
    batch, heads, seq, dim = grad.shape
    return grad if heads == kv_heads else grad.view(batch, kv_heads, heads // kv_heads, seq, dim).sum(2)
