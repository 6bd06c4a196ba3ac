"""The BPE trainer in tools/tokenizer and the committed assets it produced."""

import gzip
import importlib.util
import random
from pathlib import Path

import pytest

import tessera.data
from tessera.data import load_dataset, load_tokenizer, read_ranks

ASSETS = Path(tessera.data.__file__).parent / "assets"
TRAINER = Path(__file__).parents[3] / "tools" / "tokenizer" / "train_bpe.py"


@pytest.fixture(scope="module")
def trainer():
    spec = importlib.util.spec_from_file_location("train_bpe", TRAINER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_merges_most_frequent_pair_with_fixed_tie_break(trainer):
    counts = {b"abab": 3, b"cd": 6, b"xy": 6}
    ranks = trainer.train_bpe(counts, 3)
    # (a,b) occurs 6 times, like (c,d) and (x,y): ties go to the smallest ids, (a,b) first.
    assert [t for t, r in sorted(ranks.items(), key=lambda i: i[1])][256:] == [b"ab", b"cd", b"xy"]
    assert trainer.train_bpe(counts, 4)[b"abab"] == 259


def test_random_corpora_give_distinct_tokens(trainer):
    rng = random.Random(0)
    ran = 0
    for _ in range(200):
        counts = {
            bytes(rng.choice(b"abc ") for _ in range(rng.randrange(2, 9))): rng.randrange(1, 9)
            for _ in range(rng.randrange(3, 8))
        }
        try:
            ranks = trainer.train_bpe(counts, 10)
        except ValueError:
            continue  # fewer than 10 merges possible
        assert len(ranks) == 266 and sorted(ranks.values()) == list(range(266))
        ran += 1
    assert ran == 176  # seed 0's corpora: the other 24 allow fewer than 10 merges


def test_too_small_corpus(trainer):
    with pytest.raises(ValueError, match="corpus too small: only 1 merges possible"):
        trainer.train_bpe({b"ab": 1}, 2)


def test_pieces_follow_the_llama3_split(trainer):
    counts = trainer.count_pieces(["I'm here, 12345 times!\n\n  x"])
    assert counts == {b"I": 1, b"'m": 1, b" here": 1, b",": 1, b" ": 2, b"123": 1, b"45": 1,
                      b" times": 1, b"!\n\n": 1, b" x": 1}


def test_committed_tokenizer_is_reproducible(trainer, tmp_path):
    out = tmp_path / "tokenizer.model"
    assert trainer.main(["--out", str(out)]) == 0
    assert out.read_bytes() == (ASSETS / "tokenizer.model").read_bytes()


def test_committed_assets():
    ranks = read_ranks(ASSETS / "tokenizer.model")
    assert len(ranks) == 1792 and load_tokenizer().vocab_size == 2048
    corpus = ASSETS / "stdlib_corpus.jsonl.gz"
    assert corpus.stat().st_size < 2_000_000
    assert corpus.read_bytes()[4:8] == b"\0\0\0\0"  # gzip mtime 0: reproducible bytes
    assert sum(len(doc.encode()) for doc in load_dataset().documents) < 6 * 1024 * 1024
    assert "Python Software Foundation" in (ASSETS / "NOTICE").read_text()
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        assert all(line.startswith('{"text": ') for line in f)
