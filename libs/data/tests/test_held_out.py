"""Held-out validation documents: the last documents of a dataset, never in its training stream
(text and shards alike, shuffled or not), the same split in every process, exact resume."""

import itertools
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from tessera.data import (
    HELD_OUT_FRACTION, TextDataset, build_dataloader, load_dataset, load_tokenizer, pretokenize, split_held_out,
)

TOK = load_tokenizer()
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A .txt of 60 documents ending in their number ("#17"), and its shards (several files)."""
    tmp = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 60)))) + f" #{i}" for i in range(60)]
    text = tmp / "docs.txt"
    text.write_text("\n\n".join(docs))
    index = pretokenize([text], tmp / "shards", shard_tokens=600)
    assert len(index["shards"]) > 3
    return text, tmp / "shards"


def windows_of(loader, steps):
    return [torch.cat([x, y[:, -1:]], 1) for x, y in itertools.islice(loader, steps)]


def equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def documents_seen(dataset, num_tokens, seq_len=15, **kwargs):
    """The document numbers in two epochs of `dataset`'s training stream."""
    steps = math.ceil(2 * num_tokens / (seq_len + 1))
    text = "".join(TOK.decode(w[0].tolist()) for w in windows_of(build_dataloader(dataset, TOK, seq_len, 1, **kwargs), steps))
    return {int(n) for n in re.findall(r"#(\d+)", text)}


def tokens(dataset):
    return sum(len(TOK.encode(doc, bos=True, eos=True)) for doc in dataset)


def test_the_last_documents_are_held_out(corpus):
    text, _ = corpus
    dataset = load_dataset(text)
    training, held_out = split_held_out(dataset, 0.1)
    assert training.documents == dataset.documents[:54] and held_out.documents == dataset.documents[54:]
    assert training.source == f"{text} without its last 6 documents (held out)"
    assert held_out.source == f"{text}'s last 6 documents (held out)"
    assert len(split_held_out(dataset)[1]) == math.ceil(60 * HELD_OUT_FRACTION) == 1  # at least one


@pytest.mark.parametrize("shuffle", [False, True])
def test_held_out_documents_never_reach_the_training_stream(corpus, shuffle):
    text, folder = corpus
    for dataset in (load_dataset(text), load_dataset(folder)):
        training, held_out = split_held_out(dataset, 0.25)
        num_tokens = training.num_tokens if hasattr(training, "num_tokens") else tokens(training)
        assert documents_seen(training, num_tokens, shuffle=shuffle, seed=3) == set(range(45))
        held_out_tokens = held_out.num_tokens if hasattr(held_out, "num_tokens") else tokens(held_out)
        assert documents_seen(held_out, held_out_tokens) == set(range(45, 60))


def test_shard_parts_hold_the_text_parts_windows(corpus):
    """Parts of shards (views starting mid-file, across shard boundaries) yield exactly the
    windows of the same parts of the text."""
    text, folder = corpus
    text_parts, shard_parts = split_held_out(load_dataset(text), 0.3), split_held_out(load_dataset(folder), 0.3)
    for text_part, shard_part in zip(text_parts, shard_parts):
        assert [shard_part.document(i).tolist() for i in range(len(shard_part))] == [
            TOK.encode(doc, bos=True, eos=True) for doc in text_part.documents]
        for world in (1, 2):
            for rank in range(world):  # several epochs
                expected = windows_of(build_dataloader(text_part, TOK, 15, 2, rank, world), 40)
                assert equal(windows_of(build_dataloader(shard_part, TOK, 15, 2, rank, world), 40), expected)


@pytest.mark.parametrize("source", ["text", "shards"])
def test_training_part_resumes_exactly(corpus, source):
    path = corpus[0] if source == "text" else corpus[1]

    def make():
        training = split_held_out(load_dataset(path), 0.2)[0]
        return build_dataloader(training, TOK, 15, 2, shuffle=True, seed=5, shuffle_buffer=4)

    first = make()
    windows_of(first, 7)
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert equal(windows_of(resumed, 30), windows_of(first, 30))


def test_state_of_the_whole_dataset_is_refused_by_its_training_part(corpus):
    text, _ = corpus
    whole = build_dataloader(load_dataset(text), TOK, 15, 2)
    next(whole)
    part = build_dataloader(split_held_out(load_dataset(text))[0], TOK, 15, 2)
    with pytest.raises(ValueError, match=rf"^loader state is for a dataset of 60 documents, {re.escape(str(text))} "
                                         r"without its last 1 document \(held out\) has 59$"):
        part.load_state_dict(whole.state_dict())


def test_the_split_is_the_same_in_every_process():
    """The default corpus's split and first shuffled training batch, in processes with different
    hash seeds (nothing may depend on Python's per-process hashing)."""
    code = ("import hashlib; from tessera.data import *\n"
            "training, held_out = split_held_out(load_dataset())\n"
            "x, _ = next(build_dataloader(training, load_tokenizer(), 64, 2, shuffle=True, seed=1))\n"
            "print(len(training), len(held_out), hashlib.sha256('\\0'.join(held_out.documents).encode()).hexdigest(),"
            " hashlib.sha256(x.numpy().tobytes()).hexdigest())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    outputs = {subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONHASHSEED": seed}, capture_output=True,
                              text=True, check=True).stdout for seed in ("1", "2")}
    assert len(outputs) == 1
    dataset = load_dataset()
    training, held_out = split_held_out(dataset)
    assert outputs.pop().split()[:2] == [str(len(dataset) - len(held_out)), str(len(held_out))]
    assert held_out.documents == dataset.documents[-len(held_out):]


@pytest.mark.parametrize("dataset, fraction, message", [
    (TextDataset("one.txt", ("only",)), 0.01, "dataset one.txt has 1 document: too few to hold out 1% for validation"),
    (TextDataset("two.txt", ("a", "b")), 0.5, None),
    (TextDataset("two.txt", ("a", "b")), 0.0, r"held-out fraction must be within \(0, 1\), got 0.0"),
    (TextDataset("two.txt", ("a", "b")), 1.0, r"held-out fraction must be within \(0, 1\), got 1.0"),
])
def test_bad_splits(dataset, fraction, message):
    if message is None:
        assert [part.documents for part in split_held_out(dataset, fraction)] == [("a",), ("b",)]
        return
    with pytest.raises(ValueError, match=f"^{message}"):
        split_held_out(dataset, fraction)
