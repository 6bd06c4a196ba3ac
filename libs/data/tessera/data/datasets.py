"""Text datasets: an ordered list of documents from the embedded corpus, a file or a folder.

Sources accepted by `load_dataset`:
- None or "default": the embedded Python standard-library corpus (no download).
- a `.txt` or `.md` file: one document per block of lines; blank lines separate blocks.
- a folder of JSON-lines files (a local copy of a Hugging Face text dataset such as c4): every
  JSON-lines file below it (recursive, sorted by relative path), its other files (README.md)
  ignored; a folder without any: every `.txt` / `.md` file below it is one document.
- a `.jsonl`, `.jsonl.gz`, `.json` or `.json.gz` file: one JSON object per line, the document in
  `text_field` (`.json` as Hugging Face's `datasets` reads it, e.g. torchtitan's
  `tests/assets/c4_test/data.json`; `.json.gz` as c4's shards).
- a `.parquet` file, or a folder holding `.parquet` files (every one below it, sorted by
  relative path, its other files ignored): one document per row, its text in the `text_field`
  column, read a row group at a time (`tessera.data.columnar`; needs pyarrow).
- a folder written by Hugging Face `datasets`' `save_to_disk` (a Dataset, or a DatasetDict's
  "train" split), or one `.arrow` stream file: the same, its Arrow files memory-mapped and read
  a record batch at a time, in the order its state.json lists them.
- a folder of token shards written by `tools/pretokenize` (see `tessera.data.shards`).
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO, Iterator

from tessera.data.columnar import ARROW_SUFFIX, PARQUET_SUFFIX, ColumnarDataset, iter_columnar, saved_dataset_files
from tessera.data.shards import ShardDataset, is_shard_folder, open_shards

_TEXT_SUFFIXES = (".txt", ".md")
_JSON_LINES_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
_DEFAULT_NAMES = (None, "default")
_DEFAULT_ASSET = "stdlib_corpus.jsonl.gz"


@dataclass(frozen=True)
class TextDataset:
    """Documents (strings) in a fixed order; `source` says where they came from."""

    source: str
    documents: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, index: int) -> str:
        return self.documents[index]


def load_dataset(
    source: str | os.PathLike | None = None, text_field: str = "text"
) -> TextDataset | ShardDataset | ColumnarDataset:
    """Documents from `source` (see the module docstring); `text_field` names the JSON field or
    Parquet or Arrow column.

    A folder written by `tools/pretokenize` (it holds `index.json`) opens as a memory-mapped
    `ShardDataset` instead, and Parquet or Arrow as a `ColumnarDataset`: nothing is read or
    tokenised up front.
    """
    if source not in _DEFAULT_NAMES and is_shard_folder(source):
        return open_shards(source)
    name = "default" if source in _DEFAULT_NAMES else str(Path(source))
    files = source_files(source)
    if files and _is_columnar(files[0]):
        dataset = ColumnarDataset(name, files, text_field)
        if not len(dataset):
            raise ValueError(f"dataset {name} has no documents")
        return dataset
    return _non_empty(TextDataset(name, tuple(_documents(source, files, text_field))))


def source_files(source: str | os.PathLike | None) -> list[Path]:
    """The files `source` reads, in document order (the embedded corpus: its asset)."""
    if source in _DEFAULT_NAMES:
        return [Path(str(resources.files("tessera.data").joinpath("assets", _DEFAULT_ASSET)))]
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"dataset path not found: {path}")
    if path.is_dir():
        saved = saved_dataset_files(path)
        if saved is not None:
            return saved
        files = sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix())
        parquet = [p for p in files if _is_parquet(p)]
        json_lines = [p for p in files if _is_json_lines(p)]
        return parquet or json_lines or [p for p in files if p.suffix in _TEXT_SUFFIXES]
    if not _is_json_lines(path) and not _is_columnar(path) and path.suffix not in _TEXT_SUFFIXES:
        raise ValueError(f"unsupported dataset file {path}: expected .txt, .md, .jsonl, .jsonl.gz, .json, .json.gz, "
                         ".parquet, .arrow or a folder")
    return [path]


def iter_documents(source: str | os.PathLike | None, text_field: str = "text") -> Iterator[str]:
    """The documents of `source` one at a time (blank ones skipped), without holding them all."""
    yield from _documents(source, source_files(source), text_field)


def _documents(source: str | os.PathLike | None, files: list[Path], text_field: str) -> Iterator[str]:
    """The documents of `files`, `source_files(source)` (listed once by the caller)."""
    folder = source not in _DEFAULT_NAMES and Path(source).is_dir()
    for path in files:
        if _is_columnar(path):
            yield from iter_columnar(path, text_field)
        elif _is_json_lines(path):
            field = "text" if source in _DEFAULT_NAMES else text_field
            with open(path, "rb") as f:
                yield from _read_jsonl(f, str(path), path.name.endswith(".gz"), field)
        elif folder:
            text = _read_text(path)
            if text.strip():
                yield text
        else:
            yield from _split_blocks(_read_text(path))


def _is_parquet(path: Path) -> bool:
    return path.suffix == PARQUET_SUFFIX


def _is_columnar(path: Path) -> bool:
    return path.suffix in (PARQUET_SUFFIX, ARROW_SUFFIX)


def _is_json_lines(path: Path) -> bool:
    return path.name.endswith(_JSON_LINES_SUFFIXES)


def _non_empty(dataset: TextDataset) -> TextDataset:
    if not dataset.documents:
        raise ValueError(f"dataset {dataset.source} has no documents")
    return dataset


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 (byte offset {e.start})") from None


def _split_blocks(text: str) -> tuple[str, ...]:
    """Blocks of consecutive non-blank lines, each joined back with newlines."""
    blocks, current = [], []
    for line in text.split("\n"):
        if line.strip():
            current.append(line)
        elif current:
            blocks.append("\n".join(current))
            current = []
    if current:
        blocks.append("\n".join(current))
    return tuple(blocks)


def _read_jsonl(f: IO[bytes], origin: str, gzipped: bool, text_field: str) -> Iterator[str]:
    """The `text_field` of every non-blank JSON line; errors name `origin` and the line number."""
    lineno = 0
    try:
        stream = gzip.GzipFile(fileobj=f, mode="rb") if gzipped else f
        for lineno, raw in enumerate(stream, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{origin}:{lineno}: invalid JSON ({e.msg})") from None
            except UnicodeDecodeError as e:
                raise ValueError(f"{origin}:{lineno}: not valid UTF-8 ({e.reason})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(f"{origin}:{lineno}: no {text_field!r} field")
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{origin}:{lineno}: field {text_field!r} is not a string")
            yield text
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise ValueError(f"{origin}: corrupt gzip data after line {lineno} ({e})") from None
