"""PyTorch's ring attention, called on this rank's plain tensors.

torch 2.13's ``context_parallel`` reaches its ring only through DTensor dispatch of the CUDA
SDPA kernels, so it has no CPU path. The ring itself (``_templated_ring_attention`` and its
backward: per step one flash-attention call on the K/V shard at hand, partial outputs merged by
log-sum-exp, the head-tail causal load balance, K/V rotated by all-to-all or gathered once) takes
the kernel as an argument; this module hands it the device's flash kernel — CUDA's or the CPU
one — so the same ring runs, and is tested, on gloo. The functions are private to torch: a torch
upgrade that changes them fails libs/cp's ring tests, not a run.

Grouped-query attention: only the kv_heads K/V heads travel the ring; they are repeated to the
query heads at each kernel call and their gradients summed back over each group.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_ring

from tessera.mesh import fold_kv_heads, repeat_kv_heads

ROTATE_METHODS = {"allgather": torch_ring._RotateMethod.ALL_GATHER, "alltoall": torch_ring._RotateMethod.ALL_TO_ALL}
aten = torch.ops.aten


@contextlib.contextmanager
def _ring_options(rotate_method: str, load_balance: bool):
    """torch's ring reads its rotation and load balance from module state: set them for one call."""
    options = torch_ring._cp_options
    saved = options.rotate_method, options.enable_load_balance
    options.rotate_method, options.enable_load_balance = ROTATE_METHODS[rotate_method], load_balance
    try:
        yield
    finally:
        options.rotate_method, options.enable_load_balance = saved


def _forward_kernel(device_type: str):
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default if device_type == "cpu" else aten._scaled_dot_product_flash_attention.default

    def kernel(q, k, v, **kwargs):
        return flash(q, repeat_kv_heads(k, q.shape[1]), repeat_kv_heads(v, q.shape[1]), **kwargs)
    return kernel


def _backward_kernel(device_type: str):
    flash = (aten._scaled_dot_product_flash_attention_for_cpu_backward.default if device_type == "cpu"
             else aten._scaled_dot_product_flash_attention_backward.default)

    def kernel(*, grad_out, query, key, value, **kwargs):
        heads, kv_heads = query.shape[1], key.shape[1]
        dq, dk, dv, *rest = flash(grad_out=grad_out.contiguous(), query=query, key=repeat_kv_heads(key, heads),
                                  value=repeat_kv_heads(value, heads), **kwargs)
        return dq, fold_kv_heads(dk, kv_heads), fold_kv_heads(dv, kv_heads), *rest
    return kernel


# CUDA's flash kernel returns what its backward needs besides out and logsumexp; the CPU one does not.
_CUDA_REST = ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset")


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: dist.ProcessGroup, rotate_method: str, load_balance: bool):
        device = q.device.type
        with _ring_options(rotate_method, load_balance):
            out, lse, *rest = torch_ring._templated_ring_attention(
                group, 2, _forward_kernel(device), q, k, v, is_causal=True, dropout_p=0.0)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.rotate_method, ctx.load_balance = group, rotate_method, load_balance
        ctx.rest = {} if device == "cpu" else dict(zip(_CUDA_REST, rest))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        with _ring_options(ctx.rotate_method, ctx.load_balance):
            dq, dk, dv, *_ = torch_ring._templated_ring_attention_backward(
                ctx.group, 2, _backward_kernel(q.device.type), grad_out, "grad_out", q, k, v, out, lse,
                is_causal=True, dropout_p=0.0, **ctx.rest)
        return dq, dk, dv, None, None, None


class RingAttention:
    """Context parallel's ring exchange for a model's inner attention (the convention of
    ``tessera.models.attention``: ``kind`` "ring"): ``attend(q [batch, heads, local_seq, head_dim],
    k, v [batch, kv_heads, local_seq, head_dim])`` -> out, exact causal attention of the whole
    sequence for this rank's queries by torch's ring. The shards must be laid out as
    ``local_positions(..., load_balance)`` lays them. Plain causal attention only: the flash
    kernels take no other mask and return no log-sum-exp for sinks."""

    kind = "ring"

    def __init__(self, group: dist.ProcessGroup, rotate_method: str = "alltoall", load_balance: bool = True) -> None:
        if rotate_method not in ROTATE_METHODS:
            raise ValueError(f"rotate_method {rotate_method!r}: one of {sorted(ROTATE_METHODS)}")
        self.group, self.rotate_method, self.load_balance = group, rotate_method, load_balance

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _Ring.apply(q, k, v, self.group, self.rotate_method, self.load_balance)
