"""Documents in a text column of columnar files, one document per row: Parquet (FineWeb, DCLM and
most Hugging Face datasets ship as Parquet) and the Arrow files of a folder written by Hugging
Face `datasets`' `save_to_disk` (`saved_dataset_files` lists them).

Opening reads only metadata (Parquet footers; the batch lengths of memory-mapped Arrow streams),
so a corpus larger than memory trains: a document is read with its whole group (a Parquet row
group, an Arrow record batch), which stays cached until a document of another group is asked
for. Shuffled epochs therefore permute the groups and, within each, its rows (`epoch_order`,
seeded like the other sources) instead of all rows at once, which would read a group per
document. Positions are global row numbers in file order, so resume states are those of any
text dataset and do not depend on the layout. Needs pyarrow.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

PARQUET_SUFFIX = ".parquet"
ARROW_SUFFIX = ".arrow"
# What save_to_disk writes: a Dataset's folder holds both, a DatasetDict's one folder per split.
_DATASET_FILES = ("state.json", "dataset_info.json")
_DATASET_DICT_FILE = "dataset_dict.json"
_TRAINING_SPLIT = "train"


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("reading Parquet or Arrow datasets needs pyarrow: pip install pyarrow") from None
    return pa, pq


@dataclass(frozen=True)
class _Chunk:
    """Rows [first, first + count) of group `group` of file `file` (an index into files)."""

    file: int
    group: int
    first: int
    count: int


class ColumnarDataset(Sequence[str]):
    """The `text_field` column of Parquet or Arrow `files`, in file and row order; `source` names it."""

    def __init__(self, source: str, files: Sequence[Path], text_field: str, chunks: list[_Chunk] | None = None):
        self.source, self.files, self.text_field = source, tuple(files), text_field
        self._chunks = self._open() if chunks is None else chunks
        self._ends = list(np.cumsum([c.count for c in self._chunks]))
        self._cached: tuple[tuple[int, int], list] | None = None  # (file, group) -> its column's values

    def __len__(self) -> int:
        return int(self._ends[-1]) if self._ends else 0

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("a Parquet or Arrow dataset is sliced in steps of 1")
            return self.rows(start, stop, self.source)
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {self.source} ({len(self)} rows)")
        index %= len(self)
        k = bisect.bisect_right(self._ends, index)
        chunk = self._chunks[k]
        value = self._group(chunk.file, chunk.group)[chunk.first + index - (self._ends[k] - chunk.count)]
        return "" if value is None else value  # a null text is an empty document

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """Row positions of a shuffled epoch: the groups in a seeded permutation, each one's rows
        in a permutation of their own (one read per group, not per row)."""
        starts = [int(end) - c.count for end, c in zip(self._ends, self._chunks)]
        order = np.random.default_rng([seed, epoch]).permutation(len(self._chunks))
        return np.concatenate([starts[k] + np.random.default_rng([seed, epoch, int(k)]).permutation(self._chunks[k].count)
                               for k in order]) if len(order) else np.zeros(0, dtype=np.int64)

    def rows(self, start: int, stop: int, source: str) -> ColumnarDataset:
        """Rows [start, stop) as a dataset of the same files named `source` (the held-out
        split's parts)."""
        chunks, end = [], 0
        for c in self._chunks:
            begin, end = end, end + c.count
            lo, hi = max(start, begin), min(stop, end)
            if lo < hi:
                chunks.append(_Chunk(c.file, c.group, c.first + lo - begin, hi - lo))
        return ColumnarDataset(source, self.files, self.text_field, chunks)

    def _group(self, file: int, group: int) -> list:
        if self._cached is None or self._cached[0] != (file, group):
            self._cached = ((file, group), _read_column(self.files[file], group, self.text_field))
        return self._cached[1]

    def _open(self) -> list[_Chunk]:
        """Every group of the files (metadata only), after checking each has the string column."""
        chunks = []
        for i, path in enumerate(self.files):
            schema, counts = _parquet_groups(path) if path.suffix == PARQUET_SUFFIX else _arrow_groups(path)
            _check_text_column(path, schema, self.text_field)
            chunks += [_Chunk(i, g, 0, n) for g, n in enumerate(counts) if n]
        return chunks


def _read_column(path: Path, group: int, text_field: str) -> list:
    """The `text_field` values of group `group` (a Parquet row group, an Arrow record batch). The
    column is validated in full first (offsets inside their buffers, UTF-8): pyarrow trusts mapped
    Arrow data, and a damaged file would crash the process in to_pylist. Any pyarrow error is one
    line naming the file and the group."""
    pa, pq = _pyarrow()
    parquet = path.suffix == PARQUET_SUFFIX
    try:
        if parquet:
            column = pq.ParquetFile(path, memory_map=True).read_row_group(group, columns=[text_field]).column(0)
        else:
            column = _arrow_batch(path, group).column(text_field)
        column.validate(full=True)
        return column.to_pylist()
    except (pa.ArrowException, OSError) as e:
        what = "row group" if parquet else "record batch"
        raise ValueError(f"{path}: {what} {group} unreadable ({_one_line(e)})") from None


def _one_line(error: Exception) -> str:
    """pyarrow's message (often several lines, at times with control bytes) as one line."""
    return " ".join("".join(c if c.isprintable() else " " for c in str(error)).split())


def _parquet_groups(path: Path) -> tuple:
    """The schema and rows per row group, from the footer."""
    pa, pq = _pyarrow()
    try:
        meta = pq.ParquetFile(path, memory_map=True)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({_one_line(e)})") from None
    return meta.schema_arrow, [meta.metadata.row_group(g).num_rows for g in range(meta.num_row_groups)]


def _arrow_stream(path: Path):
    pa, _ = _pyarrow()
    try:
        return pa.ipc.open_stream(pa.memory_map(str(path)))
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Arrow stream file ({_one_line(e)})") from None


def _arrow_groups(path: Path) -> tuple:
    """The schema and rows per record batch: memory-mapped, so counting them reads no column."""
    pa, _ = _pyarrow()
    reader = _arrow_stream(path)
    try:
        return reader.schema, [batch.num_rows for batch in reader]
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Arrow stream file ({_one_line(e)})") from None


def _arrow_batch(path: Path, group: int):
    """Record batch `group` of a stream file: the ones before it are skipped, not copied (mapped)."""
    for i, batch in enumerate(_arrow_stream(path)):
        if i == group:
            return batch
    raise ValueError(f"{path}: changed since it was opened (record batch {group} is gone)")


def _check_text_column(path: Path, schema, text_field: str) -> None:
    pa, _ = _pyarrow()
    if text_field not in schema.names:
        raise ValueError(f"{path}: no {text_field!r} column (columns: {', '.join(schema.names)}); "
                         "training.dataset_text_field names it")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{path}: column {text_field!r} holds {kind}, not text")


def saved_dataset_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a folder `datasets`' save_to_disk wrote, in their order (state.json's
    list), or None if it is not one. A DatasetDict's folder reads its "train" split. File and
    split names come from inside the folder, so each must name a file inside it."""
    dict_file = folder / _DATASET_DICT_FILE
    if dict_file.is_file():
        splits = _json(dict_file).get("splits")
        if not isinstance(splits, list) or _TRAINING_SPLIT not in splits:
            raise ValueError(f"{dict_file}: no {_TRAINING_SPLIT!r} split (splits: {splits}); "
                             "give the folder of the split to train on")
        folder = _inside(folder, _TRAINING_SPLIT, dict_file)
        if not all((folder / name).is_file() for name in _DATASET_FILES):
            raise ValueError(f"{folder}: the {_TRAINING_SPLIT!r} split of {dict_file} has no {' and '.join(_DATASET_FILES)}")
    elif not all((folder / name).is_file() for name in _DATASET_FILES):
        return None
    state = folder / _DATASET_FILES[0]
    entries = _json(state).get("_data_files")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) and "filename" in e for e in entries):
        raise ValueError(f"{state}: no '_data_files' list of {{'filename': ...}} entries")
    files = [_inside(folder, entry["filename"], state) for entry in entries]
    for path in files:
        if path.suffix != ARROW_SUFFIX or not path.is_file():
            raise ValueError(f"{state}: data file {path.name!r} is not an Arrow file in {folder}")
    return files


def _inside(folder: Path, name, origin: Path) -> Path:
    """`folder / name`, refused unless it stays inside `folder` (names read from files)."""
    path = (folder / str(name)).resolve()
    if not isinstance(name, str) or not path.is_relative_to(folder.resolve()) or path == folder.resolve():
        raise ValueError(f"{origin}: {name!r} is not a name inside {folder}")
    return path


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value


def iter_columnar(path: Path, text_field: str) -> Iterator[str]:
    """Every row's document of one file, a group at a time (tools/pretokenize). Blank rows are
    kept, as the dataset keeps them (it cannot skip rows it has not read), so the token shards
    of a Parquet or Arrow source hold the same documents in the same order (held-out splits)."""
    yield from ColumnarDataset(str(path), [path], text_field)
