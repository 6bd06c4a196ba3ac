"""What a GPU run's kernels keep for backward, reproduced on the CPU fake tensors the trace runs.

On CUDA, `F.rms_norm` runs torch's fused kernel (`aten._fused_rms_norm`), whose autograd node keeps
the input, the weight and the fp32 rstd (T·4 bytes). On CPU tensors, fake ones included, the same
call runs torch's composite instead, which keeps more (its fp32 upcast and the normalized input
before the weight), and `tessera.models.rms_norm.RMSNorm` takes its CPU path (the normalized input in
fp32). So a trace of a "cuda" plan gives every `nn.RMSNorm` (tessera's subclass included) the fused
kernel's saved tensors: `fused_rms_norms`. Both aten ops have fake-tensor and DTensor rules, so
tensor-parallel norms keep their placements.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.tensor import DTensor


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
