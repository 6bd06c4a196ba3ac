"""The inner attention of a decoder: softmax(q k^T / sqrt(head_dim)) v under a causal mask.

Models hold it as the submodule ``attention.inner_attention`` of each block and call it after
projecting, rotating and repeating q, k, v, so a library can swap the kernel without editing model
code (``block.attention.inner_attention = RingAttention(...)`` for context parallel).
Layout of q, k, v and of the output: [batch, heads, seq, head_dim], with K/V already repeated
to the number of query heads; query i attends to keys 0..i of the tensors it is given.
"""

import torch
import torch.nn.functional as F
from torch import nn


class CausalSDPA(nn.Module):
    """Causal attention through ``F.scaled_dot_product_attention``, which picks the fused kernel
    (flash, memory-efficient, or the CPU one) for the device and dtype."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
