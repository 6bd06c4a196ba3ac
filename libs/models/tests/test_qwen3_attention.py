"""Qwen3 attention (QK-norm, GQA, decoupled head_dim) against a plain per-head computation."""

import torch

from tessera.models.masks import CAUSAL
from tessera.models.qwen3 import Attention, Qwen3, Qwen3Args

ARGS = Qwen3Args(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=12, hidden_dim=48,
                 rope_theta=10000.0, max_seq_len=16)


def naive_qwen3_attention(attn: Attention, args: Qwen3Args, x: torch.Tensor) -> torch.Tensor:
    """Per head: q = RMSNorm_q(W_q,h x), k = RMSNorm_k(W_k,g x) with g the head's KV group, both
    rotated HF-style (q cos + rotate_half(q) sin), causal softmax(q k / sqrt(head_dim)) v."""
    B, T, _ = x.shape
    d, eps = args.head_dim, args.norm_eps

    def norm(v, weight):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight

    inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, d, 2).float() / d)
    theta = torch.outer(torch.arange(T).float(), inv_freq)
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)

    def rope(v):
        return v * cos + torch.cat([-v[..., d // 2:], v[..., :d // 2]], -1) * sin

    group = args.n_heads // args.n_kv_heads
    heads = []
    for h in range(args.n_heads):
        g = h // group
        q = rope(norm(x @ attn.wq.weight[h * d:(h + 1) * d].T, attn.q_norm.weight))
        k = rope(norm(x @ attn.wk.weight[g * d:(g + 1) * d].T, attn.k_norm.weight))
        v = x @ attn.wv.weight[g * d:(g + 1) * d].T
        scores = q @ k.transpose(-1, -2) / d**0.5 + torch.full((T, T), float("-inf")).triu(1)
        heads.append(scores.softmax(-1) @ v)
    return torch.cat(heads, -1) @ attn.wo.weight.T


def test_attention_matches_per_head_reference():
    torch.manual_seed(0)
    model = Qwen3(ARGS)
    attn = model.layers["0"].attention
    torch.nn.init.uniform_(attn.q_norm.weight, 0.5, 1.5)
    torch.nn.init.uniform_(attn.k_norm.weight, 0.5, 1.5)
    x = torch.randn(2, 9, ARGS.dim)
    got = attn(x, rope=model.rope[:9])
    torch.testing.assert_close(got, naive_qwen3_attention(attn, ARGS, x), rtol=1e-5, atol=1e-5)


def test_qk_norm_normalises_each_head():
    """With unit norm weights every q and k head vector reaching the kernel has RMS 1 before RoPE,
    and RoPE keeps vector norms: so each has norm sqrt(head_dim), whatever the projection scale."""
    attn, seen = Attention(ARGS, CAUSAL), {}

    class Record(torch.nn.Module):
        def forward(self, q, k, v, batch=None):
            seen.update(q=q, k=k)
            return q

    attn.inner_attention = Record()
    with torch.no_grad():
        attn.wq.weight.mul_(50.0)
    attn(torch.randn(1, 5, ARGS.dim), rope=Qwen3(ARGS).rope[:5])
    for name in ("q", "k"):
        norms = seen[name].norm(dim=-1)
        torch.testing.assert_close(norms, torch.full_like(norms, ARGS.head_dim**0.5), rtol=1e-3, atol=1e-3)
