"""DeepSeek-V2/V3 decoder (DeepSeek-AI 2024, arXiv 2405.04434 and 2412.19437): multi-head latent
attention with decoupled RoPE, dense SwiGLU in the first blocks, mixture of experts after.

Module names: the decoder's (``tessera.models.decoder``), and per block ``attention.{wq | wq_a,
q_norm, wq_b}``, ``attention.{wkv_a, kv_norm, wkv_b, wo}``, ``feed_forward.{w1,w2,w3}`` (dense
blocks) or ``moe.{router.gate, experts, shared_experts}``, and in the multi-token-prediction
blocks (``layers.<n_layers + k - 1>``) also ``enorm``, ``hnorm``, ``eh_proj``, ``mtp_norm``. Heads
are reshaped with ``-1``, so linears holding fewer local heads (tensor parallel) work unchanged.
"""

import torch
from torch import nn

from tessera.models.attention import AttentionBatch, InnerAttention
from tessera.models.decoder import BASE_INIT_STD, Decoder, TransformerBlock, depth_init_std
from tessera.models.deepseek_v3.args import DeepSeekV3Args
from tessera.models.deepseek_v3.mtp import MTP_SCALE, MTPBlock, mtp_loss
from tessera.models.feed_forward import FeedForward
from tessera.models.moe import MoE, attach_aux_loss
from tessera.models.rotary import apply_rope_interleaved, rope_table, yarn_frequencies

# The latent norms' epsilon is fixed, not the config's rms_norm_eps: DeepSeek's reference code and
# transformers build both with RMSNorm's default.
LATENT_NORM_EPS = 1e-6


class Attention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 section 2.1, eq. 37-47):

        q = W_UQ RMSNorm(W_DQ h)  (or W_Q h without q compression), split into q_nope | q_rope
        c_kv | k_rope = W_DKV h;  k_nope | v = W_UKV RMSNorm(c_kv)
        q_rope, k_rope rotated (interleaved pairs); k_rope is one head shared by all heads
        out = W_O attention([q_nope, q_rope], [k_nope, k_rope], v)

    The inner attention gets q, k [B, H, T, qk_nope + qk_rope] and v [B, H, T, v_head_dim] (SDPA
    takes a different value width) and applies the usual 1/sqrt(head_dim) scale: YaRN's extra
    factor on the scores is folded into q beforehand, so any kernel serves.
    """

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        qk_dim = args.n_heads * args.qk_head_dim
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(self.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(self.q_lora_rank, qk_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_lora_rank, args.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        self.q_scale = args.softmax_scale_factor
        self.inner_attention = InnerAttention()

    def init_weights(self, init_std: float) -> None:
        projections = [self.wq] if self.q_lora_rank == 0 else [self.wq_a, self.wq_b]
        for linear in (*projections, self.wkv_a, self.wkv_b):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=BASE_INIT_STD)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in [self.kv_norm] + ([] if self.q_lora_rank == 0 else [self.q_norm]):
            norm.reset_parameters()

    def forward(self, x: torch.Tensor, *, rope: torch.Tensor, attention: AttentionBatch | None = None) -> torch.Tensor:
        """x [bs, seqlen, dim]; rope: the RoPE rows of the seqlen tokens, [seqlen, qk_rope_head_dim]
        or [bs, seqlen, qk_rope_head_dim]; attention: the step's ``AttentionBatch``."""
        bs, seqlen, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bs, seqlen, -1, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope_interleaved(q_rope, rope)], dim=-1)
        kv, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = apply_rope_interleaved(k_rope.unsqueeze(2), rope)
        kv = self.wkv_b(self.kv_norm(kv)).view(bs, seqlen, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


def _block(layer_id: int, args: DeepSeekV3Args) -> TransformerBlock:
    """Block ``layer_id``; from ``n_layers`` on, the multi-token-prediction modules (MoE, like
    the blocks before them)."""
    dense = layer_id < args.n_dense_layers
    ffn = FeedForward(args.dim, args.inter_dim) if dense else MoE(args.dim, args.moe)
    block = TransformerBlock if layer_id < args.n_layers else MTPBlock
    return block(args.dim, args.norm_eps, Attention(args), ffn, depth_init_std(layer_id, args.n_layers, args.depth_init))


class DeepSeekV3(Decoder):
    """DeepSeek-V2/V3 decoder: tokens [B, T] -> logits [B, T, vocab_size] (see ``Decoder``), with
    ``args.num_mtp_layers`` multi-token-prediction modules after the blocks (``mtp.py``)."""

    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args, [_block(i, args) for i in range(args.n_layers + args.num_mtp_layers)])
        # the factor of L_MTP / lambda in backward: lambda times the trainer's loss scale (set_mtp_scale)
        self.mtp_scale = MTP_SCALE
        if args.num_mtp_layers:  # tessera.pp: the modules embed tokens again, so the last stage keeps a copy
            self.shared_with_last_stage = ("tok_embeddings",)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
        """As ``Decoder.forward``; with ``labels`` [B, T] (training) the multi-token-prediction
        modules this model or stage holds run too, and their loss reaches the gradients through
        the logits' backward (``attach_aux_loss``, scale ``mtp_scale``), leaving the logits and
        the training loss the main model's."""
        h, rope, attention = self._inputs(tokens, positions, document_ids)
        mtp = [layer for key, layer in self.layers.items() if int(key) >= self.args.n_layers]
        for key, layer in self.layers.items():
            if int(key) < self.args.n_layers:
                h = layer(h, rope=rope, attention=attention)
        logits = self._head(h)
        if labels is None or not mtp:
            return logits
        loss = mtp_loss(h, labels, mtp, self.tok_embeddings, self.output, rope=rope, attention=attention,
                        document_ids=document_ids)
        # on the logits, beside the head rather than below it: a pipeline's split backward (zero-bubble,
        # DualPipeV) takes the output projection's two uses apart only when neither lies on the other's path
        return attach_aux_loss(logits, loss, self.mtp_scale)

    def rope_table(self) -> torch.Tensor:
        a = self.args
        return rope_table(yarn_frequencies(a.qk_rope_head_dim, a.rope_theta, a.yarn if a.yarn_active else None),
                          a.max_seq_len)
