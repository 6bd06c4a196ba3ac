"""Which tokens of a sequence each context-parallel rank holds.

Causal attention does more work for later queries, so contiguous shards would leave the last
rank with most of it. With load balancing ("headtail") the sequence is cut into 2·cp chunks and
rank i holds chunks i and 2·cp-1-i: every rank then holds one early and one late chunk, and the
attention work is even.
"""

from __future__ import annotations

import torch


def check_seq_len(seq_len: int, cp: int, load_balance: bool) -> None:
    """ValueError naming the numbers when seq_len does not cut into the shards."""
    chunks = 2 * cp if load_balance else cp
    if seq_len % chunks:
        why = "2 * context_parallel_degree chunks (load balancing)" if load_balance else "context_parallel_degree shards"
        raise ValueError(f"seq_len {seq_len} does not divide into {chunks} = {why}")


def local_positions(seq_len: int, cp: int, cp_rank: int, load_balance: bool = True, device=None) -> torch.Tensor:
    """Positions (ascending) of the seq_len // cp tokens rank `cp_rank` holds."""
    runs = local_runs(seq_len, cp, cp_rank, load_balance)
    return torch.cat([torch.arange(start, start + count, device=device) for start, count in runs])


def local_runs(seq_len: int, cp: int, cp_rank: int, load_balance: bool = True) -> tuple[tuple[int, int], ...]:
    """The positions rank `cp_rank` holds as runs of consecutive positions: ((start, count), ...)."""
    check_seq_len(seq_len, cp, load_balance)
    if not load_balance:
        size = seq_len // cp
        return ((cp_rank * size, size),)
    size = seq_len // (2 * cp)
    return ((cp_rank * size, size), ((2 * cp - 1 - cp_rank) * size, size))


def shard_sequence(tensor: torch.Tensor, positions: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The entries of `tensor` at `positions` along the sequence dim (inputs, labels, masks)."""
    return tensor.index_select(dim, positions.to(tensor.device))
