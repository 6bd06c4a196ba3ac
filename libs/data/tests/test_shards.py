"""Token shards, shuffling, mixtures and prefetch: round trip against the text path, rank-local
reads, exact resume across data-parallel layouts, mixture proportions, and bad input."""

import itertools
import json
import os
import pickle
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from tessera.data import (
    Prefetcher, build_dataloader, load_dataset, load_tokenizer, open_shards, parse_mixture, pretokenize, write_ranks,
)
from tessera.data import shards as shards_module
from tessera.data.mixture import Mixture

TOK = load_tokenizer()
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A .txt of 60 documents of varied length, and its shards (2 workers, several shards)."""
    tmp = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 60)))) + f" #{i}" for i in range(60)]
    text = tmp / "docs.txt"
    text.write_text("\n\n".join(docs))
    index = pretokenize([text], tmp / "shards", workers=2, shard_tokens=1500)
    assert len(index["shards"]) > 2 and index["documents"] == 60
    return text, tmp / "shards"


def windows_of(loader, steps):
    return [torch.cat([x, y[:, -1:]], 1) for x, y in itertools.islice(loader, steps)]


def equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_round_trip_matches_the_text_path(corpus):
    text, folder = corpus
    shards = load_dataset(folder)
    assert shards.dtype == np.dtype("<u2") and len(shards) == 60
    assert [shards.document(i).tolist() for i in range(60)] == [
        TOK.encode(doc, bos=True, eos=True) for doc in load_dataset(text).documents]
    for world in (1, 2):
        for rank in range(world):  # 40 steps of 16-token windows: several epochs
            expected = windows_of(build_dataloader(load_dataset(text), TOK, 15, 2, rank, world), 40)
            assert equal(windows_of(build_dataloader(shards, TOK, 15, 2, rank, world), 40), expected)
    finite = lambda data: windows_of(build_dataloader(data, TOK, 15, 3, infinite=False), 10**6)
    assert equal(finite(shards), finite(load_dataset(text)))


def test_ranks_read_only_their_windows_and_see_each_once(corpus, monkeypatch):
    _, folder = corpus
    shards = open_shards(folder)
    starts = np.cumsum([0] + [s.num_tokens for s in shards.shards])
    reads = []
    pread = os.pread
    monkeypatch.setattr(shards_module.os, "pread", lambda fd, n, off: reads.append((fd, n, off)) or pread(fd, n, off))
    seen = {}
    window = 8
    for rank in range(2):
        reads.clear()
        for k, (x, y) in enumerate(build_dataloader(shards, TOK, window - 1, 2, rank, 2, infinite=False)):
            for j, row in enumerate(torch.cat([x, y[:, -1:]], 1)):
                seen[(k * 2 + j) * 2 + rank] = row
        fds = {s.file.fileno(): i for i, s in enumerate(shards.shards)}
        for fd, n, off in reads:  # stream position of every token read -> its window's owner
            first = starts[fds[fd]] + off // 2
            assert {int(p) // window % 2 for p in range(first, first + n // 2)} == {rank}
    stream = np.concatenate([shards.document(i) for i in range(len(shards))])
    n = len(stream) // window // 4 * 4  # whole global batches
    assert sorted(seen) == list(range(n))
    assert all(seen[i].tolist() == stream[i * window : (i + 1) * window].tolist() for i in range(n))


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("before, after", [(1, 2), (2, 1)])
def test_resume_under_another_layout(corpus, shuffle, before, after):
    """State taken after k steps at dp `before` continues at dp `after` (same global batch 4)."""
    text, folder = corpus
    for data in (load_dataset(folder), load_dataset(text)):
        make = lambda rank, world: build_dataloader(data, TOK, 15, 4 // world, rank, world, shuffle=shuffle, seed=3,
                                                    shuffle_buffer=7)
        reference = make(0, 1)
        expected = windows_of(reference, 30)[9:]
        first = [make(r, before) for r in range(before)]
        for loader in first:
            windows_of(loader, 9)
        states = [pickle.loads(pickle.dumps(loader.state_dict())) for loader in first]
        assert all(state == states[0] for state in states)
        resumed = [make(r, after) for r in range(after)]
        for loader in resumed:
            loader.load_state_dict(states[0])
        got = [windows_of(loader, 21) for loader in resumed]
        # global batch k = rows of every rank interleaved: row j of rank r is global row j * W + r
        merged = [torch.stack([got[i % after][k][i // after] for i in range(4)]) for k in range(21)]
        assert equal(merged, expected)


def test_shuffle_is_seeded_per_epoch_and_bounded(corpus):
    _, folder = corpus
    shards = load_dataset(folder)
    epoch = shards.num_tokens

    def first_epochs(seed, buffer=7):
        loader = build_dataloader(shards, TOK, epoch - 1, 1, shuffle=True, seed=seed, shuffle_buffer=buffer)
        return [torch.cat([x, y[:, -1:]], 1)[0] for x, y in itertools.islice(loader, 2)]

    a, b = first_epochs(1), first_epochs(1)
    assert equal(a, b)  # deterministic
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], first_epochs(2)[0])
    plain = np.concatenate([shards.document(i) for i in range(len(shards))])
    for e in a:  # every epoch: the same documents, another order
        assert sorted(e.tolist()) == sorted(plain.tolist()) and e.tolist() != plain.tolist()
    # Bounded: documents stay in their shard, within their group of `buffer`.
    bos = TOK.bos_id
    docs = np.split(a[0].numpy(), np.flatnonzero(a[0].numpy() == bos)[1:])
    index = {tuple(shards.document(i).tolist()): i for i in range(len(shards))}
    order = [index[tuple(d.tolist())] for d in docs]
    firsts = np.cumsum([0] + [s.num_documents for s in shards.shards])
    groups = [(int(np.searchsorted(firsts, i, "right")), (i - firsts[np.searchsorted(firsts, i, "right") - 1]) // 7)
              for i in order]
    assert groups == [g for g, _ in itertools.groupby(groups) for _ in range(sum(1 for x in groups if x == g))]


def test_text_shuffle_changes_order_only(corpus):
    text, _ = corpus
    data = load_dataset(text)
    epoch = sum(len(TOK.encode(d, bos=True, eos=True)) for d in data.documents)
    plain, shuffled = (next(build_dataloader(data, TOK, epoch - 1, 1, shuffle=s, seed=0))[0] for s in (False, True))
    assert sorted(plain[0].tolist()) == sorted(shuffled[0].tolist()) and not torch.equal(plain, shuffled)


def test_mixture_proportions_deterministic_and_resumable(corpus):
    text, folder = corpus
    weights = [0.7, 0.2, 0.1]
    m = Mixture(weights, seed=5)
    picks = np.array([m.dataset_of(i) for i in range(20000)])
    shares = np.bincount(picks, minlength=3) / len(picks)
    assert np.allclose(shares, weights, atol=0.005)
    assert np.array_equal(m.counts_before(12345), np.bincount(picks[:12345], minlength=3))
    assert np.array_equal(picks, [Mixture(weights, seed=5).dataset_of(i) for i in range(20000)])
    assert not np.array_equal(picks[:4096], [Mixture(weights, seed=6).dataset_of(i) for i in range(4096)])
    # each round of 4096 windows mixed its own way, also where every round holds the same counts
    even = Mixture([0.5, 0.25, 0.25], seed=5)
    rounds = [[even.dataset_of(i) for i in range(start, start + 4096)] for start in (0, 4096)]
    assert sorted(rounds[0]) == sorted(rounds[1]) and rounds[0] != rounds[1]

    datasets = [load_dataset(folder), load_dataset(text)]  # shards and text mix
    make = lambda rank, world: build_dataloader(datasets, TOK, 7, 8 // world, rank, world, weights=[3, 1], seed=1)
    reference = make(0, 1)
    expected = windows_of(reference, 12)[5:]
    proportions = reference.realised_proportions()
    assert list(proportions) == [str(folder), str(text)] and abs(proportions[str(folder)] - 0.75) < 0.15  # 96 windows: sampling noise
    loaders = [make(r, 2) for r in range(2)]
    state = reference.state_dict()
    reference2 = make(0, 1)
    windows_of(reference2, 5)
    for loader in loaders:
        loader.load_state_dict(reference2.state_dict())
    got = [windows_of(loader, 7) for loader in loaders]
    assert equal([torch.stack([got[i % 2][k][i // 2] for i in range(8)]) for k in range(7)], expected)
    assert state["window_index"] == 96


def test_prefetcher_hands_out_the_same_batches_and_state(corpus):
    _, folder = corpus
    data = load_dataset(folder)
    plain = build_dataloader(data, TOK, 15, 2, shuffle=True)
    expected = windows_of(plain, 8)
    fetched = Prefetcher(build_dataloader(data, TOK, 15, 2, shuffle=True), depth=3)
    assert equal(windows_of(fetched, 3), expected[:3])
    state = fetched.state_dict()
    assert state["window_index"] == 6  # consumed, not prepared
    assert equal(windows_of(fetched, 2), expected[3:5])
    fetched.load_state_dict(state)
    assert equal(windows_of(fetched, 5), expected[3:8])
    fetched.close()
    finite = Prefetcher(build_dataloader(data, TOK, 15, 2, infinite=False), depth=2)
    assert len(list(finite)) == len(list(build_dataloader(data, TOK, 15, 2, infinite=False)))


def test_pretokenize_rerun_is_a_no_op_and_refuses_other_inputs(corpus, tmp_path):
    text, folder = corpus
    index_mtime = (folder / "index.json").stat().st_mtime_ns
    assert pretokenize([text], folder, workers=2, shard_tokens=1500)["tokens"] == open_shards(folder).num_tokens
    assert (folder / "index.json").stat().st_mtime_ns == index_mtime
    with pytest.raises(ValueError, match="exists and does not hold shards of these inputs"):
        pretokenize([text], folder, workers=1)  # another shard size
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_a_killed_run_s_partial_output_is_removed_by_the_next(corpus, tmp_path):
    """A SIGKILL leaves the partial folder (as large as the shards written): the next run into the
    same output removes it; a live process's, or another host's, stays."""
    text, _ = corpus
    out, host = tmp_path / "shards", f"{socket.gethostname()}-{os.stat('/proc/self/ns/pid').st_ino}"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    killed, live, other_host = (tmp_path / f".shards.tmp-{name}" for name in
                                (f"{host}-{dead.pid}", f"{host}-{os.getppid()}", f"elsewhere-{dead.pid}"))
    for folder in (killed, live, other_host):
        folder.mkdir()
        (folder / "shard-00000.tokens").write_bytes(bytes(64))
    pretokenize([text], out, workers=1, shard_tokens=1500)
    assert not killed.exists() and live.exists() and other_host.exists()


def _copy(folder, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    for p in folder.iterdir():
        (out / p.name).write_bytes(p.read_bytes())
    return out


def test_bad_shards_are_one_line_errors(corpus, tmp_path):
    _, folder = corpus
    bad = _copy(folder, tmp_path)
    tokens = bad / "shard-00001.tokens"
    tokens.write_bytes(tokens.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"shard-00001.tokens: truncated shard file: \d+ bytes, .*index.json says"):
        open_shards(bad)
    tokens.write_bytes((folder / "shard-00001.tokens").read_bytes())
    offsets = np.fromfile(bad / "shard-00000.offsets", dtype="<i8")
    offsets[-1] += 1
    offsets.tofile(bad / "shard-00000.offsets")
    with pytest.raises(ValueError, match=r"shard-00000.offsets: index/shard mismatch: documents span tokens 0\.\.\d+"):
        open_shards(bad)
    (bad / "shard-00000.offsets").write_bytes((folder / "shard-00000.offsets").read_bytes())
    (bad / "index.json").write_text("{not json")
    with pytest.raises(ValueError, match="index.json: not a token-shard index"):
        open_shards(bad)
    index = json.loads((folder / "index.json").read_text())
    (bad / "index.json").write_text(json.dumps({**index, "tokens": index["tokens"] + 1}))
    with pytest.raises(ValueError, match="index/shard mismatch: shard token counts do not add up"):
        open_shards(bad)

    ranks = {bytes([b]): b for b in range(256)}
    write_ranks(ranks, tmp_path / "bytes.model")
    other = load_tokenizer(tmp_path / "bytes.model")
    with pytest.raises(ValueError, match=r"made by tokenizer 'tessera-default' \(fingerprint \w+\), this run uses "
                                         r"'bytes.model' \(fingerprint \w+\)"):
        build_dataloader(open_shards(folder), other, 15, 2)


@pytest.mark.parametrize("edit, message", [
    (lambda i: i["shards"][0].update(tokens="abc"), "shard 'shard-00000' tokens 'abc' is not a non-negative integer"),
    (lambda i: i["shards"][0].update(tokens=-3), "shard 'shard-00000' tokens -3 is not a non-negative integer"),
    (lambda i: i["shards"][0].update(documents=2.5), "shard 'shard-00000' documents 2.5 is not a non-negative integer"),
    (lambda i: i["shards"][1].pop("documents"), "shard 'shard-00001' documents is missing"),
    (lambda i: i["shards"][0].pop("name"), "shard entry name is missing"),
    (lambda i: i["shards"].append(7), "shard entry 7 is not a JSON object"),
    (lambda i: i.update(shards="shard-00000"), "shards 'shard-00000' is not a JSON list"),
    (lambda i: i.update(tokens="12"), "tokens '12' is not a non-negative integer"),
    (lambda i: i.update(max_id="x"), "max_id 'x' is not an integer >= -1"),
    (lambda i: i.update(dtype="abc"), r"dtype 'abc' is not a token-id type \(uint16 or uint32\)"),
    (lambda i: i.pop("dtype"), "dtype is missing"),
    (lambda i: i.update(tokenizer="tessera-default"), "tokenizer 'tessera-default' is not a JSON object"),
    (lambda i: i["tokenizer"].update(vocab_size=True), "tokenizer.vocab_size True is not a non-negative integer"),
], ids=["tokens not a number", "negative tokens", "fractional documents", "no documents", "no name", "entry not an object",
        "shards not a list", "total a string", "max_id a string", "dtype unknown", "no dtype", "tokenizer not an object",
        "vocab_size a bool"])
def test_a_bad_index_field_is_named(corpus, tmp_path, edit, message):
    """Each field read from index.json is checked: one line naming the file and the field."""
    _, folder = corpus
    bad = _copy(folder, tmp_path)
    index = json.loads((folder / "index.json").read_text())
    edit(index)
    (bad / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"^{re.escape(str(bad / 'index.json'))}: {message}$"):
        open_shards(bad)


def test_an_index_naming_files_outside_its_folder_is_refused(corpus, tmp_path):
    _, folder = corpus
    bad = _copy(folder, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for suffix in (".tokens", ".offsets"):  # a valid shard outside the folder
        (elsewhere / f"shard-00000{suffix}").write_bytes((folder / f"shard-00000{suffix}").read_bytes())
    index = json.loads((folder / "index.json").read_text())
    for name in ("../elsewhere/shard-00000", str(elsewhere / "shard-00000"), "..", ""):
        index["shards"][0]["name"] = name
        (bad / "index.json").write_text(json.dumps(index))
        with pytest.raises(ValueError, match=f"index.json names shard '{re.escape(name)}', not a file name in {bad}"):
            open_shards(bad)


@pytest.mark.parametrize("start", [lambda offsets: offsets[5], lambda _: 10**9, lambda _: -7],
                         ids=["a later document's", "past the end", "negative"])
def test_offsets_that_decrease_are_refused_when_opened(corpus, tmp_path, start):
    """The shuffled stream would read wrong tokens or fail deep inside (IndexError) otherwise."""
    _, folder = corpus
    bad = _copy(folder, tmp_path)
    offsets = np.fromfile(bad / "shard-00000.offsets", dtype="<i8")
    offsets[3] = start(offsets)
    offsets.tofile(bad / "shard-00000.offsets")
    with pytest.raises(ValueError, match=r"^\S+shard-00000.offsets: document [34] starts at token -?\d+, before "
                                         r"document [23] \(token \d+\); offsets never decrease \(damaged file\?\)$"):
        open_shards(bad)


def test_token_ids_are_checked_against_the_vocabulary(corpus, tmp_path):
    _, folder = corpus
    index = json.loads((folder / "index.json").read_text())
    assert 0 < index["max_id"] < TOK.vocab_size  # recorded by pretokenize
    bad = _copy(folder, tmp_path)
    for dtype in ("<f2", "<i2", "<f4"):  # the ids would be reinterpreted
        (bad / "index.json").write_text(json.dumps({**index, "dtype": dtype}))
        with pytest.raises(ValueError, match=f"index.json: dtype '{dtype}' is not a token-id type"):
            open_shards(bad)
    (bad / "index.json").write_text(json.dumps({**index, "max_id": TOK.vocab_size}))
    with pytest.raises(ValueError, match=f"its shards hold token id {TOK.vocab_size}, beyond the vocabulary of {TOK.vocab_size}"):
        open_shards(bad)
    (bad / "index.json").write_text(json.dumps({**index, "tokenizer": {**index["tokenizer"], "vocab_size": 4096}}))
    with pytest.raises(ValueError, match="index says vocabulary 4096, tokenizer 'tessera-default' has 2048"):
        build_dataloader(open_shards(bad), TOK, 15, 2)
    # a damaged tokens file (ids beyond the vocabulary) is named when read, not deep in the model
    (bad / "index.json").write_text(json.dumps(index))
    tokens = np.fromfile(bad / "shard-00000.tokens", dtype=index["dtype"])
    tokens[5] = np.iinfo(tokens.dtype).max
    tokens.tofile(bad / "shard-00000.tokens")
    with pytest.raises(ValueError, match=r"shard-00000.tokens: token id 65535 at token 5 is beyond the vocabulary of 2048"):
        next(build_dataloader(open_shards(bad), TOK, 15, 2, shuffle=False))


def test_a_folder_without_documents_is_named(corpus, tmp_path):
    _, folder = corpus
    empty = _copy(folder, tmp_path)
    index = json.loads((folder / "index.json").read_text())
    for name in [shard["name"] for shard in index["shards"]]:
        np.zeros(1, dtype="<i8").tofile(empty / f"{name}.offsets")
        (empty / f"{name}.tokens").write_bytes(b"")
    shards = [{**shard, "documents": 0, "tokens": 0} for shard in index["shards"]]
    (empty / "index.json").write_text(json.dumps({**index, "shards": shards, "documents": 0, "tokens": 0}))
    with pytest.raises(ValueError, match=f"^dataset {empty} has no documents$"):
        build_dataloader(open_shards(empty), TOK, 15, 2)


@pytest.mark.parametrize("entries, message", [
    (["a=0.5", "b="], r"entry 'b=': weight '' must be a positive number"),
    (["a=0"], r"entry 'a=0': weight '0' must be a positive number"),
    (["a"], r"entry 'a': expected 'path=weight'"),
    (["=1"], r"entry '=1': expected 'path=weight'"),
])
def test_bad_mixture_entries(entries, message):
    with pytest.raises(ValueError, match=message):
        parse_mixture(entries)


def test_mixture_weights_too_large_to_sum_still_mix_evenly():
    m = Mixture([1e308, 1e308], seed=0)  # their sum overflows to inf
    assert np.array_equal(m.weights, [0.5, 0.5]) and np.array_equal(m.counts(4096), [2048, 2048])


def test_parse_mixture_and_weight_count():
    assert parse_mixture(["data/a=b=0.7", " c =0.3"]) == [("data/a=b", 0.7), ("c", 0.3)]
    with pytest.raises(ValueError, match="one weight per dataset: 2 datasets, 1 weights"):
        build_dataloader([["x"], ["y"]], TOK, 4, 1, weights=[1.0])


def test_restored_loader_keeps_the_saved_seed(corpus):
    text, folder = corpus
    for data in (load_dataset(folder), load_dataset(text)):
        first = build_dataloader(data, TOK, 15, 2, shuffle=True, seed=4, shuffle_buffer=7)
        windows_of(first, 3)
        state = first.state_dict()
        assert state["seed"] == 4
        other_seed = build_dataloader(data, TOK, 15, 2, shuffle=True, seed=9, shuffle_buffer=7)
        other_seed.load_state_dict(state)
        assert equal(windows_of(other_seed, 40), windows_of(first, 40))  # runs on into later epochs
    assert "seed" not in build_dataloader(load_dataset(text), TOK, 15, 2).state_dict()  # file order: no seed
    with pytest.raises(ValueError, match="seed must be a non-negative int, got -1"):
        build_dataloader(load_dataset(text), TOK, 15, 2, seed=-1)
