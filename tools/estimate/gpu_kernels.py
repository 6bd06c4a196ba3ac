"""What a GPU run's kernels keep for backward, reproduced on the CPU fake tensors the trace runs.

On CUDA, `F.rms_norm` runs torch's fused kernel (`aten._fused_rms_norm`), whose autograd node keeps
the input, the weight and the fp32 rstd (T·4 bytes). On CPU tensors, fake ones included, the same
call runs torch's composite instead, which keeps more (its fp32 upcast and the normalized input
before the weight), and `tessera.models.rms_norm.RMSNorm` takes its CPU path (the normalized input in
fp32). So a trace of a "cuda" plan gives every `nn.RMSNorm` (tessera's subclass included) the fused
kernel's saved tensors: `fused_rms_norms`. Both aten ops have fake-tensor and DTensor rules, so
tensor-parallel norms keep their placements.

Masked layers (windows, chunks, sinks, documents) run FlexAttention on CUDA, which has no CPU
backward; the CPU's blocked kernel keeps the same tensors but walks the queries in blocks, a
hundred fake calls a layer at seq 4096 (nine tenths of a GPT-OSS trace). So a "cuda" plan's flex layers
get their kernel back (`flex_attentions`) and run, under `flex_kept`, FlexAttention's autograd
node as far as memory goes (it keeps q, k, v unrepeated, its output and the fp32 log-sum-exp):
no blocks, no values. It traces the blocked kernel's bytes (but for the sinks, whose share the
blocked kernel folds into its output and FlexAttention's caller computes after it: a few KB
more) in a tenth of its time.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.models import attention as attention_module
from tessera.models.attention import inner_attentions
from tessera.trainer.sub_plans import AttentionPlan


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        out, rstd = torch.ops.aten._fused_rms_norm(x, normalized_shape, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.normalized_shape = normalized_shape
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = torch.ops.aten._fused_rms_norm_backward(
            grad, x, ctx.normalized_shape, rstd, weight, [True, weight is not None])
        return grad_x, None, grad_weight, None


def _fused_forward(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    weight = norm.weight
    if isinstance(weight, DTensor) and not isinstance(x, DTensor):  # a tessera.tp LocalShards norm (Qwen3's q/k norms)
        weight = weight.to_local()
    return _FusedRMSNorm.apply(x, list(norm.normalized_shape), weight, norm.eps)


def fused_rms_norms(module: nn.Module) -> None:
    """Every `nn.RMSNorm` in `module` keeps, from here on, what CUDA's fused kernel keeps."""
    for m in module.modules():
        if isinstance(m, nn.RMSNorm):
            m.forward = types.MethodType(_fused_forward, m)


class _FlexAttention(torch.autograd.Function):
    """(out, lse) of torch's FlexAttention without its values: what its autograd node keeps
    (q, k, v, out, lse) and what its backward returns (dq, dk, dv)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def flex_attentions(module: nn.Module, attention: AttentionPlan) -> None:
    """Every inner attention in `module` that `attention` (a "cuda" plan's) runs on FlexAttention
    gets that kernel back from the CPU plan's blocked one; under `flex_kept` it keeps what
    FlexAttention keeps."""
    for inner in inner_attentions(module):
        if attention.kernel(inner.mask, inner.sinks is not None) == "flex":
            inner.kernel = "flex"


@contextlib.contextmanager
def flex_kept():
    """tessera.models' FlexAttention call as `_FlexAttention`, and no block masks (a few KB on a
    GPU, a [seq, seq] mask evaluated on a CPU): module globals, as the layers' own forwards run
    (tensor parallel's local-shard wrappers included)."""
    flex, block_mask = attention_module._flex, attention_module._block_mask
    attention_module._flex = lambda q, k, v, block_mask, scale: _FlexAttention.apply(q, k, v)
    attention_module._block_mask = lambda mask, documents, seq_len, device: None
    try:
        yield
    finally:
        attention_module._flex, attention_module._block_mask = flex, block_mask
