"""The inner attention of a decoder: softmax(q k^T / sqrt(head_dim)) v under a causal mask.

Models hold it as the submodule ``attention.inner_attention`` of each block and call it after
projecting, rotating and repeating q, k, v, so a library can swap the kernel without editing model
code (``block.attention.inner_attention = RingAttention(...)`` for context parallel).
Layout of q, k, v and of the output: [batch, heads, seq, head_dim], with K/V already repeated
to the number of query heads; query i attends to keys 0..i of the tensors it is given. With
``document_ids`` ([batch, seq], the document each token belongs to, for windows that pack
several documents) a query also attends only to keys of its own document.
"""

import torch
import torch.nn.functional as F
from torch import nn


class CausalSDPA(nn.Module):
    """Causal attention through ``F.scaled_dot_product_attention``, which picks the fused kernel
    (flash, memory-efficient, or the CPU one) for the device and dtype."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        if document_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        seq = q.shape[2]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(document_ids, document_ids) & causal)


def document_mask(query_documents: torch.Tensor, key_documents: torch.Tensor) -> torch.Tensor:
    """[batch, 1, queries, keys]: True where query and key lie in the same document."""
    return (query_documents[:, :, None] == key_documents[:, None, :])[:, None]
