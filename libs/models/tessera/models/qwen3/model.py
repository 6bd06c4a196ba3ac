"""Qwen3 decoder, dense and MoE (Qwen Team 2025, arXiv 2505.09388): Llama-like with QK-norm
(RMSNorm over each head's features of q and k, before RoPE), grouped-query attention, and
``head_dim`` decoupled from dim / n_heads.

RoPE uses Hugging Face's half-split layout (pairs i, i + head_dim/2), so HF weights, q_norm and
k_norm included, load without permutation. Module names: the decoder's, and per block
``attention.{wq,wk,wv,wo,q_norm,k_norm}``, ``feed_forward.{w1,w2,w3}`` or
``moe.{router.gate,experts}``.
"""

import torch
from torch import nn

from tessera.models.attention import AttentionBatch, InnerAttention
from tessera.models.decoder import BASE_INIT_STD, Decoder, TransformerBlock, depth_init_std
from tessera.models.masks import AttentionMask, window_layer
from tessera.models.feed_forward import FeedForward
from tessera.models.moe import MoE
from tessera.models.qwen3.args import Qwen3Args
from tessera.models.rotary import apply_rope_half, inverse_frequencies, rope_table


class Attention(nn.Module):
    """Causal grouped-query attention with QK-norm, globally or in a sliding window (``mask``);
    the kernel is the swappable ``inner_attention`` (q [B, H, T, head_dim], k, v [B, H_kv, T,
    head_dim])."""

    def __init__(self, args: Qwen3Args, mask: AttentionMask):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.inner_attention = InnerAttention(mask)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=BASE_INIT_STD)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(self, x: torch.Tensor, *, rope: torch.Tensor, attention: AttentionBatch | None = None) -> torch.Tensor:
        """x [bs, seqlen, dim]; rope: the RoPE rows of the seqlen tokens, [seqlen, head_dim] or
        [bs, seqlen, head_dim]; attention: the step's ``AttentionBatch``."""
        bs, seqlen, _ = x.shape
        q = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rope_half(q, rope), apply_rope_half(k, rope)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


def _block(layer_id: int, args: Qwen3Args) -> TransformerBlock:
    ffn = FeedForward(args.dim, args.hidden_dim) if args.moe is None else MoE(args.dim, args.moe)
    return TransformerBlock(args.dim, args.norm_eps, Attention(args, window_layer(layer_id, args.sliding_window, args.window_layers)), ffn,
                            depth_init_std(layer_id, args.n_layers, args.depth_init))


class Qwen3(Decoder):
    """Qwen3 decoder: tokens [B, T] -> logits [B, T, vocab_size] (see ``Decoder``)."""

    def __init__(self, args: Qwen3Args):
        super().__init__(args, [_block(i, args) for i in range(args.n_layers)], tie_embeddings=args.tie_embeddings)

    def rope_table(self) -> torch.Tensor:
        return rope_table(inverse_frequencies(self.args.head_dim, self.args.rope_theta), self.args.max_seq_len)
