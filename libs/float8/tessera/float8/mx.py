"""MXFP8 training for linears (torchao.prototype, 0.18): float8 elements with one power-of-two
scale per 32 values, so no amax over a whole tensor. torchao's fast recipes need its triton
kernels on a Blackwell GPU (sm_100, CUDA >= 12.8); `mxfp8_emulated_rceil` computes the same
casts with plain torch ops and runs anywhere, CPU included, for correctness only."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
from torchao.quantization import quantize_

from tessera.float8.options import cuda_capability

MX_RECIPES = tuple(recipe.value for recipe in MXFP8TrainingRecipe)
EMULATED_MX_RECIPES = ("mxfp8_emulated_rceil",)
MIN_MX_CUDA_CAPABILITY = (10, 0)
MX_BLOCK = 32  # values per scale: K, N and the tokens of a batch must be multiples of it


@dataclasses.dataclass(frozen=True)
class MXOptions:
    recipe_name: str = "mxfp8_rceil"
    filter_fqns: tuple[str, ...] = ("output",)  # substring match, as in Float8Options


def check_mx_options(options: MXOptions, device: str | torch.device = "cpu") -> MXOptions:
    """Returns `options` if torchao can run them on `device`, else ValueError naming the key
    (the GPU's compute capability only where this host has CUDA)."""
    if options.recipe_name not in MX_RECIPES:
        raise ValueError(f"mx recipe_name {options.recipe_name!r} is not one of {list(MX_RECIPES)}")
    if options.recipe_name in EMULATED_MX_RECIPES:
        return options
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(
            f"mx recipe_name {options.recipe_name!r} needs torchao's triton kernels on a CUDA GPU; "
            f"on {device.type} use one of {list(EMULATED_MX_RECIPES)}"
        )
    capability = cuda_capability(device)
    if capability is not None and capability < MIN_MX_CUDA_CAPABILITY:
        raise ValueError(
            f"mx recipe_name {options.recipe_name!r} needs a GPU of compute capability >= 10.0 (Blackwell), "
            f"this one is {'.'.join(map(str, capability))}; use one of {list(EMULATED_MX_RECIPES)} to emulate"
        )
    return options


def mx_selected(fqn: str, module: nn.Module, options: MXOptions) -> bool:
    """Plain, bias-free nn.Linear, not filtered, with K and N multiples of the 32-value block."""
    return (
        type(module) is nn.Linear
        # torchao wraps every parameter of a selected module; a wrapped bias gets no gradient
        # (grad None, measured with torchao 0.18)
        and module.bias is None
        and not any(name in fqn for name in options.filter_fqns)
        and all(size % MX_BLOCK == 0 for size in module.weight.shape)
    )


def convert_mx(model: nn.Module, options: MXOptions) -> list[str]:
    """Wraps, in place, the weights of the linears `mx_selected` keeps in torchao's MXFP8
    training tensor (its matmuls quantise both operands per block); returns their names."""
    converted: list[str] = []

    def keep(module: nn.Module, fqn: str) -> bool:
        if mx_selected(fqn, module, options):
            converted.append(fqn)
            return True
        return False

    quantize_(model, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(options.recipe_name)), filter_fn=keep)
    return converted
