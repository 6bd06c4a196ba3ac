"""Exact masked attention whose memory grows with the sequence, not its square: the CPU kernel
for every mask the fused kernels cannot take whole (documents, windows, chunks, sinks), and the
kernel of context parallel's all-gather-KV exchange.

FlexAttention has no CPU backward (torch 2.13) and SDPA with a boolean mask needs the
[seq, seq] mask itself, so this kernel walks the queries in blocks. Each block attends to the
keys it may reach (``masks.key_range``; with documents, also from the first query's document
start) under a mask made from the layer's mask function (the one FlexAttention gets on CUDA),
through torch's fused CPU flash kernel, which takes a mask and returns the log-sum-exp; on
other devices, and for value heads narrower than the query's (MLA), through plain PyTorch ops. Only the output and the log-sum-exp per query are
kept; backward remakes each block's mask and calls the kernel's backward (or recomputes the
probabilities, FlashAttention's Alg. 2: dS = P * (dP - delta), delta_i = do_i . o_i).

Attention sinks (a logit per head in every softmax denominator, no value): with
sigma = sigmoid(lse - sink) the output is sigma * o. The same backward gives its gradients when
handed grad_out * sigma and the output sigma * o (then dS = sigma P * (dO V^T - delta') exactly,
delta' over the sunk softmax), and d sink = -sum (1 - sigma) (dO . out).

Blocks follow the shapes (query runs, window, chunk); only the document start is read from
the data, and not while compiling, so a compiled block traces once.

Layouts: q [batch, heads, queries, dim], k [batch, kv_heads, keys, dim], v [batch, kv_heads,
keys, dim_v]; query head h reads K/V head h // (heads // kv_heads). Key j has index j;
queries are given as runs (start index, count) of consecutive indices.
"""

from __future__ import annotations

import torch

from tessera.mesh import fold_kv_heads, repeat_kv_heads
from tessera.models.masks import AttentionMask, key_range, mask_function

# Elements per block of scores (batch x heads x rows x keys): bounds the memory a block holds.
BLOCK_ELEMENTS = 1 << 24
MIN_ROWS, MAX_ROWS = 16, 1024
FUSED_DEVICES = ("cpu",)  # where torch's flash kernel takes a mask and returns the log-sum-exp
aten = torch.ops.aten


def _fused(q: torch.Tensor, v: torch.Tensor) -> bool:
    """The flash kernel takes one head size for q, k and v (MLA's value heads are narrower)."""
    return q.device.type in FUSED_DEVICES and q.shape[-1] == v.shape[-1]


def query_blocks(mask: AttentionMask, q_runs: tuple[tuple[int, int], ...], rows: int) -> list[tuple[int, int, int, int, int]]:
    """(first row, end row, first query index, first key, end key) of each block of at most
    ``rows`` consecutive queries; blocks never straddle two runs."""
    blocks, row = [], 0
    for start, count in q_runs:
        for offset in range(0, count, rows):
            n = min(rows, count - offset)
            lo, hi = key_range(mask, start + offset, start + offset + n)
            blocks.append((row + offset, row + offset + n, start + offset, lo, hi))
        row += count
    return blocks


def _skip_to_documents(blocks: list, documents: torch.Tensor | None) -> list:
    """Blocks whose keys start no earlier than the first query's document, when the ids count
    documents (never decrease along a row): one host read, outside compiled code only."""
    if documents is None or torch.compiler.is_compiling() or not _readable(documents) \
            or not bool((documents.diff(dim=1) >= 0).all()):
        return blocks
    firsts = torch.tensor([q_start for _, _, q_start, _, _ in blocks], device=documents.device)
    starts = torch.searchsorted(documents.contiguous(), documents[:, firsts].contiguous()).amin(dim=0).tolist()
    return [(r0, r1, q, max(lo, start), hi) for (r0, r1, q, lo, hi), start in zip(blocks, starts)]


def _readable(documents: torch.Tensor) -> bool:
    """Real CPU values: reading them costs no device sync, and fake tensors (tools/estimate's
    traces) have none."""
    return documents.device.type == "cpu" and not isinstance(documents, torch._subclasses.FakeTensor)


def _rows_per_block(q: torch.Tensor, keys: int) -> int:
    batch, heads = q.shape[:2]
    return max(MIN_ROWS, min(MAX_ROWS, BLOCK_ELEMENTS // max(1, batch * heads * keys)))


def _block_mask(mask_mod, batch: int, q_start: int, n: int, lo: int, hi: int, dtype, device) -> torch.Tensor:
    """[batch or 1, 1, n, hi - lo] additive mask (0 where visible, -inf elsewhere) of one block."""
    b = torch.arange(batch, device=device).view(-1, 1, 1)
    q_idx = torch.arange(q_start, q_start + n, device=device).view(1, -1, 1)
    kv_idx = torch.arange(lo, hi, device=device).view(1, 1, -1)
    visible = mask_mod(b, 0, q_idx, kv_idx)[:, None]
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))


def _forward_block(q, k, v, bias, scale):
    """(out, lse [.., rows] fp32) of one block: CPU's fused flash kernel, else PyTorch ops."""
    if _fused(q, v):
        return aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse.unsqueeze(-1)) @ v.float()).to(q.dtype), lse


def _backward_block(grad_out, q, k, v, out, lse, bias, scale):
    if _fused(q, v):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            grad_out.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale)
    q32, k32, v32, do = q.float(), k.float(), v.float(), grad_out.float()
    p = torch.exp((q32 @ k32.transpose(-1, -2)) * scale + bias.float() - lse.unsqueeze(-1))
    ds = p * (do @ v32.transpose(-1, -2) - (do * out.float()).sum(-1, keepdim=True))
    return ((ds @ k32) * scale).to(q.dtype), ((ds.transpose(-1, -2) @ q32) * scale).to(k.dtype), (p.transpose(-1, -2) @ do).to(v.dtype)


def sink_share(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """[batch, heads, queries]: each query's softmax mass on its keys once its head's sink joins
    the denominator, sum(exp(scores)) / (sum(exp(scores)) + exp(sink)) = sigmoid(lse - sink)."""
    return torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))


def _block_operands(blocks, mask_mod, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Per block: its rows, first key, its mask, and its keys and values repeated to the query heads."""
    batch, heads = q.shape[:2]
    for r0, r1, q_start, lo, hi in blocks:
        bias = _block_mask(mask_mod, batch, q_start, r1 - r0, lo, hi, q.dtype, q.device)
        yield r0, r1, lo, hi, bias, repeat_kv_heads(k[:, :, lo:hi], heads), repeat_kv_heads(v[:, :, lo:hi], heads)


class _BlockedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, documents, mask: AttentionMask, q_runs, scale: float):
        batch, heads, queries, _ = q.shape
        mask_mod = mask_function(mask, documents)
        blocks = _skip_to_documents(query_blocks(mask, q_runs, _rows_per_block(q, k.shape[2])), documents)
        out = q.new_empty(batch, heads, queries, v.shape[-1])
        lse = q.new_empty(batch, heads, queries, dtype=torch.float32)
        for r0, r1, _, _, bias, k_block, v_block in _block_operands(blocks, mask_mod, q, k, v):
            out[:, :, r0:r1], lse[:, :, r0:r1] = _forward_block(q[:, :, r0:r1], k_block, v_block, bias, scale)
        if sinks is not None:
            out = (out.float() * sink_share(lse, sinks).unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, documents, out, lse)
        ctx.mask, ctx.scale, ctx.blocks = mask, scale, blocks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sinks, documents, out, lse = ctx.saved_tensors
        kv_heads, scale = k.shape[1], ctx.scale
        grad_sinks = None
        if sinks is not None:
            sigma = sink_share(lse, sinks)
            grad_sinks = -((1 - sigma) * (grad_out.float() * out.float()).sum(-1)).sum(dim=(0, 2)).to(sinks.dtype)
            grad_out = (grad_out.float() * sigma.unsqueeze(-1)).to(grad_out.dtype)
        mask_mod = mask_function(ctx.mask, documents)
        dq, dk, dv = torch.zeros_like(q), torch.zeros(k.shape, dtype=torch.float32, device=k.device), \
            torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for r0, r1, lo, hi, bias, k_block, v_block in _block_operands(ctx.blocks, mask_mod, q, k, v):
            dq_block, dk_block, dv_block = _backward_block(
                grad_out[:, :, r0:r1], q[:, :, r0:r1], k_block, v_block, out[:, :, r0:r1], lse[:, :, r0:r1], bias, scale)
            dq[:, :, r0:r1] = dq_block
            dk[:, :, lo:hi] += fold_kv_heads(dk_block.float(), kv_heads)
            dv[:, :, lo:hi] += fold_kv_heads(dv_block.float(), kv_heads)
        return dq, dk.to(k.dtype), dv.to(v.dtype), grad_sinks, None, None, None, None


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, *,
                      sinks: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                      q_runs: tuple[tuple[int, int], ...] | None = None, scale: float | None = None) -> torch.Tensor:
    """out [batch, heads, queries, dim_v] in q's dtype, differentiable in q, k, v and sinks.
    sinks: [heads] logits, or None. documents: [batch, keys] document ids by key index (queries
    look theirs up by their own index), or None. q_runs: the queries' indices as runs (start,
    count); default: the last ``queries`` keys, one run."""
    queries, keys = q.shape[2], k.shape[2]
    q_runs = q_runs if q_runs is not None else ((keys - queries, queries),)
    if sum(count for _, count in q_runs) != queries:
        raise ValueError(f"query runs {q_runs} do not cover the {queries} queries")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _BlockedAttention.apply(q, k, v, sinks, documents, mask, tuple(q_runs), scale)
