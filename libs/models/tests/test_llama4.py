"""Llama 4's layers against reference code written here from the published formulas: chunked
attention with RoPE and the L2 q/k norm, NoPE attention with temperature tuning, top-1 sigmoid
routing whose score scales the expert's input plus the shared expert; the flavors' layer layout,
released sizes and FLOPs with chunking counted."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from tessera.models import get_model_spec
from tessera.models.llama.rope import rope_frequencies
from tessera.models.llama4 import Llama4, active_params
from tessera.models.masks import AttentionMask
from tessera.models.moe import MoE

SPEC = get_model_spec("llama4")
ARGS = dataclasses.replace(SPEC.flavors["tiny"], dim=32, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=48,
                           moe=dataclasses.replace(SPEC.flavors["tiny"].moe, n_experts=4, hidden_dim=16),
                           attention_chunk_size=4, floor_scale=4, attn_scale=0.5, max_seq_len=64)


def _rotate(x, positions, freqs):
    """Meta's complex form: pairs (2i, 2i+1) times exp(i * pos * freq_i)."""
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    angles = positions.double()[:, None] * freqs.double()[None]
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)[:, None]).flatten(-2)


def _reference_attention(attention, x, positions, freqs, *, rope, qk_norm, temperature, chunk, eps=1e-5):
    """softmax(q k^T / sqrt(d) + mask) v over GQA heads, in float64, from the formulas."""
    w = {name: getattr(attention, name).weight.double() for name in ("wq", "wk", "wv", "wo")}
    x = x.double()[0]
    seq, d = x.shape[0], ARGS.head_dim
    q, k, v = ((x @ w[n].T).unflatten(-1, (-1, d)) for n in ("wq", "wk", "wv"))
    if rope:
        q, k = _rotate(q, positions, freqs), _rotate(k, positions, freqs)
    if qk_norm:
        q = q / (q.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        k = k / (k.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    if temperature:
        floor = torch.floor((positions.double() + 1) / ARGS.floor_scale)
        q = q * (1 + ARGS.attn_scale * torch.log(1 + floor))[:, None, None]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None]
    visible = (j <= i) & ((j // chunk == i // chunk) if chunk else True)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    out = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    return (out.flatten(-2) @ w["wo"].T)[None]


@pytest.mark.parametrize("layer, rope, chunk", [(0, True, 4), (3, False, None)],
                         ids=["chunked_rope", "nope_temperature"])
def test_attention_matches_the_formulas(layer, rope, chunk):
    torch.manual_seed(0)
    model = Llama4(ARGS)
    attention = model.layers[str(layer)].attention
    assert attention.inner_attention.mask == AttentionMask(chunk=chunk)
    positions = torch.arange(5, 15)  # a later part of a sequence: the temperature floor is passed
    x = torch.randn(1, len(positions), ARGS.dim)
    freqs = rope_frequencies(ARGS.head_dim, ARGS.rope_theta, ARGS.rope_scaling)
    got = attention(x, rope=model.rope[positions])
    want = _reference_attention(attention, x, positions, freqs, rope=rope, qk_norm=rope, temperature=not rope,
                                chunk=chunk)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_top1_sigmoid_routing_scales_the_expert_input_and_adds_the_shared_expert():
    torch.manual_seed(0)
    moe = MoE(ARGS.dim, ARGS.moe)
    moe.init_weights(0.02)
    x = torch.randn(2, 6, ARGS.dim)
    e = moe.experts

    def swiglu(h, w1, w2, w3):
        return (F.silu(h @ w1.T) * (h @ w3.T)) @ w2.T

    want = []
    for token in x.reshape(-1, ARGS.dim):
        logits = moe.router.gate.weight @ token
        expert = int(logits.argmax())
        score = torch.sigmoid(logits[expert])
        shared = moe.shared_experts
        want.append(swiglu(token, shared.w1.weight, shared.w2.weight, shared.w3.weight)
                    + swiglu(score * token, e.w1[expert], e.w2[expert], e.w3[expert]))
    torch.testing.assert_close(moe(x), torch.stack(want).view_as(x), rtol=1e-5, atol=1e-6)


def test_flavor_layers_and_released_sizes():
    debug = SPEC.flavors["tiny"]
    assert debug.nope_layers == (3,) and debug.chunked_layers == (0, 1, 2, 4, 5)
    assert debug.moe_layers == (1, 3, 5) and debug.vocab_size == 2048
    assert debug.moe.n_experts % 4 == 0 and debug.moe.top_k == 1
    scout, maverick = SPEC.flavors["17bx16e_irope"], SPEC.flavors["17bx128e_irope"]
    assert len(scout.moe_layers) == 48 and maverick.moe_layers == tuple(range(1, 48, 2))
    assert scout.nope_layers == maverick.nope_layers == tuple(range(3, 48, 4))
    assert scout.use_qk_norm and not maverick.use_qk_norm and maverick.rope_scaling is None
    cut = dataclasses.replace(maverick, n_layers=5)  # a model cut to its first layers keeps their pattern
    assert (cut.moe_layers, cut.nope_layers, cut.chunked_layers) == ((1, 3), (3,), (0, 1, 2, 4))
    # "17B" active parameters each, the token embedding included
    for args in (scout, maverick):
        assert 17.0e9 < active_params(args) + args.vocab_size * args.dim < 17.5e9
    # torchtitan's names without "_irope": RoPE and global attention on every layer, the same tensors
    for name in ("debugmodel", "17bx16e", "17bx128e"):
        plain = SPEC.flavors[name]
        assert plain.nope_layers == plain.chunked_layers == () and not plain.use_qk_norm, name
        irope = SPEC.flavors[f"{name}_irope"]
        assert dataclasses.replace(irope, nope_layers=(), chunked_layers=(), use_qk_norm=False,
                                   attention_chunk_size=None, floor_scale=plain.floor_scale) == plain, name


def test_flops_count_a_chunked_layer_s_keys_up_to_the_chunk():
    args = SPEC.flavors["17bx16e_irope"]
    per_key = 12 * args.n_heads * args.head_dim
    long, short = 4 * args.attention_chunk_size, args.attention_chunk_size
    extra_keys = len(args.nope_layers) * (long - short)  # the chunked layers see no more than a chunk
    assert SPEC.flops_per_token(args, long) - SPEC.flops_per_token(args, short) == per_key * extra_keys
    assert SPEC.attention_kinds(args) == ((AttentionMask(chunk=8192), False), (AttentionMask(), False))
