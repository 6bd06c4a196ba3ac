"""Multi-head latent attention against the DeepSeek-V2/V3 equations written out plainly."""

import math
from dataclasses import replace

import pytest
import torch

from tessera.models.deepseek_v3 import Attention, DeepSeekV3, DeepSeekV3Args, YarnScaling
from tessera.models.moe import MoEArgs
from tessera.models.rotary import inverse_frequencies

YARN = YarnScaling(factor=4.0, original_max_position_embeddings=8, beta_fast=32, beta_slow=1, mscale=0.707)
ARGS = DeepSeekV3Args(vocab_size=64, dim=32, n_layers=2, n_heads=4, inter_dim=64, moe=MoEArgs(n_experts=4, top_k=2),
                      q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                      yarn=YARN, max_seq_len=8)


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_pairs(x, positions, freqs):
    """Adjacent feature pairs as complex numbers times exp(i * position * freq)."""
    rotation = torch.polar(torch.ones(len(positions), len(freqs)), torch.outer(positions.float(), freqs))
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * rotation[:, None]).flatten(-2)


def naive_mla(attn: Attention, args: DeepSeekV3Args, h: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    B, T, _ = h.shape
    H, nope, rope, dv, eps = args.n_heads, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim, args.norm_eps
    positions = torch.arange(T)
    if args.q_lora_rank:
        c_q = rms_norm(h @ attn.wq_a.weight.T, attn.q_norm.weight, eps)  # W^DQ, then norm
        q = c_q @ attn.wq_b.weight.T  # W^UQ and W^QR together
    else:
        q = h @ attn.wq.weight.T
    q = q.view(B, T, H, nope + rope)
    q_c, q_r = q[..., :nope], rotate_pairs(q[..., nope:], positions, freqs)
    compressed = h @ attn.wkv_a.weight.T  # W^DKV and W^KR together
    c_kv, k_r = compressed[..., :args.kv_lora_rank], compressed[..., None, args.kv_lora_rank:]
    k_r = rotate_pairs(k_r, positions, freqs)  # one rotated key head, shared by all heads
    kv = (rms_norm(c_kv, attn.kv_norm.weight, eps) @ attn.wkv_b.weight.T).view(B, T, H, nope + dv)
    k_c, v = kv[..., :nope], kv[..., nope:]
    scale = (nope + rope) ** -0.5
    if args.max_seq_len > args.yarn.original_max_position_embeddings:
        scale *= (0.1 * args.yarn.mscale * math.log(args.yarn.factor) + 1) ** 2
    out = torch.zeros(B, T, H, dv)
    for b in range(B):
        for i in range(T):
            for head in range(H):
                scores = torch.stack([
                    (q_c[b, i, head] @ k_c[b, j, head] + q_r[b, i, head] @ k_r[b, j, 0]) * scale for j in range(i + 1)
                ])
                out[b, i, head] = scores.softmax(0) @ v[b, :i + 1, head]
    return out.reshape(B, T, H * dv) @ attn.wo.weight.T


def yarn_freqs_by_hand(args):
    """YaRN for qk_rope_head_dim 4, theta 1e4, original context 8: pair 0 is kept (its correction
    index floor(...) is 0), pair 1 lies past ceil(correction(beta_slow)) = 1, so it is divided by 4."""
    plain = inverse_frequencies(args.qk_rope_head_dim, args.rope_theta)
    return plain if args.max_seq_len <= 8 else torch.stack([plain[0], plain[1] / 4])


@pytest.mark.parametrize("q_lora_rank", [0, 12])
@pytest.mark.parametrize("max_seq_len", [8, 16])  # 16 > original 8: YaRN on
def test_mla_matches_the_equations(q_lora_rank, max_seq_len):
    args = replace(ARGS, q_lora_rank=q_lora_rank, max_seq_len=max_seq_len)
    torch.manual_seed(0)
    attn = Attention(args)
    attn.init_weights(0.1)
    for norm in [attn.kv_norm] + ([attn.q_norm] if q_lora_rank else []):
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    rope = DeepSeekV3(replace(args, n_layers=1)).rope[:7]
    h = torch.randn(2, 7, args.dim)
    got = attn(h, rope=rope)
    assert got.shape == (2, 7, args.dim)
    torch.testing.assert_close(got, naive_mla(attn, args, h, yarn_freqs_by_hand(args)), rtol=1e-4, atol=1e-5)


def test_inner_attention_sees_qk_and_v_widths():
    attn, seen = Attention(ARGS), {}

    class Record(torch.nn.Module):
        def forward(self, q, k, v, batch=None):
            seen.update(q=q.shape, k=k.shape, v=v.shape)
            return torch.zeros(*q.shape[:3], v.shape[-1])

    attn.inner_attention = Record()
    attn(torch.randn(1, 5, ARGS.dim), rope=torch.zeros(5, ARGS.qk_rope_head_dim))
    assert seen == {"q": (1, 4, 5, 12), "k": (1, 4, 5, 12), "v": (1, 4, 5, 6)}
