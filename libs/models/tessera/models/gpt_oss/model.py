"""GPT-OSS decoder (OpenAI 2025, gpt-oss-20b / gpt-oss-120b): grouped-query attention with
biases and learned attention sinks, sliding-window (128) and full layers alternating, YaRN RoPE,
RMSNorm, and a mixture of experts in every block (top-k of a biased gate, softmax over the chosen
logits, clamped-SwiGLU experts with biases, no shared expert).

RoPE uses Hugging Face's half-split layout, so HF weights load without permutation. Module
names: the decoder's (``tessera.models.decoder``), per block ``attention.{wq,wk,wv,wo}`` (with
biases), ``attention.inner_attention.sinks``, ``moe.router.gate`` (with a bias) and
``moe.experts.{gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias}``.
"""

import torch
from torch import nn

from tessera.models.attention import AttentionBatch, InnerAttention
from tessera.models.decoder import BASE_INIT_STD, Decoder, TransformerBlock, depth_init_std
from tessera.models.gpt_oss.args import GptOssArgs
from tessera.models.gpt_oss.experts import GptOssExperts
from tessera.models.masks import window_layer
from tessera.models.moe import MoE
from tessera.models.rotary import apply_rope_half, rope_table, yarn_frequencies


class Attention(nn.Module):
    """Grouped-query attention with biased projections and attention sinks (a logit per head
    in every softmax's denominator); the kernel is the swappable ``inner_attention``. YaRN's
    factor on the scores is folded into q, so the kernel keeps the plain 1/sqrt(head_dim)."""

    def __init__(self, args: GptOssArgs, layer_id: int):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim)
        self.q_scale = args.softmax_scale_factor
        self.inner_attention = InnerAttention(window_layer(layer_id, args.sliding_window, args.window_layers),
                                              sinks=args.n_heads)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv, self.wo):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=BASE_INIT_STD if linear is not self.wo else init_std)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor, *, rope: torch.Tensor, attention: AttentionBatch | None = None) -> torch.Tensor:
        """x [bs, seqlen, dim]; rope: the RoPE rows of the seqlen tokens, [seqlen, head_dim] or
        [bs, seqlen, head_dim]; attention: the step's ``AttentionBatch``."""
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rope_half(q, rope), apply_rope_half(k, rope)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


def _block(layer_id: int, args: GptOssArgs) -> TransformerBlock:
    experts = GptOssExperts(args.dim, args.moe.hidden_dim, args.moe.n_experts, args.swiglu_limit,
                            args.swiglu_alpha)
    return TransformerBlock(args.dim, args.norm_eps, Attention(args, layer_id), MoE(args.dim, args.moe, experts),
                            depth_init_std(layer_id, args.n_layers, args.depth_init))


class GptOss(Decoder):
    """GPT-OSS decoder: tokens [B, T] -> logits [B, T, vocab_size] (see ``Decoder``)."""

    def __init__(self, args: GptOssArgs):
        super().__init__(args, [_block(i, args) for i in range(args.n_layers)])

    def rope_table(self) -> torch.Tensor:
        a = self.args
        return rope_table(yarn_frequencies(a.head_dim, a.rope_theta, a.yarn), a.max_seq_len)
