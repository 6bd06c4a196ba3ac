"""Context parallel for any mask, by all-gathering K and V, and the exchange a model's attention gets.

The scheme the Llama 3 paper used for long-context training: every rank all-gathers the keys and
values of the whole sequence, attends its own queries to them under the mask written in global
positions, and in backward the key/value gradients go back to their owners summed over ranks
(reduce-scatter). Communication is two all-gathers per layer forward and two reduce-scatters
backward; it needs no custom kernel, so any mask the model's own kernel applies (documents,
sliding windows, chunks, attention sinks) works, on CPU (gloo) and GPU (NCCL) alike. Under
grouped-query attention only the fewer K/V heads travel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.cp.ring import RingAttention
from tessera.cp.sharding import local_positions, local_runs


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (sequence of [batch, heads, seq, head_dim]) in rank order; backward
    sums the gradient over ranks and keeps this rank's part."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, cp = ctx.group, dist.get_world_size(ctx.group)
        if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter: sum all of it, keep ours
            total = grad.contiguous().clone()
            dist.all_reduce(total, group=group)
            return total.chunk(cp, dim=2)[dist.get_rank(group)].contiguous(), None
        parts = [part.contiguous() for part in grad.chunk(cp, dim=2)]
        mine = torch.empty_like(parts[0])
        dist.reduce_scatter(mine, parts, group=group)
        return mine, None


class KVGather:
    """Context parallel's all-gather-KV exchange for a model's inner attention (the convention of
    ``tessera.models.attention``: ``kind`` "gather"). ``gather(k, v, documents)`` takes this
    rank's K, V [batch, kv_heads, local_seq, head_dim] and document ids [batch, local_seq] (or
    None) and returns the whole sequence's K, V and ids in index order, with this rank's queries
    as runs of consecutive indices (start, count): the attention itself, with whatever mask the
    layer has, stays the model's. K/V gradients return to their owners summed over the ranks."""

    kind = "gather"

    def __init__(self, group: dist.ProcessGroup, load_balance: bool = True) -> None:
        self.group, self.load_balance = group, load_balance
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def gather(self, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None):
        seq_len = k.shape[2] * self.cp
        gathered = torch.cat([local_positions(seq_len, self.cp, r, self.load_balance, k.device) for r in range(self.cp)])
        order = gathered.argsort()  # row p of the result: the gathered row holding index p
        k, v = (_GatherSequence.apply(x, self.group).index_select(2, order) for x in (k, v))
        if documents is not None:
            everyone = [torch.empty_like(documents) for _ in range(self.cp)]
            dist.all_gather(everyone, documents.contiguous(), group=self.group)
            documents = torch.cat(everyone, dim=1).index_select(1, order)
        return k, v, documents, local_runs(seq_len, self.cp, self.rank, self.load_balance)


def apply_cp(model: nn.Module, cp_group: dist.ProcessGroup, load_balance: bool = True, rotate_method: str = "allgather",
             gathered_kernel: bool = False, name: str = "inner_attention") -> int:
    """Gives every submodule called `name` that has a ``context_parallel`` attribute (the seam of
    ``tessera.models.attention.InnerAttention``) its context-parallel exchange; returns how many.
    rotate_method (torchtitan's context_parallel_rotate_method) says how K/V reach the other
    ranks, as in torch's ring: "allgather", gathered once per layer, or "alltoall", passed rank to
    rank while each step attends. The exchange is torch's ring on the device's flash kernel
    (``RingAttention``: plain causal attention only), or with gathered_kernel ``KVGather``, under
    which the layer's own kernel applies any mask (documents, windows, chunks, sinks); always
    "allgather". The model must then be fed this rank's tokens (sharding.local_positions) and
    their positions. The modules' parameters (attention sinks) stay where they are."""
    if rotate_method not in ("allgather", "alltoall"):
        raise ValueError(f"rotate_method {rotate_method!r}: 'allgather' or 'alltoall'")
    if gathered_kernel and rotate_method != "allgather":
        raise ValueError("the all-gather-KV exchange gathers: rotate_method 'allgather'")
    exchange = KVGather(cp_group, load_balance) if gathered_kernel else RingAttention(cp_group, rotate_method, load_balance)
    swapped = 0
    for module in list(model.modules()):
        inner = getattr(module, name, None)
        if isinstance(inner, nn.Module) and hasattr(inner, "context_parallel"):
            inner.context_parallel = exchange
            swapped += 1
    if not swapped:
        raise ValueError(f"{type(model).__name__} has no '{name}' submodule with a context_parallel seam to set")
    return swapped
