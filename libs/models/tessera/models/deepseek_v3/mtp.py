"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2): D sequential modules, the
k-th predicting the token k + 1 ahead of each position, trained beside next-token prediction.

Module k (k = 1..D), at position i, from the previous depth's representation (the main model's
last block output for k = 1) and the embedding of token t_{i+k}:

    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]    eh_proj, enorm, hnorm
    h^k = TRM_k(h'^k)                                            a DeepSeek-V3 block
    P^k_i = OutHead(RMSNorm(h^k_i))                              mtp_norm (HF: shared_head.norm)
    L^k = -1/T sum_i log P^k_i[t_{i+1+k}]                        eq. 24: over the T positions
    L_MTP = lambda / D * sum_k L^k

Emb and OutHead (the output projection) are the main model's. The report writes M_k's input as
[h; Emb]; DeepSeek's released weights (as vLLM, Megatron-LM and torchtitan read them) put the
embedding first, and eh_proj's columns follow them.

The tokens come from the labels (labels[j] = t_{j+1}): t_{i+k} = labels[i+k-1] and t_{i+1+k} =
labels[i+k], so a rank reads them from its own labels under every layout, including a pipeline's
last stage, which holds no tokens. A position whose target lies past the window predicts
nothing; with document ids (block-causal attention) neither does one whose token t_{i+k} is in
another document than t_i. Dividing by T, not by the positions that predict, makes a
micro-batch's loss its exact share of the batch's under any split.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.models.decoder import BASE_INIT_STD, TransformerBlock
from tessera.models.feed_forward import trunc_normal
from tessera.models.rms_norm import RMSNorm

IGNORE = -100  # F.cross_entropy's ignore_index
# lambda: the report's weight for its first 10T tokens (0.1 after), and torchtitan's loss.mtp_scale
MTP_SCALE = 0.3


class MTPBlock(TransformerBlock):
    """One multi-token-prediction module: ``forward(h, *, embedded, rope, attention)`` ->
    (h^k, mtp_norm(h^k)); h^k feeds the next depth, the normed one the output head."""

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, ffn: nn.Module, init_std: float):
        super().__init__(dim, norm_eps, attention, ffn, init_std)
        self.enorm = RMSNorm(dim, eps=norm_eps)
        self.hnorm = RMSNorm(dim, eps=norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.mtp_norm = RMSNorm(dim, eps=norm_eps)

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        super().init_weights(buffer_device)
        for norm in (self.enorm, self.hnorm, self.mtp_norm):
            norm.reset_parameters()
        trunc_normal(self.eh_proj.weight, BASE_INIT_STD)

    def forward(self, h: torch.Tensor, *, embedded: torch.Tensor, rope: torch.Tensor,
                attention=None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        if isinstance(x, DTensor):  # tensor parallel's sequence shard: the residual stream is its local part
            x = x.to_local()
        h = super().forward(x, rope=rope, attention=attention)
        return h, self.mtp_norm(h)


def depth_tokens(labels: torch.Tensor, k: int,
                 document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) of depth k at each position i of labels [B, T]: t_{i+k} (0 past the
    window) and t_{i+1+k} (IGNORE where nothing is predicted, see the module docstring)."""
    tokens = F.pad(labels[:, k - 1:], (0, k - 1))
    targets = F.pad(labels[:, k:], (0, k), value=IGNORE)
    if document_ids is not None:
        same = F.pad(document_ids[:, k:] == document_ids[:, :-k], (0, k), value=False)
        targets = torch.where(same, targets, IGNORE)
    return tokens, targets


def mtp_loss(h: torch.Tensor, labels: torch.Tensor, blocks: list[nn.Module], embedding: nn.Module,
             output: nn.Module, *, rope: torch.Tensor, attention=None,
             document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """L_MTP / lambda = the mean of L^k over the depths; h: the main model's last block output."""
    total = 0.0
    for k, block in enumerate(blocks, start=1):
        tokens, targets = depth_tokens(labels, k, document_ids)
        h, normed = block(h, embedded=embedding(tokens), rope=rope, attention=attention)
        logits = output(normed)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")
        total = total + loss / labels.numel()
    return total / len(blocks)
