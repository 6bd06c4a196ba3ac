"""Packed next-token batches: documents -> one token stream -> windows -> data-parallel shards.

Each document is encoded as BOS + text + EOS, and the documents are laid end to end (the stream
runs on across epochs). The stream is cut into consecutive windows of seq_len + 1 tokens; a
window gives inputs w[:-1] and labels w[1:]. Window i belongs to data-parallel rank
i % dp_world_size, and every batch step consumes local_batch_size * dp_world_size windows, so
rank r's k-th batch holds windows (k * b + j) * W + r for j < b: the union of the ranks' k-th
batches is the k-th batch of a single process with batch size b * W.

The position in the stream (epoch, document, token offset) is the whole state, so a loader
restored from `state_dict()` taken after k batches yields batch k + 1 onward.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from tessera.data.tokenizer import Tokenizer

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
    ):
        self._dataset = dataset
        self._tokenizer = tokenizer
        self._seq_len = seq_len
        self._local_batch_size = local_batch_size
        self._dp_rank = dp_rank
        self._dp_world_size = dp_world_size
        self._infinite = infinite
        self._epoch = 0
        self._doc_index = 0  # document holding the next stream token
        self._token_offset = 0  # position of the next stream token inside that document
        self._window_index = 0  # global windows consumed so far (all ranks)
        self._doc_tokens: list[int] | None = None  # tokens of document _doc_index, encoded lazily

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
        """Resume at the stream position of `state` (from `state_dict()`)."""
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
        self._doc_tokens = None
        if self._doc_index < len(self._dataset) and self._token_offset >= len(self._current_doc()):
            raise ValueError(
                f"loader state token_offset {self._token_offset} is past the end of document "
                f"{self._doc_index}; the dataset or tokenizer changed"
            )

    def _current_doc(self) -> list[int]:
        if self._doc_tokens is None:
            text = self._dataset[self._doc_index]
            self._doc_tokens = self._tokenizer.encode(text, bos=True, eos=True)
        return self._doc_tokens

    def _advance(self, n: int, collect: bool) -> list[int] | None:
        """Move n tokens along the stream, returning them if `collect`; None at the end of data."""
        taken: list[int] = []
        while n > 0:
            if self._doc_index == len(self._dataset):
                if not self._infinite:
                    return None
                self._epoch += 1
                self._doc_index = 0
            tokens = self._current_doc()
            step = min(n, len(tokens) - self._token_offset)
            if collect:
                taken.extend(tokens[self._token_offset : self._token_offset + step])
            self._token_offset += step
            n -= step
            if self._token_offset == len(tokens):
                self._doc_index += 1
                self._token_offset = 0
                self._doc_tokens = None
        return taken


def build_dataloader(
    dataset: Sequence[str],
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    infinite: bool = True,
) -> PackedLoader:
    """Packed, data-parallel-sharded, resumable batches of `dataset` (see module docstring).

    With infinite=False iteration stops at the first batch step the data cannot fill (on every
    rank at the same step); a trailing partial window is dropped.
    """
    for name, value in (("seq_len", seq_len), ("local_batch_size", local_batch_size),
                        ("dp_world_size", dp_world_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank must be in [0, {dp_world_size}), got {dp_rank!r}")
    if len(dataset) == 0:
        raise ValueError("dataset has no documents")
    return PackedLoader(
        dataset, tokenizer, seq_len, local_batch_size, dp_rank, dp_world_size, infinite
    )
