"""Llama 4 text decoder (Meta 2025, Scout / Maverick): grouped-query attention with iRoPE and a
mixture of experts interleaved with dense SwiGLU layers.

iRoPE: most layers rotate q and k (RoPE on interleaved pairs, as Meta's complex form),
normalise them to unit RMS per head (``use_qk_norm``, no weight) and attend within their chunk
of ``attention_chunk_size`` tokens; every fourth layer has no positional encoding (NoPE) and
attends globally, its queries scaled up with the position (attention-temperature tuning,
Nakanishi 2025, arXiv 2501.19399) so attention stays sharp over long contexts. MoE layers route
each token to one expert by a sigmoid score that scales the expert's input, plus a shared expert.

The RoPE table (``rope_table``) holds per position the cosines, the sines and, last, the NoPE
layers' query scale, so one indexed tensor carries both through pipeline stages and compiled
blocks. Module names: the decoder's, per block ``attention.{wq,wk,wv,wo}``,
``feed_forward.{w1,w2,w3}`` or ``moe.{router.gate,experts,shared_experts}``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.attention import AttentionBatch, InnerAttention
from tessera.models.decoder import BASE_INIT_STD, Decoder, TransformerBlock, depth_init_std
from tessera.models.feed_forward import FeedForward
from tessera.models.llama.rope import rope_frequencies
from tessera.models.llama4.args import Llama4Args
from tessera.models.masks import CAUSAL, AttentionMask
from tessera.models.moe import MoE
from tessera.models.rotary import apply_rope_interleaved, rope_table


def attention_temperature(positions: torch.Tensor, floor_scale: int, attn_scale: float) -> torch.Tensor:
    """The NoPE layers' query scale at each position: 1 + attn_scale * log(1 + floor((pos + 1) / floor_scale))."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over each head's features, in float32 (Llama 4's weightless q/k norm)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


def layer_mask(args: Llama4Args, layer_id: int) -> AttentionMask:
    """A chunked layer sees the keys of its own chunk, the others every earlier key."""
    return AttentionMask(chunk=args.attention_chunk_size) if layer_id in args.chunked_layers else CAUSAL


class Attention(nn.Module):
    """Grouped-query attention of one iRoPE layer: RoPE + q/k norm, or NoPE + temperature
    tuning; the kernel is the swappable ``inner_attention`` (q [B, H, T, head_dim], k, v
    [B, H_kv, T, head_dim])."""

    def __init__(self, args: Llama4Args, layer_id: int):
        super().__init__()
        self.head_dim, self.eps = args.head_dim, args.norm_eps
        self.use_rope = layer_id not in args.nope_layers
        self.qk_norm = args.use_qk_norm and self.use_rope
        self.temperature_tuning = args.attn_temperature_tuning and not self.use_rope
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.inner_attention = InnerAttention(layer_mask(args, layer_id))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=BASE_INIT_STD)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, *, rope: torch.Tensor, attention: AttentionBatch | None = None) -> torch.Tensor:
        """x [bs, seqlen, dim]; rope: the table's rows of the seqlen tokens, [seqlen, head_dim + 1]
        or [bs, seqlen, head_dim + 1]; attention: the step's ``AttentionBatch``."""
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.use_rope:
            q, k = apply_rope_interleaved(q, rope[..., :-1]), apply_rope_interleaved(k, rope[..., :-1])
        if self.qk_norm:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature_tuning:
            q = (q * rope[..., -1:].unsqueeze(-1)).to(q.dtype)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


def _block(layer_id: int, args: Llama4Args) -> TransformerBlock:
    ffn = MoE(args.dim, args.moe) if layer_id in args.moe_layers else FeedForward(args.dim, args.hidden_dim)
    return TransformerBlock(args.dim, args.norm_eps, Attention(args, layer_id), ffn,
                            depth_init_std(layer_id, args.n_layers, args.depth_init))


class Llama4(Decoder):
    """Llama 4 text decoder: tokens [B, T] -> logits [B, T, vocab_size] (see ``Decoder``)."""

    def __init__(self, args: Llama4Args):
        super().__init__(args, [_block(i, args) for i in range(args.n_layers)], tie_embeddings=args.tie_embeddings)

    def rope_table(self) -> torch.Tensor:
        """[max_seq_len, head_dim + 1] float32: cos | sin of each position's angles, then its
        attention temperature."""
        a = self.args
        freqs = rope_frequencies(a.head_dim, a.rope_theta, a.rope_scaling)
        positions = torch.arange(a.max_seq_len, dtype=torch.float32, device=freqs.device)
        temperature = attention_temperature(positions, a.floor_scale, a.attn_scale)
        return torch.cat([rope_table(freqs, a.max_seq_len), temperature.unsqueeze(-1)], dim=-1)
