"""The pretokenize command: shards equal to the text path's tokens, a progress line with
docs/s and MB/s, a no-op re-run, and bad input as one `error:` line with exit code 2."""

import pytest

from pretokenize import main
from tessera.data import load_dataset, load_tokenizer


def test_writes_shards_with_progress_and_reruns_as_a_no_op(tmp_path, capsys):
    source = tmp_path / "docs.txt"
    source.write_text("first document\n\nsecond one\nstill second\n\nthird")
    out = tmp_path / "shards"
    assert main([str(source), "--out", str(out), "--workers", "2"]) == 0
    err = capsys.readouterr().err
    assert "docs/s" in err and "MB/s" in err and "3 documents" in err
    tok = load_tokenizer()
    shards = load_dataset(out)
    assert [shards.document(i).tolist() for i in range(3)] == [
        tok.encode(d, bos=True, eos=True) for d in load_dataset(source).documents]
    index = (out / "index.json").stat().st_mtime_ns
    assert main([str(source), "--out", str(out), "--workers", "2"]) == 0
    assert (out / "index.json").stat().st_mtime_ns == index


@pytest.mark.parametrize("make, message", [
    (lambda tmp: [str(tmp / "missing.txt")], "error: dataset path not found: "),
    (lambda tmp: [str(tmp / "x.csv")], "error: unsupported dataset file "),
])
def test_bad_input_is_one_error_line(tmp_path, capsys, make, message):
    (tmp_path / "x.csv").write_text("a,b")
    assert main([*make(tmp_path), "--out", str(tmp_path / "out"), "--workers", "1"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message)
    assert not (tmp_path / "out").exists()
