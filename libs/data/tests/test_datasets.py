import gzip
import json
import socket

import pytest

from tessera.data import load_dataset


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_default_corpus_offline(no_network):
    for source in (None, "default"):
        ds = load_dataset(source)
        assert ds.source == "default"
        assert len(ds) == 318
        assert all(isinstance(doc, str) and doc.strip() for doc in ds.documents)
        assert '"""' in ds[0] or "import" in ds[0]  # Python source text


def test_txt_file_blocks(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("\n\nfirst line\n  second line\n \t\nthird\n\n\n\nfourth\n")
    ds = load_dataset(path)
    assert ds.documents == ("first line\n  second line", "third", "fourth")
    assert ds.source == str(path)


def test_md_file_blocks(tmp_path):
    path = tmp_path / "a.md"
    path.write_text("# title\n\nbody 世界")
    assert load_dataset(str(path)).documents == ("# title", "body 世界")


def test_folder_recursive_sorted(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("bz\n\nstill bz")
    (tmp_path / "b" / "a.md").write_text("ba")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "c.txt").write_text("  \n")  # blank: skipped
    (tmp_path / "d.bin").write_bytes(b"\0\1")  # not a text file: ignored
    assert load_dataset(tmp_path).documents == ("a", "ba", "bz\n\nstill bz")


def test_folder_of_json_lines_reads_only_those(tmp_path):
    # a local Hugging Face text dataset (c4's layout): its README is not a document
    (tmp_path / "README.md").write_text("# c4\nlicense ...")
    (tmp_path / "en").mkdir()
    (tmp_path / "en" / "c4-train.00000.json.gz").write_bytes(gzip.compress(b'{"text": "c1"}\n{"text": "c2"}\n'))
    (tmp_path / "en" / "c4-train.00001.json").write_text('{"text": "c3"}\n')  # as torchtitan's c4_test
    (tmp_path / "extra.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n'))
    assert load_dataset(tmp_path).documents == ("c1", "c2", "c3", "x")


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz"])
def test_jsonl(tmp_path, name):
    lines = [json.dumps({"text": "one", "id": 1}), "", json.dumps({"text": "two\n\nlines"})]
    data = "\n".join(lines).encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    assert load_dataset(path).documents == ("one", "two\n\nlines")


def test_jsonl_custom_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"content": "x", "text": "ignored"}\n')
    assert load_dataset(path, text_field="content").documents == ("x",)


def _write(tmp_path, name, content):
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("d.jsonl", '{"text": "a"}\n{"text": oops}\n', r"d.jsonl:2: invalid JSON"),
        ("d.jsonl", '{"text": "a"}\n\n{"body": "b"}\n', r"d.jsonl:3: no 'text' field"),
        ("d.jsonl", '["text"]\n', r"d.jsonl:1: no 'text' field"),
        ("d.jsonl", '{"text": 5}\n', r"d.jsonl:1: field 'text' is not a string"),
        ("d.jsonl", b'{"text": "\xff"}\n', r"d.jsonl:1: not valid UTF-8"),
        ("d.jsonl.gz", b"not gzip at all", r"d.jsonl.gz: corrupt gzip data"),
        ("d.jsonl", "\n\n", r"dataset .*d.jsonl has no documents"),
        ("d.txt", " \n\t\n", r"dataset .*d.txt has no documents"),
        ("d.txt", b"ok\xff\n", r"d.txt: not valid UTF-8"),
        ("d.csv", "a,b\n", r"unsupported dataset file .*d.csv"),
    ],
)
def test_bad_files(tmp_path, name, content, message):
    with pytest.raises(ValueError, match=message):
        load_dataset(_write(tmp_path, name, content))


def test_truncated_gzip(tmp_path):
    data = gzip.compress(b'{"text": "a"}\n' * 1000)
    path = _write(tmp_path, "d.jsonl.gz", data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"d.jsonl.gz: corrupt gzip data"):
        load_dataset(path)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"dataset path not found: .*missing.jsonl"):
        load_dataset(tmp_path / "missing.jsonl")


def test_empty_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.py").write_text("print()")
    with pytest.raises(ValueError, match=r"dataset .* has no documents"):
        load_dataset(tmp_path)
