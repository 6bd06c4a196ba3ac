"""Exact causal attention over a sequence split across the cp ranks, by all-gathering K and V.

The scheme the Llama 3 paper used for long-context training: every rank all-gathers the keys and
values of the whole sequence, attends its own queries to them under the causal mask written in
global positions, and in backward the key/value gradients go back to their owners summed over
ranks (reduce-scatter). Communication is two all-gathers per layer forward and two
reduce-scatters backward; unlike a ring it needs no custom kernel, so it runs wherever
scaled_dot_product_attention with a boolean mask runs: CPU (gloo) and GPU (NCCL) alike. Under
grouped-query attention only the fewer K/V heads travel; they are repeated to the query heads
after the gather (and their gradients summed back before the reduce-scatter, by autograd).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.cp.ring import RingAttention, repeat_kv
from tessera.cp.sharding import local_positions


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


class AllGatherKVAttention(nn.Module):
    """A drop-in for a model's inner attention (q [batch, heads, local_seq, head_dim], k, v
    [batch, kv_heads, local_seq, head_dim] with kv_heads dividing heads -> out): the q, k, v of
    this rank's tokens in, the output of its queries over the whole
    sequence out, exactly causal attention of the full sequence restricted to these queries."""

    def __init__(self, group: dist.ProcessGroup, load_balance: bool = True) -> None:
        super().__init__()
        self.group, self.load_balance = group, load_balance
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """document_ids: [batch, local_seq] of this rank's tokens, for block-causal masking of
        windows that pack several documents; the keys' ids are gathered like the keys."""
        seq_len = q.shape[2] * self.cp
        q_pos = local_positions(seq_len, self.cp, self.rank, self.load_balance, q.device)
        k_pos = torch.cat([local_positions(seq_len, self.cp, r, self.load_balance, q.device) for r in range(self.cp)])
        k, v = _GatherSequence.apply(k, self.group), _GatherSequence.apply(v, self.group)
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        mask = k_pos[None, :] <= q_pos[:, None]
        if document_ids is not None:
            everyone = [torch.empty_like(document_ids) for _ in range(self.cp)]
            dist.all_gather(everyone, document_ids.contiguous(), group=self.group)
            key_documents = torch.cat(everyone, dim=1)
            mask = mask & (document_ids[:, :, None] == key_documents[:, None, :])[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def apply_cp(model: nn.Module, cp_group: dist.ProcessGroup, load_balance: bool = True, rotate_method: str = "allgather",
             gathered_kernel: bool = False, name: str = "inner_attention") -> int:
    """Replaces every submodule called `name` (the convention of a swappable attention kernel)
    with context-parallel attention; returns how many. rotate_method (torchtitan's
    context_parallel_rotate_method) says how K/V reach the other ranks, as in torch's ring:
    "allgather", gathered once per layer, or "alltoall", passed rank to rank while each step
    attends. The kernel is torch's ring on the device's flash kernel (RingAttention), or with
    gathered_kernel AllGatherKVAttention (SDPA with a mask: takes document ids, and fp32 on CUDA,
    which the flash kernels do not; always "allgather"). The model must then be fed this rank's
    tokens (sharding.local_positions) and their positions."""
    if rotate_method not in ("allgather", "alltoall"):
        raise ValueError(f"rotate_method {rotate_method!r}: 'allgather' or 'alltoall'")
    if gathered_kernel and rotate_method != "allgather":
        raise ValueError("the all-gather-KV kernel gathers: rotate_method 'allgather'")
    swapped = 0
    for module in list(model.modules()):
        if isinstance(getattr(module, name, None), nn.Module):
            kernel = (AllGatherKVAttention(cp_group, load_balance) if gathered_kernel
                      else RingAttention(cp_group, rotate_method, load_balance))
            setattr(module, name, kernel)
            swapped += 1
    if not swapped:
        raise ValueError(f"{type(model).__name__} has no '{name}' submodule for context parallel to replace")
    return swapped
