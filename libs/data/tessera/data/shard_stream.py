"""The token stream of a shard dataset, with random access: window n is the stream's tokens
[n * W, (n + 1) * W) (W = seq_len + 1), read without touching any other window.

An epoch holds every document once, so it is `num_tokens` long whatever the order, and stream
position p lies in epoch p // num_tokens. Document order per epoch, with a shuffle seed:
- the shards in a seeded permutation;
- inside a shard, documents in consecutive groups of `shuffle_buffer` (file order), each group
  in a seeded permutation: what a shuffle buffer of that size gives, but a pure function of the
  position, so resuming needs no buffer contents and memory stays O(buffer).
Without a seed the order is the files' order, exactly the text path's stream.
Locating a position costs two binary searches (shard totals, the shard's memory-mapped
offsets) plus, when shuffling, one group permutation (cached).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tessera.data.shards import ShardDataset
from tessera.data.text_stream import check_state

STATE_KEYS = ("windows", "num_tokens")


class ShardStream:
    def __init__(self, dataset: ShardDataset, window: int, infinite: bool, shuffle_seed: int | None,
                 shuffle_buffer: int):
        if infinite and dataset.num_tokens < window:  # it would repeat within every sequence
            raise ValueError(f"dataset {dataset.source} holds {dataset.num_tokens} tokens, fewer than one sequence "
                             f"(seq_len + 1 = {window})")
        self._data = dataset
        self._window = window
        self._infinite = infinite
        self._seed = shuffle_seed
        self._buffer = shuffle_buffer
        self._windows = 0  # windows taken so far: the whole position
        self._totals = np.array([s.num_tokens for s in dataset.shards], dtype=np.int64)
        self._shard_order: tuple[int, np.ndarray, np.ndarray] | None = None  # epoch, order, ends
        self._groups: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}

    def take(self, collect: bool) -> np.ndarray | None:
        """The next window (returned only if `collect`); StopIteration at the end of finite data."""
        start = self._windows * self._window
        if not self._infinite and start + self._window > self._data.num_tokens:
            raise StopIteration
        self._windows += 1
        return self._read(start, self._window) if collect else None

    def state_dict(self) -> dict[str, int]:
        return {"windows": self._windows, "num_tokens": self._data.num_tokens}

    def reseed(self, seed: int) -> None:
        """Order the epochs by `seed` (a restored run's), if shuffling."""
        if self._seed is not None:
            self._seed, self._shard_order = seed, None
            self._groups.clear()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, STATE_KEYS)
        if state["num_tokens"] != self._data.num_tokens:
            raise ValueError(
                f"loader state is for shards of {state['num_tokens']} tokens, "
                f"{self._data.source} holds {self._data.num_tokens}"
            )
        self._windows = state["windows"]

    def _read(self, position: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            epoch, offset = divmod(position + filled, self._data.num_tokens)
            shard, start, stop = self._locate(epoch, offset)
            n = min(count - filled, stop - start)
            out[filled : filled + n] = self._data.read(shard, start, n)
            filled += n
        return out

    def _locate(self, epoch: int, offset: int) -> tuple[int, int, int]:
        """(shard, file position of the token at epoch offset `offset`, end of its document)."""
        order, ends = self._shards_in(epoch)
        i = int(np.searchsorted(ends, offset, side="right"))
        shard = int(order[i])
        offsets = self._data.shards[shard].offsets
        offset += int(offsets[0]) - (int(ends[i - 1]) if i else 0)  # the file position
        doc = int(np.searchsorted(offsets, offset, side="right")) - 1
        if self._seed is None:
            return shard, offset, int(offsets[doc + 1])
        group = doc // self._buffer
        perm, group_ends = self._group(epoch, shard, group)
        inside = offset - int(offsets[group * self._buffer])
        j = int(np.searchsorted(group_ends, inside, side="right"))
        doc = group * self._buffer + int(perm[j])
        into_doc = inside - (int(group_ends[j - 1]) if j else 0)
        return shard, int(offsets[doc]) + into_doc, int(offsets[doc + 1])

    def _shards_in(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if self._shard_order is None or self._shard_order[0] != epoch:
            n = len(self._totals)
            order = np.arange(n) if self._seed is None else np.random.default_rng([self._seed, epoch]).permutation(n)
            self._shard_order = (epoch, order, np.cumsum(self._totals[order]))
        return self._shard_order[1], self._shard_order[2]

    def _group(self, epoch: int, shard: int, group: int) -> tuple[np.ndarray, np.ndarray]:
        """The permutation of a group of documents and the group's document ends in that order."""
        key = (epoch, shard, group)
        if key not in self._groups:
            if len(self._groups) >= 4:  # a window spans few groups; keep memory O(buffer)
                self._groups.clear()
            offsets = self._data.shards[shard].offsets
            first = group * self._buffer
            bounds = np.asarray(offsets[first : min(first + self._buffer, len(offsets) - 1) + 1], dtype=np.int64)
            perm = np.random.default_rng([self._seed, epoch, shard, group]).permutation(len(bounds) - 1)
            self._groups[key] = (perm, np.cumsum(np.diff(bounds)[perm]))
        return self._groups[key]
