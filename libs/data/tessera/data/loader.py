"""Packed next-token batches: documents -> one token stream -> windows -> data-parallel shards.

Each document is encoded as BOS + text + EOS, and the documents are laid end to end (the stream
runs on across epochs). The stream is cut into consecutive windows of seq_len + 1 tokens; a
window gives inputs w[:-1] and labels w[1:]. Window i belongs to data-parallel rank
i % dp_world_size, and every batch step consumes local_batch_size * dp_world_size windows, so
rank r's k-th batch holds windows (k * b + j) * W + r for j < b: the union of the ranks' k-th
batches is the k-th batch of a single process with batch size b * W.

The position in the stream (epoch, document, token offset) is the whole state, so a loader
restored from `state_dict()` taken after k batches yields batch k + 1 onward.

Every rank walks the whole stream, and documents are long (many windows each, needed by many
ranks), so the ranks share the encoding instead of each encoding everything: the stream is read
in blocks of documents at absolute indices ([k * B, (k + 1) * B)), peer p encodes the block's
documents j with j % peers.size == p, and one all-gather gives every peer the block's tokens.
Blocks depend only on the stream position, so peers in lockstep exchange at the same points,
also after `load_state_dict`. Alone (no peers) a block is simply encoded by this process.
"""

from __future__ import annotations

from array import array
from typing import Any, Sequence

import torch

from tessera.data.peers import ALONE, Peers
from tessera.data.tokenizer import Tokenizer

# Default block: every peer encodes this many documents per exchange, so no peer idles and
# the number of exchanges per epoch falls as peers are added.
DOCUMENTS_PER_PEER = 4

_STATE_KEYS = ("epoch", "doc_index", "token_offset", "window_index", "num_documents")


class PackedLoader:
    """Iterator of (inputs, labels) LongTensors [local_batch_size, seq_len]; see the module."""

    def __init__(
        self,
        dataset: Sequence[str],
        tokenizer: Tokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        infinite: bool,
        peers: Peers,
        block_documents: int,
    ):
        self._dataset = dataset
        self._tokenizer = tokenizer
        self._seq_len = seq_len
        self._local_batch_size = local_batch_size
        self._dp_rank = dp_rank
        self._dp_world_size = dp_world_size
        self._infinite = infinite
        self._peers = peers
        self._block_documents = block_documents
        self._epoch = 0
        self._doc_index = 0  # document holding the next stream token
        self._token_offset = 0  # position of the next stream token inside that document
        self._window_index = 0  # global windows consumed so far (all ranks)
        self._block: dict[int, array] = {}  # document index -> tokens, for the current block

    def __iter__(self) -> "PackedLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for _ in range(self._local_batch_size * self._dp_world_size):
            mine = self._window_index % self._dp_world_size == self._dp_rank
            window = self._advance(self._seq_len + 1, collect=mine)
            if window is None:
                raise StopIteration
            if mine:
                rows.append(window)
            self._window_index += 1
        batch = torch.tensor(rows, dtype=torch.long)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        """Stream position (plain ints); the same on every rank after the same number of batches."""
        return {
            "epoch": self._epoch,
            "doc_index": self._doc_index,
            "token_offset": self._token_offset,
            "window_index": self._window_index,
            "num_documents": len(self._dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the stream position of `state` (from `state_dict()`).

        Collective with peers: all of them must load the same state (it is rank-independent).
        """
        missing = [k for k in _STATE_KEYS if not isinstance(state.get(k), int) or state[k] < 0]
        if missing:
            raise ValueError(f"loader state needs non-negative ints for {missing}")
        if state["num_documents"] != len(self._dataset):
            raise ValueError(
                f"loader state is for a dataset of {state['num_documents']} documents, "
                f"this one has {len(self._dataset)}"
            )
        if state["doc_index"] > len(self._dataset):
            raise ValueError(f"loader state doc_index {state['doc_index']} is past the dataset end")
        self._epoch = state["epoch"]
        self._doc_index = state["doc_index"]
        self._token_offset = state["token_offset"]
        self._window_index = state["window_index"]
        self._block.clear()  # so every peer fetches the same blocks from here, cached or not
        in_data = self._doc_index < len(self._dataset)
        if in_data and self._token_offset >= len(self._doc(self._doc_index)):
            raise ValueError(
                f"loader state token_offset {self._token_offset} is past the end of document "
                f"{self._doc_index}; the dataset or tokenizer changed"
            )

    def _doc(self, index: int) -> array:
        if index not in self._block:
            self._load_block(index // self._block_documents)
        return self._block[index]

    def _load_block(self, block: int) -> None:
        """Encode this peer's share of block `block` and gather the other peers' shares.

        One block is held at a time, as int32 arrays (4 bytes a token; a list of ints takes ~36).
        """
        self._block.clear()
        start = block * self._block_documents
        stop = min(start + self._block_documents, len(self._dataset))
        mine = {
            j: array("i", self._tokenizer.encode(self._dataset[j], bos=True, eos=True))
            for j in range(start, stop)
            if j % self._peers.size == self._peers.rank
        }
        for share in self._peers.all_gather(mine):
            self._block.update(share)

    def _advance(self, n: int, collect: bool) -> list[int] | None:
        """Move n tokens along the stream, returning them if `collect`; None at the end of data."""
        taken: list[int] = []
        while n > 0:
            if self._doc_index == len(self._dataset):
                if not self._infinite:
                    return None
                self._epoch += 1
                self._doc_index = 0
            tokens = self._doc(self._doc_index)
            step = min(n, len(tokens) - self._token_offset)
            if collect:
                taken.extend(tokens[self._token_offset : self._token_offset + step])
            self._token_offset += step
            n -= step
            if self._token_offset == len(tokens):
                self._doc_index += 1
                self._token_offset = 0
        return taken


def build_dataloader(
    dataset: Sequence[str],
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    infinite: bool = True,
    peers: Peers | None = None,
    block_documents: int | None = None,
) -> PackedLoader:
    """Packed, data-parallel-sharded, resumable batches of `dataset` (see module docstring).

    With infinite=False iteration stops at the first batch step the data cannot fill (on every
    rank at the same step); a trailing partial window is dropped.

    `peers` (e.g. `distributed_peers()`): the processes that walk this stream in lockstep, with
    the same dataset, tokenizer, seq_len, local_batch_size * dp_world_size and state (every rank
    of a job, tensor-parallel peers included); they split the encoding and iterating is
    collective. `block_documents` (default DOCUMENTS_PER_PEER * peers.size): documents per
    exchange; the windows do not depend on it, memory and exchange count do.
    """
    peers = ALONE if peers is None else peers
    if block_documents is None:
        block_documents = DOCUMENTS_PER_PEER * peers.size
    for name, value in (("seq_len", seq_len), ("local_batch_size", local_batch_size),
                        ("dp_world_size", dp_world_size), ("block_documents", block_documents)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank must be in [0, {dp_world_size}), got {dp_rank!r}")
    if len(dataset) == 0:
        raise ValueError("dataset has no documents")
    return PackedLoader(
        dataset, tokenizer, seq_len, local_batch_size, dp_rank, dp_world_size, infinite,
        peers, block_documents,
    )
