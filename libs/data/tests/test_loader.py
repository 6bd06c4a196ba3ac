import itertools
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from tessera.data import Peers, build_dataloader, distributed_peers, load_dataset, load_tokenizer

BOS, EOS = 1000, 1001


class CharTokenizer:
    """One token per character, so expected streams can be written by hand."""

    bos_id, eos_id = BOS, EOS

    def encode(self, text, bos, eos):
        return [BOS] * bos + [ord(c) for c in text] + [EOS] * eos


DOCS = ["ab", "cde", "f", "ghijklmnopq", "rs"]  # 2 + 3 + 1 + 11 + 2 chars -> 29 stream tokens
EPOCH = [t for doc in DOCS for t in CharTokenizer().encode(doc, bos=True, eos=True)]


def loader(seq_len=3, batch=1, rank=0, world=1, infinite=True, docs=DOCS):
    return build_dataloader(docs, CharTokenizer(), seq_len, batch, rank, world, infinite)


def windows(seq_len, count):
    """The first `count` windows of the endless stream, cut by hand."""
    stream = list(itertools.islice(itertools.cycle(EPOCH), count * (seq_len + 1)))
    return [stream[i * (seq_len + 1) : (i + 1) * (seq_len + 1)] for i in range(count)]


def test_packing_boundaries():
    inputs, labels = next(loader(seq_len=3, batch=3))
    assert inputs.dtype == labels.dtype == torch.long
    assert inputs.shape == labels.shape == (3, 3)
    o = ord
    expected = [[BOS, o("a"), o("b"), EOS], [BOS, o("c"), o("d"), o("e")], [EOS, BOS, o("f"), EOS]]
    assert inputs.tolist() == [w[:-1] for w in expected]
    assert labels.tolist() == [w[1:] for w in expected]


def test_stream_runs_on_across_epochs():
    got = [torch.cat([x, y[:, -1:]], dim=1).tolist()[0] for x, y in itertools.islice(loader(5), 20)]
    assert got == windows(5, 20)  # 20 * 6 tokens = 4+ epochs of 29 tokens


def test_finite_drops_partial_window_and_batch():
    # 29 tokens = 7 windows of 4 (+1 token dropped); batch 2 -> 3 batches (window 7 dropped).
    batches = list(loader(seq_len=3, batch=2, infinite=False))
    assert len(batches) == 3
    rows = [row for x, y in batches for row in torch.cat([x, y[:, -1:]], 1).tolist()]
    assert rows == windows(3, 6)
    # Every rank stops at the same step even though rank 0 could fill one more window.
    assert [len(list(loader(3, 1, r, 4, infinite=False))) for r in range(4)] == [1, 1, 1, 1]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dp_sharding_matches_global_batch(world):
    b, steps = 2, 6
    global_batches = list(itertools.islice(loader(seq_len=4, batch=b * world), steps))
    ranks = [list(itertools.islice(loader(4, b, r, world), steps)) for r in range(world)]
    for k in range(steps):
        for r in range(world):
            # Rank r's k-th batch holds global windows (k*b + j)*W + r: rows r::W of global batch k.
            assert torch.equal(ranks[r][k][0], global_batches[k][0][r::world])
            assert torch.equal(ranks[r][k][1], global_batches[k][1][r::world])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dp_sharding_uses_every_window_once(world):
    seen = {}
    for r in range(world):
        for k, (x, y) in enumerate(loader(seq_len=2, batch=1, rank=r, world=world, infinite=False)):
            seen[k * world + r] = torch.cat([x, y[:, -1:]], 1).tolist()[0]
    n = len(EPOCH) // 3 // world * world  # whole global batches of 3-token windows
    assert sorted(seen) == list(range(n))
    assert [seen[i] for i in range(n)] == windows(2, n)


def _take(it, n):
    return [tuple(t.clone() for t in batch) for batch in itertools.islice(it, n)]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_resume_yields_next_batches(world, k):
    for r in range(world):
        first = loader(seq_len=4, batch=2, rank=r, world=world)
        _take(first, k)
        state = pickle.loads(pickle.dumps(first.state_dict()))
        expected = _take(first, 6)
        resumed = loader(seq_len=4, batch=2, rank=r, world=world)
        resumed.load_state_dict(state)
        got = _take(resumed, 6)
        assert all(torch.equal(a, b) for e, g in zip(expected, got) for a, b in zip(e, g))
        assert resumed.state_dict() == first.state_dict()


def test_resume_mid_document_and_across_epoch():
    first = loader(seq_len=4, batch=1)
    _take(first, 3)  # 15 tokens: inside "ghijklmnopq", whose tokens start at 12
    mid = first.state_dict()
    assert (mid["epoch"], mid["doc_index"], mid["token_offset"]) == (0, 3, 3)
    _take(first, 3)  # 30 tokens: one epoch (29) + 1
    after_epoch = first.state_dict()
    assert (after_epoch["epoch"], after_epoch["doc_index"]) == (1, 0)
    assert after_epoch["token_offset"] == 1
    for state, batches_before in ((mid, 3), (after_epoch, 6)):
        reference = loader(seq_len=4, batch=1)
        _take(reference, batches_before)
        resumed = loader(seq_len=4, batch=1)
        resumed.load_state_dict(state)
        expected, got = _take(reference, 8), _take(resumed, 8)  # crosses the next epoch too
        assert all(torch.equal(a, b) for e, g in zip(expected, got) for a, b in zip(e, g))


def test_state_is_small_and_rank_independent():
    states = []
    for r in range(2):
        it = loader(seq_len=4, batch=2, rank=r, world=2)
        _take(it, 3)
        states.append(it.state_dict())
    assert states[0] == states[1]
    assert all(type(v) is int for v in states[0].values())
    assert states[0]["window_index"] == 3 * 2 * 2


def test_bad_state():
    it = loader()
    good = it.state_dict()
    with pytest.raises(ValueError, match=r"non-negative ints for \['epoch'\]"):
        it.load_state_dict({**good, "epoch": -1})
    with pytest.raises(ValueError, match=r"non-negative ints for \['token_offset'\]"):
        it.load_state_dict({k: v for k, v in good.items() if k != "token_offset"})
    with pytest.raises(ValueError, match="dataset of 4 documents, this one has 5"):
        it.load_state_dict({**good, "num_documents": 4})
    with pytest.raises(ValueError, match="doc_index 6 is past the dataset end"):
        it.load_state_dict({**good, "doc_index": 6})
    with pytest.raises(ValueError, match="token_offset 4 is past the end of document 0"):
        it.load_state_dict({**good, "token_offset": 4})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seq_len=0), "seq_len must be a positive int, got 0"),
        (dict(batch=2.0), "local_batch_size must be a positive int, got 2.0"),
        (dict(world=0), "dp_world_size must be a positive int"),
        (dict(rank=2, world=2), r"dp_rank must be in \[0, 2\), got 2"),
        (dict(docs=[]), "dataset 0 has no documents"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        loader(**kwargs)


def test_default_tokenizer_and_corpus():
    tok = load_tokenizer()
    it = build_dataloader(load_dataset(), tok, seq_len=64, local_batch_size=4)
    inputs, labels = next(it)
    assert inputs.shape == (4, 64)
    assert inputs[0, 0].item() == tok.bos_id
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert 0 <= int(inputs.min()) and int(inputs.max()) < tok.vocab_size


# Peers: processes sharing the encoding of one stream, simulated here by threads.


class CountingTokenizer(CharTokenizer):
    """Records the index of every document it encodes."""

    def __init__(self):
        self.encoded = []

    def encode(self, text, bos, eos):
        self.encoded.append(DOCS.index(text))
        return super().encode(text, bos, eos)


def run_peers(size, fn):
    """fn(peers) on `size` threads whose all_gather meets at a barrier; results in rank order."""
    barrier = threading.Barrier(size, timeout=30)
    slots = [None] * size

    def peer(rank):
        def all_gather(obj):
            slots[rank] = obj
            barrier.wait()
            gathered = list(slots)
            barrier.wait()  # nobody overwrites a slot before everyone has read them all
            return gathered

        try:
            return fn(Peers(rank, size, all_gather))
        except BaseException:
            barrier.abort()  # release the other peers at once instead of at the timeout
            raise

    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(peer, range(size)))


# (peers, dp world size): dp rank = peer rank // (peers // dp), so with (4, 2) the
# tensor-parallel pairs (0, 1) and (2, 3) share dp ranks 0 and 1 and read the same batches.
LAYOUTS = [(1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (4, 2)]


def peer_loader(peers, dp, tokenizer=None, block=None, seq_len=4, batch=2, infinite=True):
    dp_rank = peers.rank // (peers.size // dp)
    tokenizer = tokenizer or CharTokenizer()
    return build_dataloader(DOCS, tokenizer, seq_len, batch, dp_rank, dp, infinite, peers, block)


def _equal(expected, got):
    return len(expected) == len(got) and all(
        torch.equal(a, b) for e, g in zip(expected, got) for a, b in zip(e, g)
    )


@pytest.mark.parametrize("size, dp", LAYOUTS)
@pytest.mark.parametrize("block", [None, 1, 2, 3])
def test_peers_yield_the_single_process_batches(size, dp, block):
    got = run_peers(size, lambda peers: _take(peer_loader(peers, dp, block=block), 12))
    for rank, batches in enumerate(got):  # 12 steps of 2 * dp windows of 5: epochs run on
        assert _equal(_take(loader(4, 2, rank // (size // dp), dp), 12), batches)


@pytest.mark.parametrize("size, dp", LAYOUTS)
@pytest.mark.parametrize("block", [2, 3])
def test_peers_encode_each_document_once_per_epoch(size, dp, block):
    epochs = 3 * dp  # windows of 29 tokens = one epoch each; 3 steps of dp windows

    def encoded(peers):
        tokenizer = CountingTokenizer()
        _take(peer_loader(peers, dp, tokenizer, block, seq_len=28, batch=1), 3)
        return tokenizer.encoded

    for rank, docs in enumerate(run_peers(size, encoded)):
        assert docs == [j for _ in range(epochs) for j in range(len(DOCS)) if j % size == rank]


@pytest.mark.parametrize("size, dp", LAYOUTS)
def test_peers_finite_stop_together_after_one_encoding(size, dp):
    def run(peers):
        tokenizer = CountingTokenizer()
        return list(peer_loader(peers, dp, tokenizer, seq_len=2, infinite=False)), tokenizer.encoded

    results = run_peers(size, run)
    for rank, (batches, docs) in enumerate(results):
        assert _equal(list(loader(2, 2, rank // (size // dp), dp, infinite=False)), batches)
        assert docs == [j for j in range(len(DOCS)) if j % size == rank]
    assert len({len(batches) for batches, _ in results}) == 1


@pytest.mark.parametrize("size, dp", LAYOUTS)
@pytest.mark.parametrize("k", [1, 2])
def test_peers_resume_mid_block(size, dp, k):
    def run(peers):
        first = peer_loader(peers, dp, block=2)
        _take(first, k)
        state = pickle.loads(pickle.dumps(first.state_dict()))
        # Peer 0 restores into its used loader (block cached), the others into new ones: all
        # must still exchange at the same points.
        resumed = first if peers.rank == 0 else peer_loader(peers, dp, block=2)
        resumed.load_state_dict(state)
        return state, _take(resumed, 6)

    for rank, (state, got) in enumerate(run_peers(size, run)):
        assert (state["doc_index"] % 2, state["token_offset"]) != (0, 0)  # inside a block
        assert _equal(_take(loader(4, 2, rank // (size // dp), dp), k + 6)[k:], got)


def test_distributed_peers_single_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        peers = distributed_peers()
        assert (peers.rank, peers.size, peers.all_gather({"a": 1})) == (0, 1, [{"a": 1}])
        got = _take(build_dataloader(DOCS, CharTokenizer(), 4, 2, peers=peers), 5)
        assert _equal(_take(loader(4, 2), 5), got)
    finally:
        dist.destroy_process_group()


def test_bad_peers_and_block():
    with pytest.raises(ValueError, match=r"peers rank must be in \[0, 2\), got 2"):
        Peers(2, 2, list)
    with pytest.raises(ValueError, match="peers size must be a positive int, got 0"):
        Peers(0, 0, list)
    with pytest.raises(ValueError, match="block_documents must be a positive int, got 0"):
        build_dataloader(DOCS, CharTokenizer(), 4, 2, block_documents=0)
    with pytest.raises(ValueError, match="distributed_peers needs an initialised"):
        distributed_peers()


def test_text_epochs_are_shuffled_each_in_its_own_order():
    """A text dataset's shuffled document order: a permutation per epoch, each epoch's its own,
    seeded (the same on every rank and after a restart)."""
    from tessera.data.text_stream import epoch_order

    orders = [epoch_order(3, epoch, 20).tolist() for epoch in range(3)]
    assert all(sorted(order) == list(range(20)) for order in orders)
    assert len({tuple(order) for order in orders}) == 3
    assert epoch_order(3, 1, 20).tolist() == orders[1] and epoch_order(4, 1, 20).tolist() != orders[1]
