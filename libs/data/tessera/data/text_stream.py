"""The token stream of a text dataset: documents encoded lazily, one block at a time.

Each document is encoded as BOS + text + EOS and the documents are laid end to end, in file
order or, with a shuffle seed, in a fresh seeded permutation per epoch (the dataset is in memory
anyway, so the whole order is shuffled; a dataset read in chunks, Parquet, orders its own epochs);
the stream runs on across epochs. `take` moves one
window of seq_len + 1 tokens along it.

Every rank walks the whole stream, and documents are long (many windows each, needed by many
ranks), so the ranks share the encoding instead of each encoding everything: the stream is read
in blocks of positions ([k * B, (k + 1) * B) of the epoch's order), peer p encodes the block's
positions j with j % peers.size == p, and one all-gather gives every peer the block's tokens.
Blocks depend only on the stream position, so peers in lockstep exchange at the same points,
also after `load_state_dict`. Alone (no peers) a block is simply encoded by this process.
"""

from __future__ import annotations

from array import array
from typing import Any, Sequence

import numpy as np

from tessera.data.peers import Peers
from tessera.data.tokenizer import Tokenizer

STATE_KEYS = ("epoch", "doc_index", "token_offset", "num_documents")


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The seeded document order of `epoch`: the same on every rank and after a restart."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def check_state(state: dict[str, Any], keys: Sequence[str]) -> None:
    bad = [k for k in keys if not isinstance(state.get(k), int) or state[k] < 0]
    if bad:
        raise ValueError(f"loader state needs non-negative ints for {bad}")


class TextStream:
    def __init__(self, dataset: Sequence[str], tokenizer: Tokenizer, window: int, infinite: bool,
                 peers: Peers, block_documents: int, shuffle_seed: int | None):
        self._dataset = dataset
        self._tokenizer = tokenizer
        self._window = window
        self._infinite = infinite
        self._peers = peers
        self._block_documents = block_documents
        self._shuffle_seed = shuffle_seed
        self._epoch = 0
        self._doc_index = 0  # position (in the epoch's order) of the document holding the next token
        self._token_offset = 0  # position of the next stream token inside that document
        self._block: dict[int, array] = {}  # position -> tokens, for the current block
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its document order)

    def take(self, collect: bool) -> np.ndarray | None:
        """The next window (returned only if `collect`); StopIteration at the end of finite data."""
        taken: list[int] = []
        n = self._window
        epoch_in_window = self._doc_index == 0 and self._token_offset == 0  # an epoch began in this window
        while n > 0:
            if self._doc_index == len(self._dataset):
                if not self._infinite:
                    raise StopIteration
                if epoch_in_window and n < self._window:  # a whole epoch fit in one window: it would repeat in each
                    name = getattr(self._dataset, "source", "dataset")
                    raise ValueError(f"dataset {name} holds fewer tokens than one sequence (seq_len + 1 = {self._window})")
                epoch_in_window = True
                self._epoch += 1
                self._doc_index = 0
                self._block.clear()  # positions now name the new epoch's documents
            tokens = self._doc(self._doc_index)
            step = min(n, len(tokens) - self._token_offset)
            if collect:
                taken.extend(tokens[self._token_offset : self._token_offset + step])
            self._token_offset += step
            n -= step
            if self._token_offset == len(tokens):
                self._doc_index += 1
                self._token_offset = 0
        return np.asarray(taken, dtype=np.int64) if collect else None

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "doc_index": self._doc_index, "token_offset": self._token_offset,
                "num_documents": len(self._dataset)}

    def reseed(self, seed: int) -> None:
        """Order the epochs by `seed` (a restored run's), if shuffling."""
        if self._shuffle_seed is not None:
            self._shuffle_seed, self._order = seed, None
            self._block.clear()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Collective with peers: all of them must load the same state (it is rank-independent)."""
        check_state(state, STATE_KEYS)
        if state["num_documents"] != len(self._dataset):
            raise ValueError(
                f"loader state is for a dataset of {state['num_documents']} documents, "
                f"{getattr(self._dataset, 'source', 'this one')} has {len(self._dataset)}"
            )
        if state["doc_index"] > len(self._dataset):
            raise ValueError(f"loader state doc_index {state['doc_index']} is past the dataset end")
        self._epoch = state["epoch"]
        self._doc_index = state["doc_index"]
        self._token_offset = state["token_offset"]
        self._block.clear()  # so every peer fetches the same blocks from here, cached or not
        in_data = self._doc_index < len(self._dataset)
        if in_data and self._token_offset >= len(self._doc(self._doc_index)):
            raise ValueError(
                f"loader state token_offset {self._token_offset} is past the end of document "
                f"{self._doc_index}; the dataset or tokenizer changed"
            )

    def _document(self, position: int) -> str:
        if self._shuffle_seed is None:
            return self._dataset[position]
        if self._order is None or self._order[0] != self._epoch:
            # a dataset read in chunks (Parquet's row groups) orders its epochs itself
            own = getattr(self._dataset, "epoch_order", None)
            order = own(self._shuffle_seed, self._epoch) if own else epoch_order(self._shuffle_seed, self._epoch, len(self._dataset))
            self._order = (self._epoch, order)
        return self._dataset[int(self._order[1][position])]

    def _doc(self, position: int) -> array:
        if position not in self._block:
            self._load_block(position // self._block_documents)
        return self._block[position]

    def _load_block(self, block: int) -> None:
        """Encode this peer's share of block `block` and gather the other peers' shares.

        One block is held at a time, as int32 arrays (4 bytes a token; a list of ints takes ~36).
        """
        self._block.clear()
        start = block * self._block_documents
        stop = min(start + self._block_documents, len(self._dataset))
        mine = {
            j: array("i", self._tokenizer.encode(self._document(j), bos=True, eos=True))
            for j in range(start, stop)
            if j % self._peers.size == self._peers.rank
        }
        for share in self._peers.all_gather(mine):
            self._block.update(share)
