"""The inner attention of a decoder layer: softmax(q k^T * scale) v under the layer's mask, with
optional attention sinks, through the kernel that fits the device and the mask.

Models hold it as the submodule ``attention.inner_attention`` of each block and call it after
projecting, rotating and repeating q, k, v: ``inner_attention(q, k, v, batch)``, where ``batch``
is the step's ``AttentionBatch`` (document ids, FlexAttention block masks built once for every
layer). Layout of q, k, v and of the output: [batch, heads, seq, head_dim]; K/V may have fewer
heads (grouped-query attention: kv_heads dividing heads); the kernels read each K/V head for its
group of query heads, so a context-parallel exchange moves only the fewer K/V heads.

Kernels (``KERNELS``; ``choose_kernel`` decides, the job plan prints the choice):
- "sdpa": ``F.scaled_dot_product_attention(is_causal=True)`` — flash / cuDNN on CUDA, the fused
  CPU kernel — for plain causal attention without sinks;
- "flex": FlexAttention, compiled, with block masks from ``tessera.models.masks`` (CUDA; its
  forward runs on CPU too, which the tests use to prove the GPU's masks);
- "blocked": ``tessera.models.blocked_attention``, exact, memory linear in the sequence (CPU).

Attention sinks (GPT-OSS): a learned logit per head that joins every query's softmax
denominator and adds nothing to the output, so out = out_kernel * sigmoid(lse - sink), from the
kernel's log-sum-exp (the blocked kernel folds this into its own backward). Their state-dict
name is ``<...>.inner_attention.sinks``.

Context parallel (``tessera.cp``) sets ``context_parallel`` on the module: an object with
``kind`` "ring" (``attend(q, k, v)``: exact causal attention over the ranks' shards, no mask or
sink) or "gather" (``gather(k, v, documents)`` -> the whole sequence's K, V and document ids in
index order, and this rank's queries as index runs), so every mask works under context parallel.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from tessera.mesh import repeat_kv_heads
from tessera.models.blocked_attention import blocked_attention, sink_share
from tessera.models.masks import CAUSAL, AttentionMask, mask_function

KERNELS = ("sdpa", "flex", "blocked")

# torch's CPU flash-attention kernel (2.13) is slower in bf16/fp16 than in fp32 when its blocks
# are small. Forward + backward on one thread, [batch, heads, seq, head_dim], fp32 vs bf16:
# (8,16,128,16) 3.2x faster, (8,16,256,16) 1.65x, (8,8,256,32) 1.27x, (8,16,512,16) 1.22x,
# (4,8,512,32) 1.02x, (2,4,512,64) 0.95x, (4,16,1024,16) 0.91x, (2,16,1024,32) 0.82x.
# So on CPU, sequences with seq * head_dim up to this many run in fp32 (more precise, too).
CPU_FP32_MAX_SEQ_TIMES_HEAD_DIM = 8192


def plain_causal(mask: AttentionMask, documents: bool, sinks: bool) -> bool:
    """What the fused causal kernels take (SDPA's, context parallel's ring): causal attention
    alone, with no window, chunk, documents or sinks."""
    return mask.is_plain_causal and not documents and not sinks


def choose_kernel(device_type: str, mask: AttentionMask, documents: bool, sinks: bool) -> str:
    """The kernel for a layer: SDPA's fused kernels where the mask is plain causal and there
    are no sinks; else FlexAttention on CUDA and the blocked kernel elsewhere."""
    if plain_causal(mask, documents, sinks):
        return "sdpa"
    return "flex" if device_type == "cuda" else "blocked"


@dataclasses.dataclass(frozen=True)
class AttentionBatch:
    """What a step's attention needs beyond q, k, v, built once per batch (``attention_batch``)
    and shared by every layer: documents [batch, seq] (None: no document limit) and the
    FlexAttention block mask of each distinct layer mask that runs on the flex kernel."""

    documents: torch.Tensor | None = None
    block_masks: tuple = ()  # ((AttentionMask, BlockMask), ...)

    def block_mask(self, mask: AttentionMask, seq_len: int, device):
        """The block mask built for ``mask``, or (a caller that built no batch) one made now."""
        for candidate, block_mask in self.block_masks:
            if candidate == mask:
                return block_mask
        return _block_mask(mask, self.documents, seq_len, torch.device(device))


class InnerAttention(nn.Module):
    """One layer's attention kernel (see the module docstring).

    mask: what the layer may see (``tessera.models.masks.AttentionMask``). sinks: the number
    of query heads when the layer has attention sinks (a parameter of that many logits, zero at
    init), else None. scale: the softmax scale, default head_dim ** -0.5. ``kernel`` is None
    (chosen per call by ``choose_kernel``) or one of ``KERNELS``, set by a job plan."""

    tp_shard_dims = {"sinks": 0}  # one sink per query head: tensor parallel splits them with the heads

    def __init__(self, mask: AttentionMask = CAUSAL, sinks: int | None = None, scale: float | None = None):
        super().__init__()
        self.mask, self.scale = mask, scale
        self.sinks = nn.Parameter(torch.zeros(sinks)) if sinks else None
        self.kernel: str | None = None
        self.context_parallel = None

    def extra_repr(self) -> str:
        return f"{self.mask.describe()}{', sinks' if self.sinks is not None else ''}"

    def _plain_causal(self, documents: torch.Tensor | None) -> bool:
        return plain_causal(self.mask, documents is not None, self.sinks is not None)

    def _describe(self, documents: torch.Tensor | None) -> str:
        return self.extra_repr() + (" with documents" if documents is not None else "")

    def init_weights(self) -> None:
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)

    def kernel_for(self, device_type: str, documents: bool) -> str:
        if self.kernel is not None and self.kernel not in KERNELS:
            raise ValueError(f"attention kernel {self.kernel!r} is not one of {KERNELS}")
        return self.kernel or choose_kernel(device_type, self.mask, documents, self.sinks is not None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch | None = None) -> torch.Tensor:
        batch = batch or AttentionBatch()
        documents, q_runs = batch.documents, None
        exchange = self.context_parallel
        if exchange is not None and exchange.kind == "ring":
            if not self._plain_causal(documents) or self.scale is not None:
                raise ValueError(f"context parallel's ring runs plain causal attention only, not "
                                 f"{self._describe(documents)}: use the all-gather-KV exchange")
            return exchange.attend(q, k, v)
        if exchange is not None:  # queries in index runs: the blocked kernel takes them as they come
            k, v, documents, q_runs = exchange.gather(k, v, documents)
            kernel = "blocked"
        else:
            kernel = self.kernel_for(q.device.type, documents is not None)
        if kernel == "sdpa":
            if not self._plain_causal(documents):
                raise ValueError(f"the sdpa kernel takes plain causal attention without sinks, not {self._describe(documents)}")
            return _sdpa(q, k, v, self.scale)
        if kernel == "blocked":
            return blocked_attention(q, k, v, self.mask, sinks=self.sinks, documents=documents, q_runs=q_runs, scale=self.scale)
        out, lse = _flex(q, k, v, batch.block_mask(self.mask, q.shape[2], q.device), self.scale)
        return out if self.sinks is None else with_sinks(out, lse, self.sinks)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The output of a softmax whose denominator also holds exp(sink) per head: the kernel's
    output scaled by its share (``blocked_attention.sink_share``)."""
    return (out.float() * sink_share(lse, sinks).unsqueeze(-1)).to(out.dtype)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Short low-precision sequences of small heads on CPU go through the kernel in fp32 (see
    above), the output in the inputs' dtype."""
    small = q.shape[-2] * q.shape[-1] <= CPU_FP32_MAX_SEQ_TIMES_HEAD_DIM
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and small:
        with torch.autocast("cpu", enabled=False):
            return _sdpa(q.float(), k.float(), v.float(), scale).to(q.dtype)
    k, v = repeat_kv_heads(k, q.shape[1]), repeat_kv_heads(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


@functools.cache
def _flex_attention(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention


def _flex(q, k, v, block_mask, scale: float | None):
    """FlexAttention: compiled on CUDA (its fused kernel); eager elsewhere, where only the
    forward exists (the CPU tests of the CUDA path's masks)."""
    from torch.nn.attention.flex_attention import AuxRequest

    flex = _flex_attention(q.device.type == "cuda")
    out, aux = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1],
                    return_aux=AuxRequest(lse=True))
    return out, aux.lse


def inner_attentions(model: nn.Module) -> list[InnerAttention]:
    return [module for module in model.modules() if isinstance(module, InnerAttention)]


def attention_batch(layers: nn.Module, documents: torch.Tensor | None, seq_len: int, device) -> AttentionBatch:
    """The step's AttentionBatch for the inner attentions under ``layers``: one FlexAttention
    block mask per distinct mask of the layers that run on the flex kernel, built here, outside
    any compiled block, and shared by all of them."""
    device = torch.device(device)
    flex_masks = {module.mask for module in inner_attentions(layers)
                  if module.context_parallel is None and module.kernel_for(device.type, documents is not None) == "flex"}
    if not flex_masks:
        return AttentionBatch(documents)
    built = tuple((mask, _block_mask(mask, documents, seq_len, device)) for mask in sorted(flex_masks, key=repr))
    return AttentionBatch(documents, built)


def _block_mask(mask: AttentionMask, documents: torch.Tensor | None, seq_len: int, device: torch.device):
    """FlexAttention's BlockMask of ``mask`` (and documents), built by a compiled kernel on CUDA."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch = documents.shape[0] if documents is not None else None
    return create_block_mask(mask_function(mask, documents), batch, None, seq_len, seq_len, device=device,
                             _compile=device.type == "cuda")
