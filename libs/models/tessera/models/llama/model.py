"""Llama 2 / Llama 3.x decoder (Touvron et al. 2023; Llama 3 Herd of Models, 2024).

Pre-norm transformer: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU; the shell
(embedding, blocks, norm, output, RoPE table) is ``tessera.models.decoder``'s, shared with
DeepSeek-V3 and Qwen3.

Conventions other libraries rely on:
- module names ``tok_embeddings``, ``layers`` (``nn.ModuleDict`` keyed "0".."n-1"),
  ``attention_norm``, ``attention.{wq,wk,wv,wo}``, ``ffn_norm``, ``feed_forward.{w1,w2,w3}``,
  ``norm``, ``output``;
- heads are reshaped with ``-1``, so tensor-parallel linears holding fewer local heads work
  unchanged;
- ``attention.inner_attention`` is the attention kernel (``tessera.models.attention.InnerAttention``:
  the layer's mask, the kernel choice, context parallel's exchange): q [batch, heads, seq, head_dim],
  k and v [batch, kv_heads, seq, head_dim], and the step's ``AttentionBatch`` (document ids for
  block-causal masking) -> [batch, heads, seq, head_dim];
- positions are explicit: ``forward(tokens, positions=None)`` takes position ids ([T] or [B, T],
  default 0..T-1), and the RoPE table is indexed by them once at model entry, where the tokens
  are the whole sequence this rank holds; blocks get that rotation as the keyword ``rope``
  and use it whole, since under sequence parallel a block sees the full sequence only after its
  input is gathered, while between blocks it holds a shard;
- a block's sub-modules take the hidden state as their only positional argument;
- pipeline stages may set ``tok_embeddings``/``norm``/``output`` to None and delete layers.
"""

import torch
from torch import nn

from tessera.models.attention import AttentionBatch, InnerAttention
from tessera.models.decoder import Decoder, TransformerBlock, depth_init_std
from tessera.models.feed_forward import BASE_INIT_STD, FeedForward, trunc_normal
from tessera.models.llama.args import ModelArgs
from tessera.models.llama.rope import apply_rotary_emb, precompute_freqs_cis


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings; the attention kernel itself
    is the swappable submodule ``inner_attention`` (see ``tessera.models.attention``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.inner_attention = InnerAttention()

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal(linear.weight, BASE_INIT_STD)
        trunc_normal(self.wo.weight, init_std)

    def forward(self, x: torch.Tensor, *, rope: torch.Tensor, attention: AttentionBatch | None = None) -> torch.Tensor:
        """x [bs, seqlen, dim]; rope: the rotation (complex) of each of the seqlen tokens,
        [seqlen, head_dim // 2] or [bs, seqlen, head_dim // 2]; attention: the step's AttentionBatch."""
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rotary_emb(q, k, rope)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class Transformer(Decoder):
    """Llama decoder: tokens [B, T] (long) -> logits [B, T, vocab_size] in the parameter dtype;
    the ``rope`` table holds complex rotations (``precompute_freqs_cis``)."""

    def __init__(self, args: ModelArgs):
        blocks = [TransformerBlock(args.dim, args.norm_eps, Attention(args), FeedForward(args.dim, args.ffn_hidden_dim),
                                   depth_init_std(i, args.n_layers, args.depth_init)) for i in range(args.n_layers)]
        super().__init__(args, blocks, tie_embeddings=args.tie_embeddings)

    def rope_table(self) -> torch.Tensor:
        a = self.args
        return precompute_freqs_cis(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)


__all__ = ["Attention", "FeedForward", "Transformer", "TransformerBlock"]
