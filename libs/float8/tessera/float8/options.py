"""Float8 training options and their checks. The checks run in the job plan, before any worker
starts, so a bad value ends the run once with one line naming the key."""

from __future__ import annotations

import dataclasses

import torch
from torchao.float8 import Float8LinearConfig, Float8LinearRecipeName

RECIPES = tuple(recipe.value for recipe in Float8LinearRecipeName)  # tensorwise, rowwise, rowwise_with_gw_hp

# float8 matmuls (torch._scaled_mm) need Ada (sm_89) or Hopper and newer.
MIN_CUDA_CAPABILITY = (8, 9)


@dataclasses.dataclass(frozen=True)
class Float8Options:
    recipe_name: str = "tensorwise"
    # A linear whose fully-qualified name contains any of these is skipped (substring match, as
    # torchao's and torchtitan's filters do); the output projection by default.
    filter_fqns: tuple[str, ...] = ("output",)
    auto_filter_small_kn: bool = True  # skip linears too small to gain (tessera.float8.size_filter)
    emulate: bool = False  # float8 casts, high-precision matmuls: for tests and GPUs before sm_89
    enable_fsdp_float8_all_gather: bool = False  # FSDP2 all-gathers float8 weights (tensorwise only)
    precompute_float8_dynamic_scale_for_fsdp: bool = False  # one all-reduce for all weight scales per step

    def torchao_config(self) -> Float8LinearConfig:
        """torchao's config for the recipe with this run's switches."""
        return dataclasses.replace(
            Float8LinearConfig.from_recipe_name(self.recipe_name),
            emulate=self.emulate,
            enable_fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather,
        )


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of CUDA `device`, or None on a host without CUDA: options checked
    there for a cluster's GPUs (a plan made on a login node) pass what only the GPU can tell."""
    return torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None


def check_options(options: Float8Options, device: str | torch.device = "cpu") -> Float8Options:
    """Returns `options` if they can run on `device`, else raises ValueError naming the key
    (the GPU's compute capability only where this host has CUDA)."""
    if options.recipe_name not in RECIPES:
        raise ValueError(f"float8 recipe_name {options.recipe_name!r} is not one of {list(RECIPES)}")
    if options.enable_fsdp_float8_all_gather and options.recipe_name != "tensorwise":
        raise ValueError(
            f"float8 enable_fsdp_float8_all_gather needs recipe_name 'tensorwise', not {options.recipe_name!r}: "
            "the all-gathered float8 weight carries one scale per tensor"
        )
    if options.precompute_float8_dynamic_scale_for_fsdp and not options.enable_fsdp_float8_all_gather:
        raise ValueError(
            "float8 precompute_float8_dynamic_scale_for_fsdp needs enable_fsdp_float8_all_gather: "
            "it precomputes the scales of float8-all-gathered weights"
        )
    device = torch.device(device)
    if device.type == "cuda" and not options.emulate:
        capability = cuda_capability(device)
        if capability is not None and capability < MIN_CUDA_CAPABILITY:
            raise ValueError(
                f"float8 needs a GPU of compute capability >= {'.'.join(map(str, MIN_CUDA_CAPABILITY))}, "
                f"this one is {'.'.join(map(str, capability))}: set emulate = true to run it emulated"
            )
    return options
