"""Which tensor-parallel degrees a model admits."""

from __future__ import annotations

from collections.abc import Mapping


def check_tp_degree(tp_degree: int, quantities: Mapping[str, int]) -> None:
    """Raises ValueError naming the first quantity (heads, KV heads, vocab, FFN width, ...) that
    ``tp_degree`` does not divide: a colwise shard must hold whole heads and equal slices."""
    if tp_degree < 1:
        raise ValueError(f"tensor_parallel_degree must be >= 1, got {tp_degree}")
    for name, value in quantities.items():
        if value % tp_degree:
            raise ValueError(f"tensor_parallel_degree {tp_degree} does not divide {name}={value}")
