"""Token shards: pre-tokenised documents on disk, opened without reading them.

A shard folder (written by `tools/pretokenize`, see `tessera.data.pretokenize`) holds
- `shard-NNNNN.tokens`: the documents' token ids end to end, each document already
  BOS + tokens + EOS, as little-endian uint16 (vocabulary <= 65536) or uint32;
- `shard-NNNNN.offsets`: little-endian int64 document starts, one per document plus the end;
- `index.json`: format, tokenizer identity, dtype, per-shard counts, totals and the inputs it
  was made from. It is written last, so a folder with an index is complete.

Opening checks sizes against the index (a truncated or mismatched file is one error line) and
maps only the offsets; token ids are read with `os.pread` when a window needs them, so a
rank's resident memory does not grow with the data it streams (the page cache holds them).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

INDEX = "index.json"
FORMAT = "tessera-token-shards"
VERSION = 1
_OFFSET_DTYPE = np.dtype("<i8")
_KINDS = {dict: "JSON object", list: "JSON list", str: "string"}  # the index's field types, as its errors name them


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32: half the disk and page cache for small vocabularies."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


@dataclass(frozen=True)
class Shard:
    tokens_path: Path
    file: BinaryIO  # unbuffered; read with os.pread, so concurrent readers need no seek
    # memory-mapped int64 [documents + 1]: file positions of the document starts, then the end;
    # offsets[0] is 0 except in a part of a shard (`documents_between`)
    offsets: np.ndarray
    num_tokens: int

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1


@dataclass(frozen=True)
class ShardDataset:
    """The shards of one folder, in index order; `len()` is the number of documents."""

    source: str
    tokenizer: dict[str, Any]  # name, fingerprint, vocab_size, bos_id, eos_id
    dtype: np.dtype
    shards: tuple[Shard, ...]
    num_tokens: int
    index: dict[str, Any]

    def __len__(self) -> int:
        return sum(s.num_documents for s in self.shards)

    def read(self, shard: int, start: int, count: int) -> np.ndarray:
        """Token ids [start, start + count) of shard `shard` as int64. An id beyond the
        vocabulary (a damaged file) is refused here, naming the shard, rather than failing deep
        in the model's embedding."""
        s = self.shards[shard]
        size = self.dtype.itemsize
        raw = os.pread(s.file.fileno(), count * size, start * size)
        if len(raw) != count * size:
            raise OSError(f"{s.tokens_path}: short read at token {start} (file changed since it was opened?)")
        ids = np.frombuffer(raw, dtype=self.dtype)
        if count and int(ids.max()) >= self.tokenizer["vocab_size"]:
            at = start + int(np.argmax(ids >= self.tokenizer["vocab_size"]))
            raise ValueError(f"{s.tokens_path}: token id {int(ids.max())} at token {at} is beyond the vocabulary of "
                             f"{self.tokenizer['vocab_size']} (damaged shard?)")
        return ids.astype(np.int64)

    def document(self, index: int) -> np.ndarray:
        """Tokens of document `index` (counting across shards in order): BOS + text + EOS."""
        for i, s in enumerate(self.shards):
            if index < s.num_documents:
                start, stop = int(s.offsets[index]), int(s.offsets[index + 1])
                return self.read(i, start, stop - start)
            index -= s.num_documents
        raise IndexError("document index out of range")


def documents_between(dataset: ShardDataset, start: int, stop: int, source: str) -> ShardDataset:
    """Documents [start, stop) of `dataset` (counting across shards in order) as a dataset of
    their own named `source`, sharing the open files and offset maps (views, nothing copied)."""
    shards, first = [], 0
    for shard in dataset.shards:
        lo, hi = max(start - first, 0), min(stop - first, shard.num_documents)
        if lo < hi:
            offsets = shard.offsets[lo : hi + 1]
            shards.append(dataclasses.replace(shard, offsets=offsets, num_tokens=int(offsets[-1] - offsets[0])))
        first += shard.num_documents
    return dataclasses.replace(dataset, source=source, shards=tuple(shards), num_tokens=sum(s.num_tokens for s in shards))


def is_shard_folder(path: str | os.PathLike) -> bool:
    return (Path(path) / INDEX).is_file()


def open_shards(folder: str | os.PathLike) -> ShardDataset:
    """Opens a shard folder: reads the index, checks file sizes, maps the offsets."""
    folder = Path(folder)
    index_path = folder / INDEX
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{index_path}: not a token-shard index ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"{index_path}: not a {FORMAT} index of version {VERSION}")
    dtype = _token_dtype(index, index_path)
    tokenizer = _field(index, "tokenizer", dict, index_path)
    vocab_size = _count(tokenizer, "vocab_size", index_path, "tokenizer.")
    max_id = _count(index, "max_id", index_path, least=-1) if "max_id" in index else -1  # -1: no tokens
    if max_id >= vocab_size:
        raise ValueError(f"{index_path}: its shards hold token id {max_id}, beyond the vocabulary of {vocab_size}")
    total = _count(index, "tokens", index_path)
    shards = tuple(_open_shard(folder, entry, dtype, index_path) for entry in _field(index, "shards", list, index_path))
    if sum(s.num_tokens for s in shards) != total or not shards:
        raise ValueError(f"{index_path}: index/shard mismatch: shard token counts do not add up to {total}")
    return ShardDataset(str(folder), tokenizer, dtype, shards, total, index)


def _field(mapping: dict, key: str, kind: type, index_path: Path, where: str = "") -> Any:
    """mapping[key] if it is a `kind`: the index is data, and a missing or mistyped field must be
    named, not surface as a KeyError or a TypeError far from the file."""
    if key not in mapping:
        raise ValueError(f"{index_path}: {where}{key} is missing")
    if not isinstance(mapping[key], kind):
        raise ValueError(f"{index_path}: {where}{key} {mapping[key]!r} is not a {_KINDS[kind]}")
    return mapping[key]


def _count(mapping: dict, key: str, index_path: Path, where: str = "", least: int = 0) -> int:
    """An integer field >= `least`: counts size the reads, so "12", 2.5, true or -3 is refused
    (int() took some, and a negative count was reported as a wrong file size)."""
    value = _field(mapping, key, object, index_path, where)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        wanted = "a non-negative integer" if least == 0 else f"an integer >= {least}"
        raise ValueError(f"{index_path}: {where}{key} {value!r} is not {wanted}")
    return value


def _token_dtype(index: dict, index_path: Path) -> np.dtype:
    """The index's dtype, if token ids can be stored in it: a float or signed type would
    reinterpret them."""
    name = _field(index, "dtype", str, index_path)
    try:
        dtype = np.dtype(name)
    except TypeError:  # not a numpy type name
        dtype = None
    if dtype is None or dtype.kind != "u" or dtype.itemsize not in (2, 4):
        raise ValueError(f"{index_path}: dtype {name!r} is not a token-id type (uint16 or uint32)")
    return dtype


def _open_shard(folder: Path, entry: Any, dtype: np.dtype, index_path: Path) -> Shard:
    if not isinstance(entry, dict):
        raise ValueError(f"{index_path}: shard entry {entry!r} is not a JSON object")
    name = _field(entry, "name", object, index_path, "shard entry ")
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        # the index is data: the files it names must be in its own folder
        raise ValueError(f"{index_path} names shard {name!r}, not a file name in {folder}")
    tokens_path = folder / f"{name}.tokens"
    offsets_path = folder / f"{name}.offsets"
    where = f"shard {name!r} "
    num_tokens = _count(entry, "tokens", index_path, where)
    num_documents = _count(entry, "documents", index_path, where)
    for path, expected in ((tokens_path, num_tokens * dtype.itemsize),
                           (offsets_path, (num_documents + 1) * _OFFSET_DTYPE.itemsize)):
        if not path.is_file():
            raise FileNotFoundError(f"token shard file {path} is missing (listed in {index_path})")
        size = path.stat().st_size
        if size != expected:
            what = "truncated" if size < expected else "oversized"
            raise ValueError(f"{path}: {what} shard file: {size} bytes, {index_path} says {expected}")
    offsets = np.memmap(offsets_path, dtype=_OFFSET_DTYPE, mode="r")
    if offsets[0] != 0 or offsets[-1] != num_tokens:
        raise ValueError(
            f"{offsets_path}: index/shard mismatch: documents span tokens {int(offsets[0])}..{int(offsets[-1])}, "
            f"the shard holds {num_tokens}"
        )
    _check_monotonic(offsets, offsets_path)
    return Shard(tokens_path, open(tokens_path, "rb", buffering=0), offsets, num_tokens)


def _check_monotonic(offsets: np.ndarray, path: Path) -> None:
    """Document starts must not decrease (with the first 0 and the last the token count, that keeps
    every one inside the shard): the stream would otherwise read wrong tokens, or fail deep inside.
    One pass over the map (a byte per document of scratch) when the shard is opened."""
    falls = offsets[1:] < offsets[:-1]
    if falls.any():
        doc = int(np.argmax(falls)) + 1
        raise ValueError(f"{path}: document {doc} starts at token {int(offsets[doc])}, before document {doc - 1} "
                         f"(token {int(offsets[doc - 1])}); offsets never decrease (damaged file?)")


def check_tokenizer(dataset: ShardDataset, tokenizer) -> None:
    """Refuses shards whose token ids come from another tokenizer, naming both."""
    made = dataset.tokenizer
    if made.get("fingerprint") != tokenizer.fingerprint:
        raise ValueError(
            f"token shards {dataset.source} were made by tokenizer {made.get('name')!r} "
            f"(fingerprint {made.get('fingerprint')}), this run uses {tokenizer.name!r} "
            f"(fingerprint {tokenizer.fingerprint}); re-run tools/pretokenize with this tokenizer"
        )
    if made["vocab_size"] != tokenizer.vocab_size:
        raise ValueError(f"token shards {dataset.source}: index says vocabulary {made['vocab_size']}, tokenizer "
                         f"{tokenizer.name!r} has {tokenizer.vocab_size}")


class ShardWriter:
    """Appends documents (token arrays incl. BOS/EOS) into shards of at most `shard_tokens`
    tokens (a document is never split); `finish` writes the index, the commit point."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int):
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file: BinaryIO | None = None
        self._ends: list[np.ndarray] = []  # document ends in the open shard, in chunks
        self._tokens = 0  # tokens in the open shard
        self._max_id = -1  # the largest id written, checked against the vocabulary when opened

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents laid end to end in `tokens`, with their `lengths`."""
        if len(tokens):
            self._max_id = max(self._max_id, int(tokens.max()))
        first = 0
        while first < len(lengths):
            ends = self._tokens + np.cumsum(lengths[first:])
            fit = int(np.searchsorted(ends, self.shard_tokens, side="right"))
            if self._file is None or (fit == 0 and self._tokens > 0):
                self._open_shard()
                continue
            fit = max(fit, 1)  # a document longer than a shard gets a shard of its own
            start = int(lengths[:first].sum())
            count = int(ends[fit - 1]) - self._tokens
            self._file.write(tokens[start : start + count].astype(self.dtype, copy=False).tobytes())
            self._ends.append(ends[:fit])
            self._tokens += count
            first += fit

    def _open_shard(self) -> None:
        self._close_shard()
        name = f"shard-{len(self.shards):05d}"
        self.shards.append({"name": name})
        self._file = open(self.folder / f"{name}.tokens", "wb")
        self._ends, self._tokens = [], 0

    def _close_shard(self) -> None:
        if self._file is None:
            return
        self._file.close()
        name = self.shards[-1]["name"]
        offsets = np.concatenate([np.zeros(1, dtype=np.int64), *self._ends]).astype(_OFFSET_DTYPE)
        offsets.tofile(self.folder / f"{name}.offsets")
        self.shards[-1].update(documents=len(offsets) - 1, tokens=self._tokens)

    def finish(self, fields: dict[str, Any]) -> dict[str, Any]:
        self._close_shard()
        index = {
            "format": FORMAT, "version": VERSION, "dtype": self.dtype.str, **fields, "max_id": self._max_id,
            "shards": self.shards,
            "documents": sum(s["documents"] for s in self.shards), "tokens": sum(s["tokens"] for s in self.shards),
        }
        tmp = self.folder / f"{INDEX}.tmp"
        tmp.write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.folder / INDEX)
        return index
