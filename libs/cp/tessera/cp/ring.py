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

Forward and backward are custom ops (``tessera_cp::ring_attention`` and its backward), which
torch.compile keeps whole as single nodes of a block's graph: traced into, torch 2.13's ring
backward fails dynamo ("An intermediate tensor ... created inside a higher-order op subgraph
aliases an input or output": dynamo speculates an autograd.Function's backward as a subgraph, and
the ring's merging appends to Python lists; pytorch/pytorch#121386 tracks torch.compile with ring
attention). The process group travels by name.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
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


def _flash_rest(query: torch.Tensor, key: torch.Tensor) -> dict:
    """What CUDA's flash backward takes besides out and logsumexp, as its forward returns it
    without dropout (no sequence offsets, RNG state unused); the CPU kernel takes none."""
    if query.device.type == "cpu":
        return {}
    unused = torch.empty((), dtype=torch.long)
    return {"cum_seq_q": None, "cum_seq_k": None, "max_q": query.shape[2], "max_k": key.shape[2],
            "philox_seed": unused, "philox_offset": unused}


def _fresh(outputs, inputs) -> tuple[torch.Tensor, ...]:
    """The outputs contiguous and sharing memory with no input and no other output, as a custom
    op must return them (the flash kernels return [batch, seq, heads, dim] layouts; the ring hands
    dK and dV back as views of one buffer). Judged by storage, which a dispatch mode below
    autograd (tools/estimate's byte counter) cannot hide, unlike ``_base``."""
    taken, fresh = {t.untyped_storage().data_ptr() for t in inputs}, []
    for t in outputs:
        if t.untyped_storage().data_ptr() in taken or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        taken.add(t.untyped_storage().data_ptr())
        fresh.append(t)
    return tuple(fresh)


@torch.library.custom_op("tessera_cp::ring_attention", mutates_args=())
def _ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, rotate_method: str,
          load_balance: bool) -> tuple[torch.Tensor, torch.Tensor]:
    with _ring_options(rotate_method, load_balance):
        out, lse, *_ = torch_ring._templated_ring_attention(
            _resolve_process_group(group_name), 2, _forward_kernel(q.device.type), q, k, v, is_causal=True,
            dropout_p=0.0)
    return _fresh((out, lse), (q, k, v))


@_ring.register_fake
def _(q, k, v, group_name, rotate_method, load_balance):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("tessera_cp::ring_attention_backward", mutates_args=())
def _ring_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, group_name: str, rotate_method: str,
                   load_balance: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with _ring_options(rotate_method, load_balance):
        dq, dk, dv, *_ = torch_ring._templated_ring_attention_backward(
            _resolve_process_group(group_name), 2, _backward_kernel(q.device.type), grad_out, "grad_out", q, k, v,
            out, lse, is_causal=True, dropout_p=0.0, **_flash_rest(q, k))
    return _fresh((dq, dk, dv), (grad_out, q, k, v, out, lse))


@_ring_backward.register_fake
def _(grad_out, q, k, v, out, lse, group_name, rotate_method, load_balance):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save(ctx, inputs, output):
    q, k, v, ctx.group_name, ctx.rotate_method, ctx.load_balance = inputs
    ctx.save_for_backward(q, k, v, *output)


def _ring_grad(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _ring_backward(grad_out.contiguous(), q, k, v, out, lse, ctx.group_name, ctx.rotate_method,
                                ctx.load_balance)
    return dq, dk, dv, None, None, None


_ring.register_autograd(_ring_grad, setup_context=_save)


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
        return _ring(q, k, v, self.group.group_name, self.rotate_method, self.load_balance)[0]
