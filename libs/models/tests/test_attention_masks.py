"""Every mask x kernel x dtype against a dense float64 reference written from the definitions:
causal, documents (block-causal), sliding window, chunked local attention, their combinations,
with and without attention sinks; the blocked CPU kernel forward and backward, FlexAttention's
forward (the CUDA path's masks, run here on CPU), SDPA for plain causal."""

import warnings

import pytest
import torch

from tessera.models.attention import AttentionBatch, InnerAttention, attention_batch, choose_kernel
from tessera.models.blocked_attention import blocked_attention, query_blocks
from tessera.models.masks import AttentionMask

B, H, KV, S, D = 2, 4, 2, 48, 8
MASKS = {
    "causal": (AttentionMask(), False),
    "document": (AttentionMask(), True),
    "window": (AttentionMask(window=7), False),
    "window+document": (AttentionMask(window=7), True),
    "chunk": (AttentionMask(chunk=16), False),
    "chunk+document": (AttentionMask(chunk=16), True),
    "window+chunk": (AttentionMask(window=5, chunk=16), False),
}


def _documents() -> torch.Tensor:
    """Two rows of packed documents: lengths 5, 20, 23 and 30, 18 (ids that count documents)."""
    rows = [[0] * 5 + [1] * 20 + [2] * 23, [3] * 30 + [4] * 18]
    return torch.tensor(rows)


def dense_reference(q, k, v, mask: AttentionMask, documents, sinks):
    """softmax over visible keys (and the sink logit) in float64, from the definitions."""
    q, k, v = q.double(), k.double(), v.double()
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    i = torch.arange(S)[:, None]
    j = torch.arange(S)[None, :]
    visible = j <= i
    if mask.window is not None:
        visible = visible & (i - j < mask.window)
    if mask.chunk is not None:
        visible = visible & (i // mask.chunk == j // mask.chunk)
    visible = visible.expand(B, S, S)
    if documents is not None:
        visible = visible & (documents[:, :, None] == documents[:, None, :])
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if sinks is not None:
        sink_column = sinks.double().view(1, -1, 1, 1).expand(B, -1, S, 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    p = torch.softmax(scores, dim=-1)[..., :S]
    return p @ v


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=g).to(dtype).requires_grad_() for h in (H, KV, KV))
    return q, k, v


def _grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out.shape, generator=g, dtype=torch.float64)
    return torch.autograd.grad((out.double() * weight).sum(), inputs)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("name", [*MASKS, "document (unordered ids)"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_kernel_forward_and_backward(name, sinks, dtype, fused, monkeypatch):
    """fused: blocks through torch's CPU flash kernel; else the plain-ops path other devices take."""
    monkeypatch.setattr("tessera.models.blocked_attention.BLOCK_ELEMENTS", 1)  # 16-row blocks: many of them
    if not fused:
        monkeypatch.setattr("tessera.models.blocked_attention.FUSED_DEVICES", ())
    unordered = name == "document (unordered ids)"  # ids that do not count documents: no skipping, still exact
    mask, with_documents = MASKS["document" if unordered else name]
    documents = (_documents() % 2 if unordered else _documents()) if with_documents else None
    inner = InnerAttention(mask, sinks=H if sinks else None)
    inner.kernel = "blocked"
    if sinks:
        with torch.no_grad():
            inner.sinks.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    q, k, v = _inputs(dtype)
    out = inner(q, k, v, AttentionBatch(documents))
    leaves = (q, k, v, *([inner.sinks] if sinks else []))
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref = dense_reference(*ref_leaves[:3], mask, documents, ref_leaves[3] if sinks else None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for got, want in zip(_grads(out, leaves), _grads(ref, ref_leaves)):
        torch.testing.assert_close(got.double(), want, atol=tol * 5 if dtype != torch.float32 else tol, rtol=tol)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("name", list(MASKS))
def test_flex_kernel_forward_with_the_same_mask_functions(name, sinks):
    """The CUDA path's block masks and sinks, through FlexAttention's CPU forward."""
    mask, with_documents = MASKS[name]
    documents = _documents() if with_documents else None
    inner = InnerAttention(mask, sinks=H if sinks else None)
    inner.kernel = "flex"
    if sinks:
        with torch.no_grad():
            inner.sinks.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    q, k, v = (x.detach() for x in _inputs(torch.float32))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not fused
        batch = attention_batch(torch.nn.ModuleList([inner]), documents, S, "cpu")
        out = inner(q, k, v, batch)
    ref = dense_reference(q, k, v, mask, documents, inner.sinks.detach() if sinks else None)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_flex_kernel_without_a_prepared_batch_builds_its_block_mask():
    """A caller that builds no AttentionBatch (a library's own model) still gets the flex kernel."""
    inner = InnerAttention(AttentionMask(window=7))
    inner.kernel = "flex"
    q, k, v = (x.detach() for x in _inputs(torch.float32))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = inner(q, k, v)
    torch.testing.assert_close(out.double(), dense_reference(q, k, v, AttentionMask(window=7), None, None), atol=1e-5, rtol=1e-5)


def test_unknown_kernel_is_named():
    inner = InnerAttention()
    inner.kernel = "flash3"
    q, k, v = _inputs(torch.float32)
    with pytest.raises(ValueError, match="attention kernel 'flash3' is not one of"):
        inner(q, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_kernel_plain_causal(dtype):
    q, k, v = _inputs(dtype)
    inner = InnerAttention()
    assert inner.kernel_for("cpu", documents=False) == "sdpa"
    out = inner(q, k, v)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = dense_reference(*ref_leaves, AttentionMask(), None, None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for got, want in zip(_grads(out, (q, k, v)), _grads(ref, ref_leaves)):
        torch.testing.assert_close(got.double(), want, atol=tol * 5 if dtype != torch.float32 else tol, rtol=tol)


def test_kernel_choice():
    window = AttentionMask(window=128)
    assert choose_kernel("cuda", AttentionMask(), documents=False, sinks=False) == "sdpa"
    assert choose_kernel("cuda", AttentionMask(), documents=True, sinks=False) == "flex"
    assert choose_kernel("cuda", window, documents=False, sinks=False) == "flex"
    assert choose_kernel("cuda", AttentionMask(), documents=False, sinks=True) == "flex"
    assert choose_kernel("cpu", window, documents=False, sinks=False) == "blocked"
    assert choose_kernel("cpu", AttentionMask(), documents=True, sinks=False) == "blocked"


def test_sdpa_refuses_what_it_cannot_mask():
    inner = InnerAttention(AttentionMask(window=4))
    inner.kernel = "sdpa"
    q, k, v = _inputs(torch.float32)
    with pytest.raises(ValueError, match="sdpa kernel takes plain causal"):
        inner(q, k, v)


def test_blocks_reach_only_the_keys_the_mask_allows():
    """The blocked kernel's work is bounded by the window, not the sequence."""
    blocks = query_blocks(AttentionMask(window=32), ((0, 4096),), rows=64)
    assert max(hi - lo for _, _, _, lo, hi in blocks) == 64 + 31
    chunked = query_blocks(AttentionMask(chunk=256), ((0, 1024),), rows=64)
    assert all(lo == q_start // 256 * 256 for _, _, q_start, lo, _ in chunked)
    # runs (a context-parallel rank's head and tail shards) never share a block
    runs = query_blocks(AttentionMask(), ((0, 10), (30, 10)), rows=16)
    assert [(r0, r1, q) for r0, r1, q, _, _ in runs] == [(0, 10, 0), (10, 20, 30)]


def test_document_starts_bound_the_keys_a_block_reads(monkeypatch):
    """With ids that count documents, a block reads no key before its first query's document."""
    from tessera.models import blocked_attention as kernel

    seen = []
    real = kernel._forward_block
    monkeypatch.setattr(kernel, "_forward_block", lambda q, k, v, bias, scale: seen.append(k.shape[2]) or real(q, k, v, bias, scale))
    monkeypatch.setattr(kernel, "BLOCK_ELEMENTS", 1)
    q, k, v = (x.detach() for x in _inputs(torch.float32))
    documents = torch.arange(S).div(16, rounding_mode="floor").expand(B, S)  # documents of 16 tokens, as the blocks
    blocked_attention(q, k, v, AttentionMask(), documents=documents)
    assert seen == [16, 16, 16]


def test_query_runs_and_keys_beyond_the_queries():
    """Queries given as index runs over a longer key sequence (context parallel's view)."""
    mask = AttentionMask(window=9)
    documents = _documents()
    q, k, v = (x.detach() for x in _inputs(torch.float32))
    rows = torch.cat([torch.arange(0, 12), torch.arange(36, 48)])
    out = blocked_attention(q[:, :, rows], k, v, mask, documents=documents, q_runs=((0, 12), (36, 12)))
    ref = dense_reference(q, k, v, mask, documents, None)[:, :, rows]
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_value_heads_narrower_than_query_heads():
    """MLA's shape (DeepSeek-V3): v has its own head size; the blocked kernel takes it."""
    mask, documents = AttentionMask(window=9), _documents()
    q, k, _ = _inputs(torch.float32)
    v = torch.randn(B, KV, S, D // 2, generator=torch.Generator().manual_seed(3), requires_grad=True)
    out = blocked_attention(q, k, v, mask, documents=documents)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = dense_reference(*leaves, mask, documents, None)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(_grads(out, (q, k, v)), _grads(ref, leaves)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_sinks_are_a_stable_parameter():
    model = torch.nn.Module()
    model.inner_attention = InnerAttention(AttentionMask(window=128), sinks=8)
    assert list(model.state_dict()) == ["inner_attention.sinks"]
    assert model.inner_attention.sinks.shape == (8,)
    assert list(torch.nn.Module().state_dict()) == []
    assert list(InnerAttention().state_dict()) == []


def test_mask_values_are_checked():
    with pytest.raises(ValueError, match="window 0"):
        AttentionMask(window=0)
    with pytest.raises(ValueError, match="chunk"):
        AttentionMask(chunk=2.5)


def test_compiled_block_with_the_blocked_kernel_matches_eager():
    """torch.compile(fullgraph) of a block on the blocked kernel: documents, a window and sinks
    trace (the blocks follow the shapes), outputs and gradients as eager."""
    import dataclasses

    from tessera.models.llama import Transformer, llama3_flavors
    from tessera.models import apply_compile

    args = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=1, dim=64, n_heads=4, vocab_size=128, max_seq_len=64)
    torch.manual_seed(0)
    models = [Transformer(args) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    for model in models:
        model.layers["0"].attention.inner_attention = InnerAttention(AttentionMask(window=9), sinks=args.n_heads)
        torch.nn.init.normal_(model.layers["0"].attention.inner_attention.sinks, generator=torch.Generator().manual_seed(2))
    apply_compile(models[0])
    tokens = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    documents = torch.cumsum((tokens % 13 == 0).long(), dim=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # inductor's note on complex RoPE
        compiled, eager = (model(tokens, document_ids=documents) for model in models)
        compiled.sum().backward()
    eager.sum().backward()
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    for (name, got), want in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-4, msg=name)
