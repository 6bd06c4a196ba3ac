"""Low-precision grouped GEMMs for MoE experts (torchao 0.18's prototype.moe_training): the
stacked expert weights of the selected modules are wrapped in torchao's training tensor, which
takes over `torch._grouped_mm` (2-D tokens x 3-D weights with group offsets), quantises both
operands on the fly and runs a scaled grouped GEMM; weights, gradients and optimizer state stay
in high precision. Everything else the weights take part in runs as before.

The caller's expert module must reach `torch._grouped_mm` with bfloat16 weights (a loop over
experts indexes the weights, which drops the wrapper and silently computes in high precision),
and must start each expert's group of tokens at a multiple of the module's
`token_group_alignment`, which `convert_grouped_mm` sets (tessera.models' GroupedExperts does
both, see its docstring).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torchao.prototype.moe_training.config import (
    Float8TrainingOpConfig,
    MXFP8TrainingOpConfig,
    MXFP8TrainingRecipe,
)
from torchao.quantization import quantize_

from tessera.float8.mx import MX_BLOCK, MX_RECIPES, MXOptions, check_mx_options
from tessera.float8.options import cuda_capability

FLOAT8_ROWWISE = "fp8_rowwise"  # torchao's only float8 grouped recipe: one scale per row
MX_ALIASES = {"mxfp8": "mxfp8_rceil"}  # torchtitan 0.2's recipe name -> torchao 0.18's
GROUPED_RECIPES = (FLOAT8_ROWWISE, *MX_ALIASES, *MX_RECIPES)
# torch's grouped GEMMs on CUDA: torch._scaled_grouped_mm (float8 rowwise; torchao has no
# emulated float8 grouped GEMM) and torch._grouped_mm (what the emulated MXFP8 recipe runs after
# dequantising, and the only path on which the experts reach the wrapper) need Hopper or newer.
MIN_GROUPED_CAPABILITY = (9, 0)
FLOAT8_BLOCK = 16  # float8 grouped GEMM: 16-byte aligned rows and token groups


@dataclasses.dataclass(frozen=True)
class GroupedMMOptions:
    recipe_name: str = FLOAT8_ROWWISE  # one of GROUPED_RECIPES
    # A module whose fully-qualified name contains one of these has its stacked (3-D) expert
    # weights converted (substring match, as torchao's and torchtitan's filters do).
    fqns: tuple[str, ...] = ("experts",)

    @property
    def block(self) -> int:
        """What the expert dims and each token group must be multiples of."""
        return FLOAT8_BLOCK if self.recipe_name == FLOAT8_ROWWISE else MX_BLOCK

    @property
    def torchao_recipe(self) -> str:
        return MX_ALIASES.get(self.recipe_name, self.recipe_name)

    def torchao_config(self) -> Float8TrainingOpConfig | MXFP8TrainingOpConfig:
        if self.recipe_name == FLOAT8_ROWWISE:
            return Float8TrainingOpConfig()
        return MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(self.torchao_recipe))


def check_grouped_mm_options(options: GroupedMMOptions, device: str | torch.device = "cpu") -> GroupedMMOptions:
    """Returns `options` if torchao can run them on `device`, else ValueError naming the key
    (the GPU's compute capability only where this host has CUDA)."""
    if options.recipe_name not in GROUPED_RECIPES:
        raise ValueError(f"grouped_mm recipe_name {options.recipe_name!r} is not one of {list(GROUPED_RECIPES)}")
    if not options.fqns:
        raise ValueError("grouped_mm fqns is empty: name the MoE modules to convert (e.g. ['experts'])")
    device = torch.device(device)
    if options.recipe_name != FLOAT8_ROWWISE:
        check_mx_options(MXOptions(recipe_name=options.torchao_recipe), device)
    elif device.type != "cuda":
        raise ValueError(
            f"float8 grouped GEMMs (torch._scaled_grouped_mm, torchao's triton casts) need a CUDA GPU of compute "
            f"capability >= 9.0 and have no emulated mode; on {device.type} the MXFP8 recipe 'mxfp8_emulated_rceil' runs"
        )
    capability = cuda_capability(device) if device.type == "cuda" else None
    if capability is not None and capability < MIN_GROUPED_CAPABILITY:
        raise ValueError(
            f"grouped_mm recipe_name {options.recipe_name!r} needs a GPU of compute capability >= 9.0 (torch's grouped "
            f"GEMMs), this one is {'.'.join(map(str, capability))}"
        )
    return options


def grouped_mm_selected(fqn: str, module: nn.Module, options: GroupedMMOptions) -> bool:
    """A module named by `fqns` whose own parameters are all stacked expert weights (3-D): the
    routed experts, not a shared expert's or the router's linears, which torchao would
    otherwise wrap too."""
    params = list(module.parameters(recurse=False))
    return bool(params) and all(p.ndim == 3 for p in params) and any(name in fqn for name in options.fqns)


def convert_grouped_mm(model: nn.Module, options: GroupedMMOptions) -> list[str]:
    """Wraps, in place, the 3-D weights of the modules `grouped_mm_selected` keeps in torchao's
    training tensor and sets their `token_group_alignment` to the recipe's block; returns their
    names. ValueError if an expert dim is not a multiple of the block. Run it on the plain model,
    before expert parallel and FSDP (both keep the wrapper); a meta-device model works."""
    converted: list[str] = []

    def keep(module: nn.Module, fqn: str) -> bool:
        if not grouped_mm_selected(fqn, module, options):
            return False
        for name, param in module.named_parameters(recurse=False):
            if param.shape[1] % options.block or param.shape[2] % options.block:
                raise ValueError(f"grouped_mm {options.recipe_name}: {fqn}.{name} {tuple(param.shape)} needs its last two "
                                 f"dims in multiples of {options.block}")
        converted.append(fqn)
        module.token_group_alignment = options.block
        return True

    quantize_(model, options.torchao_config(), filter_fn=keep)
    return converted
