"""The inner attention of a decoder: softmax(q k^T / sqrt(head_dim)) v under a causal mask.

Models hold it as the submodule ``attention.inner_attention`` of each block and call it after
projecting, rotating and repeating q, k, v, so a library can swap the kernel without editing model
code (``block.attention.inner_attention = RingAttention(...)`` for context parallel).
Layout of q, k, v and of the output: [batch, heads, seq, head_dim]; K/V may have fewer heads
(grouped-query attention: kv_heads dividing heads), and the kernel repeats them to the query
heads itself, so a context-parallel kernel moves the fewer K/V heads between ranks and repeats
after. Query i attends to keys 0..i of the tensors it is given. With
``document_ids`` ([batch, seq], the document each token belongs to, for windows that pack
several documents) a query also attends only to keys of its own document.
"""

import torch
import torch.nn.functional as F
from torch import nn


# torch's CPU flash-attention kernel (2.13) is slower in bf16/fp16 than in fp32 when its blocks
# are small. Forward + backward on one thread, [batch, heads, seq, head_dim], fp32 vs bf16:
# (8,16,128,16) 3.2x faster, (8,16,256,16) 1.65x, (8,8,256,32) 1.27x, (8,16,512,16) 1.22x,
# (4,8,512,32) 1.02x, (2,4,512,64) 0.95x, (4,16,1024,16) 0.91x, (2,16,1024,32) 0.82x.
# So on CPU, sequences with seq * head_dim up to this many run in fp32 (more precise, too).
CPU_FP32_MAX_SEQ_TIMES_HEAD_DIM = 8192


def repeat_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, kv_heads, seq, head_dim] -> [batch, heads, seq, head_dim]: each K/V head serves the
    heads // kv_heads consecutive query heads of its group."""
    n_rep = heads // x.shape[1]
    return x if n_rep == 1 else torch.repeat_interleave(x, n_rep, dim=1)


class CausalSDPA(nn.Module):
    """Causal attention through ``F.scaled_dot_product_attention``, which picks the fused kernel
    (flash, memory-efficient, or the CPU one) for the device and dtype; short low-precision
    sequences of small heads on CPU go through the kernel in fp32 (see above), the output in
    the inputs' dtype."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        small = q.shape[-2] * q.shape[-1] <= CPU_FP32_MAX_SEQ_TIMES_HEAD_DIM
        if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and small:
            with torch.autocast("cpu", enabled=False):
                return _attend(q.float(), k.float(), v.float(), document_ids).to(q.dtype)
        return _attend(q, k, v, document_ids)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
    k, v = repeat_kv_heads(k, q.shape[1]), repeat_kv_heads(v, q.shape[1])
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    seq = q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(document_ids, document_ids) & causal)


def document_mask(query_documents: torch.Tensor, key_documents: torch.Tensor) -> torch.Tensor:
    """[batch, 1, queries, keys]: True where query and key lie in the same document."""
    return (query_documents[:, :, None] == key_documents[:, None, :])[:, None]
