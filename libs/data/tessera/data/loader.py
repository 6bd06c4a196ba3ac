"""Packed next-token batches: token streams -> windows -> data-parallel shards.

A dataset is a token stream (documents laid end to end as BOS + text + EOS, running on across
epochs; see `text_stream` and `shard_stream`), cut into consecutive windows of seq_len + 1
tokens; a window gives inputs w[:-1] and labels w[1:]. Global window i belongs to
data-parallel rank i % dp_world_size, and every batch step consumes
local_batch_size * dp_world_size windows, so rank r's k-th batch holds windows
(k * b + j) * W + r for j < b: the union of the ranks' k-th batches is the k-th batch of a
single process with batch size b * W. With a mixture, global window i comes from the dataset
`Mixture.dataset_of(i)` picks, as that dataset's next window.

The state is a global position (the windows consumed by all ranks together and where each
stream stands), the same on every rank: a loader restored from `state_dict()` taken after k
batches yields batch k + 1 onward, under any data-parallel degree with the same global batch.
When shuffling or mixing, the state also holds the seed, and a restored loader adopts it: the
data order is the saved run's, whatever seed the resuming run was given.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import numpy as np
import torch

from tessera.data.mixture import Mixture
from tessera.data.peers import ALONE, Peers
from tessera.data.shard_stream import ShardStream
from tessera.data.shards import ShardDataset, check_tokenizer
from tessera.data.text_stream import TextStream, check_state
from tessera.data.tokenizer import Tokenizer

# Default block: every peer encodes this many documents per exchange, so no peer idles and
# the number of exchanges per epoch falls as peers are added.
DOCUMENTS_PER_PEER = 4
# Shard shuffling permutes documents within groups of this many (see shard_stream).
SHUFFLE_BUFFER = 8192

Dataset = Union[Sequence[str], ShardDataset]


class PackedLoader:
    """Iterator of (inputs, labels) LongTensors [local_batch_size, seq_len]; see the module."""

    def __init__(self, streams: list, names: list[str], mixture: Mixture | None, seed: int | None,
                 local_batch_size: int, dp_rank: int, dp_world_size: int):
        self._streams = streams
        self._seed = seed  # None: neither shuffled nor mixed, the order needs no seed
        self._names = names
        self._mixture = mixture
        self._local_batch_size = local_batch_size
        self._dp_rank = dp_rank
        self._dp_world_size = dp_world_size
        self._window_index = 0  # global windows consumed so far (all ranks)

    def __iter__(self) -> "PackedLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for _ in range(self._local_batch_size * self._dp_world_size):
            mine = self._window_index % self._dp_world_size == self._dp_rank
            stream = 0 if self._mixture is None else self._mixture.dataset_of(self._window_index)
            window = self._streams[stream].take(collect=mine)  # StopIteration: finite data ran out
            if mine:
                rows.append(window)
            self._window_index += 1
        batch = torch.from_numpy(np.stack(rows))
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        """Global position (plain ints); the same on every rank after the same number of batches."""
        seed = {} if self._seed is None else {"seed": self._seed}
        if self._mixture is None:
            return {**self._streams[0].state_dict(), "window_index": self._window_index, **seed}
        return {"window_index": self._window_index, "datasets": [s.state_dict() for s in self._streams], **seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the position of `state` (from `state_dict()`, any data-parallel layout).

        Collective with peers: all of them must load the same state (it is rank-independent).
        """
        if self._seed is not None and "seed" in state:
            check_state(state, ["seed"])
            self._seed = state["seed"]
            for part in [*self._streams, *([self._mixture] if self._mixture else [])]:
                part.reseed(self._seed)
        if self._mixture is None:
            self._streams[0].load_state_dict(state)
        else:
            datasets = state.get("datasets")
            if not isinstance(datasets, list) or len(datasets) != len(self._streams):
                raise ValueError(f"loader state is not for a mixture of {len(self._streams)} datasets")
            for stream, stream_state in zip(self._streams, datasets):
                stream.load_state_dict(stream_state)
        check_state(state, ["window_index"])
        self._window_index = state["window_index"]

    def realised_proportions(self, window_index: int | None = None) -> dict[str, float]:
        """Share of each dataset among the first `window_index` windows (default: those consumed)."""
        window_index = self._window_index if window_index is None else window_index
        if self._mixture is None or window_index == 0:
            return {}
        counts = self._mixture.counts_before(window_index)
        return {name: int(c) / window_index for name, c in zip(self._names, counts)}


def build_dataloader(
    dataset: Dataset | Sequence[Dataset],
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    infinite: bool = True,
    peers: Peers | None = None,
    block_documents: int | None = None,
    *,
    weights: Sequence[float] | None = None,
    seed: int = 0,
    shuffle: bool = False,
    shuffle_buffer: int = SHUFFLE_BUFFER,
) -> PackedLoader:
    """Packed, data-parallel-sharded, resumable batches of `dataset` (see module docstring).

    `dataset`: documents (a `TextDataset` or any sequence of strings) or a `ShardDataset`;
    with `weights`, a list of those mixed in these proportions (seeded by `seed`).
    `shuffle`: documents in a seeded order per epoch (`seed`; shards: shard permutation plus
    groups of `shuffle_buffer` documents) instead of file order.

    With infinite=False iteration stops at the first batch step the data cannot fill (on every
    rank at the same step); a trailing partial window is dropped.

    `peers` (e.g. `distributed_peers()`): the processes that walk this stream in lockstep, with
    the same dataset, tokenizer, seq_len, local_batch_size * dp_world_size and state (every rank
    of a job, tensor-parallel peers included); they split the encoding of text datasets and
    iterating is collective. `block_documents` (default DOCUMENTS_PER_PEER * peers.size):
    documents per exchange; the windows do not depend on it, memory and exchange count do.
    Shard datasets need no encoding: each rank reads only its own windows.
    """
    peers = ALONE if peers is None else peers
    if block_documents is None:
        block_documents = DOCUMENTS_PER_PEER * peers.size
    for name, value in (("seq_len", seq_len), ("local_batch_size", local_batch_size),
                        ("dp_world_size", dp_world_size), ("block_documents", block_documents),
                        ("shuffle_buffer", shuffle_buffer)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank must be in [0, {dp_world_size}), got {dp_rank!r}")
    datasets = [dataset] if weights is None else list(dataset)
    if weights is not None and len(weights) != len(datasets):
        raise ValueError(f"a mixture needs one weight per dataset: {len(datasets)} datasets, {len(weights)} weights")
    mixture = None if weights is None else Mixture(list(weights), seed)
    shuffle_seed = seed if shuffle else None
    streams = []
    for i, data in enumerate(datasets):
        if len(data) == 0:
            raise ValueError(f"dataset {getattr(data, 'source', i)} has no documents")
        if isinstance(data, ShardDataset):
            check_tokenizer(data, tokenizer)
            streams.append(ShardStream(data, seq_len + 1, infinite, shuffle_seed, shuffle_buffer))
        else:
            streams.append(TextStream(data, tokenizer, seq_len + 1, infinite, peers, block_documents, shuffle_seed))
    names = [getattr(data, "source", f"dataset {i}") for i, data in enumerate(datasets)]
    seeded = seed if shuffle or weights is not None else None
    return PackedLoader(streams, names, mixture, seeded, local_batch_size, dp_rank, dp_world_size)
