"""Parquet datasets: rows are documents in file order, read a row group at a time (opening reads
footers only; a pass reads each group once, shuffled or not), the text column chosen by name,
bad files named in one line; they shuffle, resume, split and pretokenize like the other text
sources."""

import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tessera.data import build_dataloader, iter_documents, load_dataset, load_tokenizer, pretokenize, split_held_out
from tessera.data.parquet import ParquetDataset

DOCS = [f"document {i}: " + "word " * (i % 7 + 3) for i in range(40)]


def _write(path, docs, rows_per_group, column="text"):
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(docs))), column: docs})
    pq.write_table(table, path, row_group_size=rows_per_group)


@pytest.fixture
def folder(tmp_path):
    """DOCS over two files (sorted by relative path: a/ before b/), 5 and 4 rows per group."""
    _write(tmp_path / "corpus" / "a" / "train-0.parquet", DOCS[:25], 5)
    _write(tmp_path / "corpus" / "b" / "train-1.parquet", DOCS[25:], 4)
    (tmp_path / "corpus" / "README.md").write_text("a dataset card, not a document")
    return tmp_path / "corpus"


@pytest.fixture
def reads(monkeypatch):
    """The row groups read, in order."""
    seen, read = [], pq.ParquetFile.read_row_group

    def counted(self, i, *args, **kwargs):
        seen.append(i)
        return read(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    return seen


def test_rows_are_documents_in_file_order_read_a_row_group_at_a_time(folder, reads):
    dataset = load_dataset(folder)
    assert isinstance(dataset, ParquetDataset) and len(dataset) == len(DOCS)
    assert reads == []  # footers only
    assert list(dataset) == DOCS
    assert len(reads) == 5 + 4  # each group once: 25 rows in groups of 5, 15 in groups of 4 (the last of 3)
    assert list(iter_documents(folder)) == DOCS
    assert dataset[-1] == DOCS[-1] and list(dataset[3:8]) == DOCS[3:8]


def test_the_text_column_is_named_and_nulls_are_empty_documents(tmp_path):
    _write(tmp_path / "c.parquet", ["first", None, "third"], 2, column="content")
    assert list(load_dataset(tmp_path / "c.parquet", text_field="content")) == ["first", "", "third"]


@pytest.mark.parametrize("write, message", [
    (lambda path: _write(path, ["x"], 1, column="body"), r"no 'text' column \(columns: id, body\); training.dataset_text_field"),
    (lambda path: pq.write_table(pa.table({"text": [1, 2]}), path), "column 'text' holds int64, not text"),
    (lambda path: path.write_bytes(b"not parquet at all"), "not a readable Parquet file"),
    (lambda path: pq.write_table(pa.table({"text": pa.array([], pa.string())}), path), "has no documents"),
])
def test_bad_parquet_is_one_line_naming_the_file(tmp_path, write, message):
    path = tmp_path / "bad.parquet"
    write(path)
    with pytest.raises(ValueError, match=message) as error:
        load_dataset(path)
    assert "\n" not in str(error.value)


def test_shuffled_epochs_read_each_group_once_and_resume_exactly(folder, reads):
    tokenizer = load_tokenizer()
    dataset = load_dataset(folder)
    order = dataset.epoch_order(3, 0)
    assert sorted(order) == list(range(len(DOCS))) and list(order) != list(range(len(DOCS)))
    group = [row // 5 if row < 25 else 5 + (row - 25) // 4 for row in order]  # each row's group
    assert sum(a != b for a, b in zip(group, group[1:])) == 9 - 1  # the 9 groups one after another

    def loader():
        return build_dataloader(load_dataset(folder), tokenizer, 16, 2, shuffle=True, seed=3)

    uninterrupted, stopped = iter(loader()), loader()
    batches = [next(uninterrupted) for _ in range(12)]
    reads.clear()
    first = iter(stopped)
    for _ in range(5):
        next(first)
    state = stopped.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    later = iter(resumed)
    for want in batches[5:]:
        got = next(later)
        assert all((g == w).all() for g, w in zip(got, want))
    # a group per run of documents (a resumed loader reads its current one again): 7 reads for
    # the ~30 documents of the two loaders' 12 batches of 34 tokens; one read per document would be ~30
    assert len(reads) < 10, reads


def test_held_out_split_and_pretokenized_shards_hold_the_same_documents(folder, tmp_path):
    training, held_out = split_held_out(load_dataset(folder), 0.1)
    assert list(training) == DOCS[:36] and list(held_out) == DOCS[36:]
    assert "held out" in training.source and "held out" in held_out.source
    pretokenize([str(folder)], tmp_path / "shards")
    tokenizer = load_tokenizer()
    direct = build_dataloader(load_dataset(folder), tokenizer, 16, 2, infinite=False)
    shards = build_dataloader(load_dataset(tmp_path / "shards"), tokenizer, 16, 2, infinite=False)
    pairs = list(zip(direct, shards, strict=True))
    assert pairs and all((a == b).all() for x, y in pairs for a, b in zip(x, y))


def test_without_pyarrow_a_parquet_source_says_what_to_install(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"^reading Parquet needs pyarrow: pip install pyarrow$"):
        load_dataset(folder)

