"""GPT-OSS layer by layer against reference code written here from the published formulas
(attention sinks, the clamped SwiGLU with interleaved gate/up, the biased top-k router, YaRN with
fractional ramp ends, MXFP4), its FLOPs, and its config.json reader."""

import dataclasses
import math

import pytest
import torch

from tessera.models import ARGS_FILE, AttentionMask, InnerAttention, args_record, get_model_spec, read_args_record
from tessera.models.gpt_oss import GptOss, GptOssExperts, active_params, dequantize_mxfp4, gpt_oss_flavors
from tessera.models.gpt_oss import hf_config
from tessera.models.moe import MoEArgs, TopKRouter
from tessera.models.rotary import YarnScaling, inverse_frequencies, yarn_frequencies

LIMIT, ALPHA = 7.0, 1.702


@pytest.mark.parametrize("mask", [AttentionMask(window=3), AttentionMask()], ids=["window3", "causal"])
def test_sinks_join_every_softmax_denominator(mask):
    torch.manual_seed(0)
    heads, kv_heads, seq, dim = 4, 2, 9, 8
    q, k, v = torch.randn(2, heads, seq, dim), torch.randn(2, kv_heads, seq, dim), torch.randn(2, kv_heads, seq, dim)
    inner = InnerAttention(mask, sinks=heads)
    with torch.no_grad():
        inner.sinks.copy_(torch.randn(heads) * 2)
    got = inner(q, k, v).detach()
    # softmax over [scores of the visible keys, sink]; the sink's share multiplies no value
    want = torch.zeros_like(got)
    for b in range(2):
        for h in range(heads):
            for i in range(seq):
                keys = [j for j in range(i + 1) if mask.window is None or i - j < mask.window]
                scores = [float(q[b, h, i] @ k[b, h // 2, j]) / math.sqrt(dim) for j in keys]
                logits = scores + [float(inner.sinks[h].detach())]
                weights = torch.tensor(logits).softmax(0)[:-1]
                want[b, h, i] = sum(w * v[b, h // 2, j] for w, j in zip(weights, keys))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """Column 2i is gate i, column 2i+1 up i: (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7)."""
    out = torch.empty(*h.shape[:-1], h.shape[-1] // 2)
    for i in range(h.shape[-1] // 2):
        gate, up = h[..., 2 * i].clamp(max=LIMIT), h[..., 2 * i + 1].clamp(min=-LIMIT, max=LIMIT)
        out[..., i] = (up + 1) * gate * torch.sigmoid(ALPHA * gate)
    return out


def test_experts_clamped_swiglu_with_interleaved_gate_up_and_biases():
    torch.manual_seed(0)
    n_experts, dim, hidden = 3, 4, 5
    experts = GptOssExperts(dim, hidden, n_experts, LIMIT, ALPHA)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) * 3)  # pre-activations well beyond the clamp
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(5, dim)
    got = experts(x, counts)
    expert_of_row = [0, 0, 2, 2, 2]
    for row, e in enumerate(expert_of_row):
        h = x[row] @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
        assert (h.abs() > LIMIT).any()
        want = _swiglu_reference(h[None])[0] @ experts.down_proj[e] + experts.down_proj_bias[e]
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)


def experts_loop(x, counts, gate_up, gate_up_bias, down, down_bias, activation):
    """The reference: one expert at a time over its rows."""
    return torch.cat([activation(rows @ gate_up[e] + gate_up_bias[e]) @ down[e] + down_bias[e]
                      for e, rows in enumerate(x.split(counts.tolist()))])


# bfloat16: the grouped matmuls sum each expert's bias gradient in another order than the loop
# (measured: up to one bf16 ulp, 3.8e-3 of the largest entry); float32 to rounding (1.6e-7)
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-6)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", ["counts", "equal_groups"])
def test_grouped_experts_equal_the_loop_forward_and_backward(dtype, tol, layout):
    """The module's grouped (rows with counts) and batched (equal groups, counts None) matmuls
    against the per-expert loop in the same dtype, TP's bias share included; expert 1 gets no
    rows (equal groups: only zero rows whose output nobody reads) and so no gradient."""
    torch.manual_seed(0)
    experts = GptOssExperts(16, 16, 4, LIMIT, ALPHA)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p))  # pre-activations beyond the clamp
    experts = experts.to(dtype)
    experts.hidden_dim = 32  # a TP rank holding half of each expert's hidden features adds half the down bias
    counts, grad = torch.tensor([3, 0, 5, 2]), torch.randn(10, 16, dtype=dtype)
    # equal groups of 5 rows: each expert's rows, then zero rows the output leaves out
    rows = torch.tensor([0, 1, 2, 10, 10, *[10] * 5, 3, 4, 5, 6, 7, 8, 9, 10, 10, 10])
    runs = []
    for grouped in (True, False):
        x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
        weights = (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias / 2)
        if not grouped:
            out = experts_loop(x, counts, *weights, experts.activation)
        elif layout == "counts":
            out = experts(x, counts)
        else:
            padded = torch.cat([x, x.new_zeros(1, 16)])[rows]
            out = experts(padded, None)[[i for i, r in enumerate(rows.tolist()) if r < 10]]
        experts.zero_grad()
        out.backward(grad)
        runs.append([out, x.grad, *(p.grad.clone() for p in experts.parameters())])
    for got, want in zip(*runs):
        torch.testing.assert_close(got, want, rtol=0, atol=tol * want.abs().max().item())
    assert all(p.grad[1].count_nonzero() == 0 for p in experts.parameters())


def test_router_takes_top_k_of_biased_logits_and_softmaxes_the_chosen():
    torch.manual_seed(0)
    args = gpt_oss_flavors["tiny"].moe
    router = TopKRouter(16, dataclasses.replace(args, n_experts=6, top_k=3))
    with torch.no_grad():
        router.gate.bias.copy_(torch.randn(6))
    x = torch.randn(10, 16)
    weights, experts, _ = router(x)
    logits = x @ router.gate.weight.T + router.gate.bias
    top = logits.topk(3, dim=-1)  # softmax is monotone: the same choice, in the same order
    assert torch.equal(experts, top.indices)
    torch.testing.assert_close(weights, top.values.softmax(-1), rtol=1e-6, atol=1e-7)


def test_yarn_with_fractional_ramp_ends_applies_at_every_length():
    yarn = YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False)
    dim, theta = 64, 150000.0

    def correction(rotations):
        return dim * math.log(4096 / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(correction(32.0), 0), min(correction(1.0), dim - 1)
    want = []
    for i in range(dim // 2):
        freq = theta ** (-2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        want.append(freq / 32.0 * ramp + freq * (1 - ramp))
    assert yarn_frequencies(dim, theta, yarn).tolist() == pytest.approx(want, rel=1e-5)
    truncated = yarn_frequencies(dim, theta, dataclasses.replace(yarn, truncate=True))
    assert not torch.equal(truncated, yarn_frequencies(dim, theta, yarn))


def _mxfp4_reference(blocks, scales):
    """Byte b of block g holds elements 2b (low nibble) and 2b + 1 (high); value = E2M1(code) * 2^(scale - 127)."""
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    n_experts, rows, groups, width = blocks.shape
    out = torch.empty(n_experts, rows, groups * 2 * width)
    for e, r, g, b in torch.cartesian_prod(*(torch.arange(n) for n in blocks.shape)).tolist():
        byte = int(blocks[e, r, g, b])
        for half, code in enumerate((byte & 0xF, byte >> 4)):
            value = (-1.0 if code & 0x8 else 1.0) * e2m1[code & 0x7]
            out[e, r, g * 2 * width + 2 * b + half] = value * 2.0 ** (int(scales[e, r, g]) - 127)
    return out.transpose(1, 2)


def test_mxfp4_dequantisation():
    """(transformers' own dequantisation: test_gpt_oss_hf.py)"""
    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), dtype=torch.uint8)
    scales = torch.randint(118, 136, (2, 3, 2), dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 64, 3)
    assert torch.equal(got.float(), _mxfp4_reference(blocks, scales))  # exact in bfloat16
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :1])


def test_flops_count_active_experts_and_window_keys():
    spec = get_model_spec("gpt_oss")
    args = gpt_oss_flavors["20b"]
    attention = 12 * 64 * 64 * (12 * 4096 + 12 * 128)  # 12 full layers, 12 window layers of 128 keys
    assert spec.flops_per_token(args, 4096) == 6 * active_params(args) + attention
    with torch.device("meta"):
        model = GptOss(gpt_oss_flavors["tiny"])
    a = gpt_oss_flavors["tiny"]
    total = sum(p.numel() for p in model.parameters()) - a.vocab_size * a.dim
    idle_experts = a.n_layers * (a.moe.n_experts - a.moe.top_k) * (a.dim * 2 * a.moe.hidden_dim + 2 * a.moe.hidden_dim
                                                                    + a.moe.hidden_dim * a.dim + a.dim)
    assert active_params(a) == total - idle_experts
    # the released sizes: 21B total / 3.6B active, 117B / 5.1B
    assert round(active_params(args) / 1e9, 1) == 3.6 and round(active_params(gpt_oss_flavors["120b"]) / 1e9, 1) == 5.1


def test_debug_flavor_has_both_attention_kinds_twice_and_divisible_experts():
    args = gpt_oss_flavors["tiny"]
    model = GptOss(args)
    kinds = [(layer.attention.inner_attention.mask, layer.attention.inner_attention.sinks is not None)
             for layer in model.layers.values()]
    assert kinds == [(AttentionMask(window=128), True), (AttentionMask(), True)] * 2
    assert set(kinds) == set(get_model_spec("gpt_oss").attention_kinds(args))
    assert args.moe.n_experts % 4 == 0 and args.moe.gate_bias and args.moe.route_norm


@pytest.mark.parametrize("flavor", sorted(gpt_oss_flavors))
def test_config_round_trip(flavor):
    args = gpt_oss_flavors[flavor]
    config = hf_config.config_from_args(args)
    assert hf_config.args_from_config(config) == args
    hf_config.check_config(args, config, "config.json", f"gpt_oss/{flavor}")


def test_released_config_layout_reads():
    """As openai/gpt-oss-20b's config.json states it (transformers 4.55: rope_theta + rope_scaling)."""
    released = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "rms_norm_eps": 1e-05, "rope_theta": 150000,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "max_position_embeddings": 131072, "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False,
        "hidden_act": "silu", "router_aux_loss_coef": 0.9, "initial_context_length": 4096,
    }
    assert hf_config.args_from_config(released) == gpt_oss_flavors["20b"]
    for unstated in ({"rope_scaling": None}, {"rope_scaling": {}}):  # GptOssConfig's own YaRN, as transformers 5
        assert hf_config.args_from_config(released | unstated) == gpt_oss_flavors["20b"]


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": False}, "attention_bias False is not supported"),
    ({"layer_types": ["sliding_attention"]}, "layer_types must list 24"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                          "mscale": 0.7}}, "rope_parameters.mscale is not supported"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear' is not supported"),
    ({"num_experts_per_tok": 64}, "top_k=64"),
])
def test_bad_configs_name_the_culprit(change, message):
    config = hf_config.config_from_args(gpt_oss_flavors["20b"]) | change
    with pytest.raises(ValueError, match=message):
        hf_config.args_from_config(config, "x/config.json")


def test_config_refuses_routing_it_cannot_state():
    args = dataclasses.replace(gpt_oss_flavors["tiny"], moe=MoEArgs(n_experts=8, top_k=2, score_func="sigmoid"))
    with pytest.raises(ValueError, match="cannot express this routing"):
        hf_config.config_from_args(args)


def test_args_record_round_trip(tmp_path):
    spec, args = get_model_spec("gpt_oss"), gpt_oss_flavors["tiny"]
    (tmp_path / ARGS_FILE).write_bytes(args_record(spec, args))
    assert read_args_record(tmp_path)[1] == args  # window_layers back as a tuple
