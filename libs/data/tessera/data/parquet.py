"""Parquet documents (FineWeb, DCLM and most Hugging Face datasets ship as Parquet): one document
per row, its text in a named string column.

Opening reads only the files' footers (row counts per row group), so a corpus larger than memory
trains: a document is read with its whole row group, which stays cached until a document of
another group is asked for. Shuffled epochs therefore permute the row groups and, within each,
its rows (`epoch_order`, seeded like the other sources) instead of all rows at once, which would
read a row group per document. Positions are global row numbers in file order, so resume states
are those of any text dataset and do not depend on the layout. Needs pyarrow.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

PARQUET_SUFFIX = ".parquet"


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("reading Parquet needs pyarrow: pip install pyarrow") from None
    return pq


@dataclass(frozen=True)
class _Chunk:
    """Rows [first, first + count) of row group `group` of file `file` (an index into files)."""

    file: int
    group: int
    first: int
    count: int


class ParquetDataset(Sequence[str]):
    """The `text_field` column of Parquet `files`, in file and row order; `source` names it."""

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
                raise ValueError("a Parquet dataset is sliced in steps of 1")
            return self.rows(start, stop, self.source)
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {self.source} ({len(self)} rows)")
        index %= len(self)
        k = bisect.bisect_right(self._ends, index)
        chunk = self._chunks[k]
        value = self._group(chunk.file, chunk.group)[chunk.first + index - (self._ends[k] - chunk.count)]
        return "" if value is None else value  # a null text is an empty document

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """Row positions of a shuffled epoch: the row groups in a seeded permutation, each one's
        rows in a permutation of their own (one read per group, not per row)."""
        starts = [int(end) - c.count for end, c in zip(self._ends, self._chunks)]
        order = np.random.default_rng([seed, epoch]).permutation(len(self._chunks))
        return np.concatenate([starts[k] + np.random.default_rng([seed, epoch, int(k)]).permutation(self._chunks[k].count)
                               for k in order]) if len(order) else np.zeros(0, dtype=np.int64)

    def rows(self, start: int, stop: int, source: str) -> ParquetDataset:
        """Rows [start, stop) as a dataset of the same files named `source` (the held-out
        split's parts)."""
        chunks, end = [], 0
        for c in self._chunks:
            begin, end = end, end + c.count
            lo, hi = max(start, begin), min(stop, end)
            if lo < hi:
                chunks.append(_Chunk(c.file, c.group, c.first + lo - begin, hi - lo))
        return ParquetDataset(source, self.files, self.text_field, chunks)

    def _group(self, file: int, group: int) -> list:
        if self._cached is None or self._cached[0] != (file, group):
            table = _pyarrow_parquet().ParquetFile(self.files[file], memory_map=True).read_row_group(
                group, columns=[self.text_field])
            self._cached = ((file, group), table.column(0).to_pylist())
        return self._cached[1]

    def _open(self) -> list[_Chunk]:
        """Every row group of the files (footers only), after checking each has the string column."""
        pq = _pyarrow_parquet()
        import pyarrow as pa

        chunks = []
        for i, path in enumerate(self.files):
            try:
                meta = pq.ParquetFile(path, memory_map=True)
            except (pa.ArrowInvalid, OSError) as e:
                raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
            schema = meta.schema_arrow
            counts = [meta.metadata.row_group(g).num_rows for g in range(meta.num_row_groups)]
            if self.text_field not in schema.names:
                raise ValueError(f"{path}: no {self.text_field!r} column (columns: {', '.join(schema.names)}); "
                                 "training.dataset_text_field names it")
            kind = schema.field(self.text_field).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise ValueError(f"{path}: column {self.text_field!r} holds {kind}, not text")
            chunks += [_Chunk(i, g, 0, n) for g, n in enumerate(counts) if n]
        return chunks


def iter_parquet(path: Path, text_field: str) -> Iterator[str]:
    """Every row's document of one file, a row group at a time (tools/pretokenize). Blank rows
    are kept, as the dataset keeps them (it cannot skip rows it has not read), so the token
    shards of a Parquet source hold the same documents in the same order (held-out splits)."""
    yield from ParquetDataset(str(path), [path], text_field)
