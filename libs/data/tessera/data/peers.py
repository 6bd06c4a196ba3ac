"""Peers: the processes that walk one packed stream in lockstep and split its tokenisation.

Every rank of a training job walks the same token stream (each keeps only its own windows), so
the ranks can share the encoding work: each encodes a share of the documents and they exchange
the tokens. `Peers` is all the loader needs for that: who am I, how many are we, and an
all-gather of Python objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist


@dataclass(frozen=True)
class Peers:
    """This process's place in a group that walks the same stream.

    `all_gather(obj)` is collective: every peer calls it in the same order and gets the list of
    the peers' objects in rank order (like `torch.distributed.all_gather_object`).
    """

    rank: int
    size: int
    all_gather: Callable[[object], list[object]]

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"peers size must be a positive int, got {self.size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"peers rank must be in [0, {self.size}), got {self.rank!r}")
        if not callable(self.all_gather):
            raise ValueError(f"peers all_gather must be callable, got {self.all_gather!r}")


def _gather_alone(obj: object) -> list[object]:
    return [obj]


ALONE = Peers(rank=0, size=1, all_gather=_gather_alone)


def distributed_peers(group: dist.ProcessGroup | None = None) -> Peers:
    """The ranks of `group` (default: the default group) as peers, exchanging through it.

    With NCCL, `all_gather_object` moves the pickled tokens through the GPU; a gloo group
    (`dist.new_group(backend="gloo")`, created on every rank) keeps them on the CPU.
    """
    if not dist.is_initialized():
        raise ValueError("distributed_peers needs an initialised torch.distributed process group")
    size = dist.get_world_size(group)

    def all_gather(obj: object) -> list[object]:
        gathered: list[object] = [None] * size
        dist.all_gather_object(gathered, obj, group=group)
        return gathered

    return Peers(rank=dist.get_rank(group), size=size, all_gather=all_gather)
