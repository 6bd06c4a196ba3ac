"""RoPE helpers of the DeepSeek-V3 and Qwen3 models against plain definitions."""

import dataclasses
import math

import pytest
import torch

from tessera.models.deepseek_v3 import DeepSeekV3, YarnScaling, deepseek_v3_flavors, yarn_frequencies
from tessera.models.rotary import apply_rope_half, apply_rope_interleaved, inverse_frequencies, rope_table


def angles(positions, freqs):
    return torch.outer(positions.double(), freqs.double())


def test_interleaved_equals_complex_rotation_of_adjacent_pairs():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 8)
    freqs = inverse_frequencies(8, 10000.0)
    positions = torch.tensor([0, 3, 4, 9, 2])
    rotation = torch.polar(torch.ones(5, 4, dtype=torch.float64), angles(positions, freqs))
    pairs = torch.view_as_complex(x.double().reshape(2, 5, 3, 4, 2).contiguous())
    expected = torch.view_as_real(pairs * rotation[:, None]).flatten(-2)
    got = apply_rope_interleaved(x, rope_table(freqs, 10)[positions])
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_half_equals_hf_rotate_half():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 8)
    freqs = inverse_frequencies(8, 1e6)
    theta = angles(torch.arange(5), freqs)
    cos, sin = torch.cat([theta.cos(), theta.cos()], -1)[:, None], torch.cat([theta.sin(), theta.sin()], -1)[:, None]
    rotate_half = torch.cat([-x[..., 4:], x[..., :4]], dim=-1).double()
    expected = x.double() * cos + rotate_half * sin
    torch.testing.assert_close(apply_rope_half(x, rope_table(freqs, 5)).double(), expected, rtol=1e-5, atol=1e-5)


def test_per_sequence_rows_and_dtype():
    x = torch.randn(2, 4, 1, 6, dtype=torch.bfloat16)
    table = rope_table(inverse_frequencies(6, 100.0), 8)
    positions = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    got = apply_rope_half(x, table[positions])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got[1], apply_rope_half(x[1:], table[4:8])[0])


def yarn_reference(dim, theta, y: YarnScaling):
    """DeepSeek's YaRN, one frequency at a time."""
    def correction(rotations):
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(math.floor(correction(y.beta_fast)), 0), min(math.ceil(correction(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        freq = theta ** (-2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(freq / y.factor * ramp + freq * (1 - ramp))
    return out


@pytest.mark.parametrize("dim, theta", [(64, 10000.0), (16, 10000.0), (4, 500.0)])
def test_yarn_frequencies(dim, theta):
    yarn = YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0)
    got = yarn_frequencies(dim, theta, yarn)
    assert got.tolist() == pytest.approx(yarn_reference(dim, theta, yarn), rel=1e-5)
    plain = inverse_frequencies(dim, theta)
    assert got[0] == plain[0]  # the fastest rotation is kept
    if dim == 64:  # DeepSeek's rotary width: the slowest ones are divided by the factor
        assert got[-1] == pytest.approx(plain[-1].item() / 40, rel=1e-5)
    assert torch.equal(yarn_frequencies(dim, theta, None), plain)


def test_deepseek_applies_yarn_beyond_the_original_context_or_always_from_a_hf_config():
    """DeepSeek's reference code (and torchtitan) switch YaRN on above the original context;
    transformers applies a config.json's rope_scaling at any length (yarn_always)."""
    yarn = YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=1.0)
    tiny = dataclasses.replace(deepseek_v3_flavors["tiny"], yarn=yarn)
    short, long = dataclasses.replace(tiny, max_seq_len=4096), dataclasses.replace(tiny, max_seq_len=8192)
    always = dataclasses.replace(short, yarn_always=True)
    assert [a.yarn_active for a in (short, long, always)] == [False, True, True]
    assert short.softmax_scale_factor == 1.0
    assert always.softmax_scale_factor == long.softmax_scale_factor == yarn.attention_factor() > 1
    plain = inverse_frequencies(short.qk_rope_head_dim, short.rope_theta)
    torch.testing.assert_close(_frequencies(DeepSeekV3(short)), plain)
    torch.testing.assert_close(_frequencies(DeepSeekV3(always)), yarn_frequencies(short.qk_rope_head_dim,
                                                                               short.rope_theta, yarn))
    assert not dataclasses.replace(long, yarn=None, yarn_always=True).yarn_active


def _frequencies(model) -> torch.Tensor:
    """Row 1 of the rope table (position 1): cos then sin of each frequency."""
    cos, sin = model.rope_table()[1].chunk(2)
    return torch.atan2(sin, cos)


def test_yarn_attention_factor():
    expected = (0.1 * 0.707 * math.log(40) + 1) ** 2
    assert YarnScaling(factor=40.0, mscale=0.707).attention_factor() == pytest.approx(expected)
    assert YarnScaling(factor=1.0).attention_factor() == 1.0
