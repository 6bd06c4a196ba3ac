"""Parquet files and Hugging Face `datasets` folders (save_to_disk): rows are documents in file
order, read a group at a time (a Parquet row group, an Arrow record batch; opening reads metadata
only; a pass reads each group once, shuffled or not), the text column chosen by name, bad files
named in one line; they shuffle, resume, split and pretokenize like the other text sources. The
folders are written by `datasets` itself and read back by its `load_from_disk` as the reference."""

import json
import sys

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tessera.data import build_dataloader, iter_documents, load_dataset, load_tokenizer, pretokenize, split_held_out
from tessera.data import columnar
from tessera.data.columnar import ColumnarDataset

DOCS = [f"document {i}: " + "word " * (i % 7 + 3) for i in range(40)]
GROUP = 5  # rows per group in both formats: 8 groups, 4 per file


def _write(path, docs, rows_per_group, column="text"):
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(docs))), column: docs})
    pq.write_table(table, path, row_group_size=rows_per_group)


def _save_to_disk(folder, docs, monkeypatch, **kwargs):
    """`datasets`' own folder, with record batches of GROUP rows (its writer batch size)."""
    monkeypatch.setattr(datasets.config, "DEFAULT_MAX_BATCH_SIZE", GROUP)
    datasets.Dataset.from_dict({"id": list(range(len(docs))), "text": docs}).save_to_disk(str(folder), **kwargs)


@pytest.fixture(params=["parquet", "saved_dataset"])
def folder(request, tmp_path, monkeypatch):
    """DOCS over two files: Parquet (sorted by relative path: a/ before b/, a README beside them)
    or the two Arrow shards of a save_to_disk folder."""
    corpus = tmp_path / "corpus"
    if request.param == "parquet":
        _write(corpus / "a" / "train-0.parquet", DOCS[:20], GROUP)
        _write(corpus / "b" / "train-1.parquet", DOCS[20:], GROUP)
        (corpus / "README.md").write_text("a dataset card, not a document")
    else:
        _save_to_disk(corpus, DOCS, monkeypatch, num_shards=2)
        assert datasets.load_from_disk(str(corpus))["text"] == DOCS  # the reference reads what Tessera must
    return corpus


@pytest.fixture
def reads(monkeypatch):
    """The groups read, in order (Parquet row groups and Arrow record batches alike)."""
    seen, read_row_group, arrow_batch = [], pq.ParquetFile.read_row_group, columnar._arrow_batch

    def row_group(self, i, *args, **kwargs):
        seen.append(i)
        return read_row_group(self, i, *args, **kwargs)

    def batch(path, i):
        seen.append(i)
        return arrow_batch(path, i)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", row_group)
    monkeypatch.setattr(columnar, "_arrow_batch", batch)
    return seen


def test_rows_are_documents_in_file_order_read_a_group_at_a_time(folder, reads):
    dataset = load_dataset(folder)
    assert isinstance(dataset, ColumnarDataset) and len(dataset) == len(DOCS)
    assert reads == []  # metadata only
    assert list(dataset) == DOCS
    assert len(reads) == len(DOCS) // GROUP  # each group once
    assert list(iter_documents(folder)) == DOCS
    assert dataset[-1] == DOCS[-1] and list(dataset[3:8]) == DOCS[3:8]


def test_the_text_column_is_named_and_nulls_are_empty_documents(tmp_path):
    _write(tmp_path / "c.parquet", ["first", None, "third"], 2, column="content")
    assert list(load_dataset(tmp_path / "c.parquet", text_field="content")) == ["first", "", "third"]


def test_a_dataset_dict_folder_trains_on_its_train_split(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "DEFAULT_MAX_BATCH_SIZE", GROUP)
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:30]}),
                                   "validation": datasets.Dataset.from_dict({"text": DOCS[30:]})})
    splits.save_to_disk(str(tmp_path / "dict"))
    assert list(load_dataset(tmp_path / "dict")) == datasets.load_from_disk(str(tmp_path / "dict"))["train"]["text"]
    assert list(load_dataset(tmp_path / "dict" / "validation")) == DOCS[30:]  # a split's own folder
    datasets.DatasetDict({"test": splits["validation"]}).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(ValueError, match=r"dataset_dict.json: no 'train' split \(splits: \['test'\]\); give the folder"):
        load_dataset(tmp_path / "no_train")


def _point_state_at(name):
    def write(folder):
        state = json.loads((folder / "state.json").read_text())
        state["_data_files"] = [{"filename": name}]
        (folder / "state.json").write_text(json.dumps(state))
    return write


@pytest.mark.parametrize("spoil, message", [
    (_point_state_at("../outside.arrow"), r"state.json: '../outside.arrow' is not a name inside"),
    (_point_state_at("state.json"), r"state.json: data file 'state.json' is not an Arrow file in"),
    (lambda folder: (folder / "state.json").write_text("{"), r"state.json: invalid JSON"),
    (lambda folder: next(folder.glob("*.arrow")).write_bytes(b"not arrow"), "not a readable Arrow stream file"),
])
def test_a_bad_saved_dataset_is_one_line_naming_the_file(tmp_path, monkeypatch, spoil, message):
    _save_to_disk(tmp_path / "saved", DOCS, monkeypatch)
    (tmp_path / "outside.arrow").write_bytes((next((tmp_path / "saved").glob("*.arrow"))).read_bytes())
    spoil(tmp_path / "saved")
    with pytest.raises(ValueError, match=message) as error:
        load_dataset(tmp_path / "saved")
    assert "\n" not in str(error.value)


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


def _spoil(path, old, new):
    data = path.read_bytes()
    assert data.count(old) == 1
    path.write_bytes(data.replace(old, new))


def test_a_damaged_group_is_one_line_naming_the_file_and_group(tmp_path, monkeypatch):
    """Found when the group is read (opening reads metadata only); a damaged Arrow batch would
    otherwise crash the process (pyarrow trusts mapped data), a Parquet page gives several lines."""
    _save_to_disk(tmp_path / "saved", DOCS, monkeypatch)
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    ends = np.cumsum([0] + [len(d) for d in DOCS[GROUP : 2 * GROUP]]).astype("<i4")  # batch 1's text offsets
    _spoil(arrow, ends.tobytes(), ends[:2].tobytes() + np.int32(10**9).tobytes() + ends[3:].tobytes())
    _spoil(arrow, b"document 12:", b"\xffocument 12:")  # not UTF-8
    _write(tmp_path / "bad.parquet", DOCS, GROUP)
    chunk = pq.ParquetFile(tmp_path / "bad.parquet").metadata.row_group(1).column(1)
    with open(tmp_path / "bad.parquet", "r+b") as f:  # row group 1's first page header
        f.seek(chunk.dictionary_page_offset or chunk.data_page_offset)
        f.write(b"\xff" * 8)
    for path, row, message in [(arrow.parent, GROUP, f"{arrow}: record batch 1 unreadable .*Offset invariant"),
                               (arrow.parent, 2 * GROUP + 2, f"{arrow}: record batch 2 unreadable .*UTF-?8"),
                               (tmp_path / "bad.parquet", GROUP, "bad.parquet: row group 1 unreadable")]:
        dataset = load_dataset(path)
        assert dataset[0] == DOCS[0]
        with pytest.raises(ValueError, match=rf"^\S*{message}[^\n]*\)$"):
            dataset[row]


def test_shuffled_epochs_read_each_group_once_and_resume_exactly(folder, reads):
    tokenizer = load_tokenizer()
    dataset = load_dataset(folder)
    order = dataset.epoch_order(3, 0)
    assert sorted(order) == list(range(len(DOCS))) and list(order) != list(range(len(DOCS)))
    group = [row // GROUP for row in order]  # each row's group
    assert sum(a != b for a, b in zip(group, group[1:])) == len(DOCS) // GROUP - 1  # the groups one after another
    # every epoch its own order of the groups (not only of the rows within each)
    group_orders = {tuple(dict.fromkeys(row // GROUP for row in dataset.epoch_order(3, epoch))) for epoch in range(4)}
    assert len(group_orders) > 1

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
    # a group per run of documents (a resumed loader reads its current one again): a few reads
    # for the ~30 documents of the two loaders' 12 batches of 34 tokens; one per document would be ~30
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


def test_without_pyarrow_a_columnar_source_says_what_to_install(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"^reading Parquet or Arrow datasets needs pyarrow: pip install pyarrow$"):
        load_dataset(folder)
