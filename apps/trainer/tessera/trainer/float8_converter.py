"""The float8 model converters, registered as "float8" (torchtitan 0.1.x's name, reading the
[float8] section) and "quantize.linear.float8" (torchtitan 0.2.x's, reading
[quantize.linear.float8], the same keys), the MXFP8 one, "quantize.linear.mx"
([quantize.linear.mx]), and the MoE experts' grouped-GEMM ones, "quantize.grouped_mm.float8" and
"quantize.grouped_mm.mx" (their sections). Each converter's name is the dotted name of its table.
Importing this module registers them, and the tables' keys are declared here, beside the code
that reads them; tessera.trainer.config puts the tables in its JobConfig.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

from tessera.trainer.converters import ModelConverter, converter_sections, register_converter
from tessera.trainer.errors import ConfigError
from tessera.trainer.schema import get_key, key, table

if TYPE_CHECKING:  # for annotations only: the config imports this module
    from tessera.float8 import Float8Options
    from tessera.mesh import ParallelDims
    from tessera.trainer.config import JobConfig

LINEAR_FLOAT8 = "quantize.linear.float8"  # torchtitan 0.2's converter and table name
# In filter_fqns, torchtitan's switch for the size rule (tessera.float8.size_filter), not a name.
AUTO_FILTER_FLAG = "auto_filter_small_kn"


@dataclasses.dataclass
class Float8:
    enable_fsdp_float8_all_gather: bool = key(False, "FSDP all-gathers float8 weights (tensorwise recipe)")
    precompute_float8_dynamic_scale_for_fsdp: bool = key(
        False, "one all-reduce computes every weight's float8 scale after the optimizer step")
    recipe_name: str | None = key(None, "unset (tensorwise), rowwise or rowwise_with_gw_hp")
    filter_fqns: list[str] = key(
        [], f"linears whose name contains one of these stay high precision; {AUTO_FILTER_FLAG}: also small ones")
    emulate: bool = key(False, "float8 arithmetic emulated in high precision (CPU, older GPUs)")


@dataclasses.dataclass
class MX:
    """[quantize.linear.mx]: MXFP8 linears through torchao (tessera.float8.MX_RECIPES)."""

    recipe_name: str = key("mxfp8_rceil", "MXFP8 recipe of torchao (mxfp8_rceil, ...; mxfp8_emulated_rceil on CPU)")
    filter_fqns: list[str] = key(["output"], "linears whose name contains one of these stay high precision")
    mxfp8_dim1_cast_kernel_choice: str = key(
        "triton", "kernel for MXFP8's column-wise cast: triton, cuda or torch", choices=("triton", "cuda", "torch"),
        refused="torchao 0.18's MXFP8 training config chooses the cast kernel itself")


@dataclasses.dataclass
class QuantizedLinear:
    float8: Float8 = table(Float8)  # torchtitan 0.2's home of the [float8] keys
    mx: MX = table(MX)


@dataclasses.dataclass
class GroupedMMFloat8:
    fqns: list[str] = key(
        [], "MoE modules (name contains one, e.g. experts) whose grouped GEMMs run in float8 rowwise (CUDA sm_90+, bf16)")


@dataclasses.dataclass
class GroupedMMMX:
    recipe_name: str = key(
        "mxfp8", "MXFP8 recipe of MoE grouped GEMMs: mxfp8 (= mxfp8_rceil, sm_100), ...; mxfp8_emulated_rceil on CPU")
    fqns: list[str] = key([], "MoE modules (name contains one, e.g. experts) whose grouped GEMMs run in MXFP8 (bf16)")


@dataclasses.dataclass
class QuantizedGroupedMM:
    """[quantize.grouped_mm.*]: low-precision expert GEMMs of MoE models."""

    float8: GroupedMMFloat8 = table(GroupedMMFloat8)
    mx: GroupedMMMX = table(GroupedMMMX)


@dataclasses.dataclass
class Quantize:
    linear: QuantizedLinear = table(QuantizedLinear)
    grouped_mm: QuantizedGroupedMM = table(QuantizedGroupedMM)


def _section(config: JobConfig, name: str) -> tuple[str, Any]:
    """The dotted name of the table converter `name` reads, and that table of `config`."""
    section = LINEAR_FLOAT8 if name == "float8" and float8_reads_linear_table(config) else converter_sections()[name]
    return section, get_key(config, section)


def float8_reads_linear_table(config: JobConfig) -> bool:
    """Whether "float8" (torchtitan 0.1's converter, reading [float8]) reads [quantize.linear.float8]
    instead: [float8] left unset, that table set, its own converter not listed. torchtitan 0.2.2's
    llama3_405b.toml lists "float8" with its settings there (output left out, float8 all-gathers)."""
    return (config.float8 == Float8() and config.quantize.linear.float8 != Float8()
            and LINEAR_FLOAT8 not in config.model.converters)


def float8_options(config: JobConfig, dims: ParallelDims, device: str, name: str = "float8") -> Float8Options:
    """The float8 keys of converter `name`'s section as tessera.float8 options for this layout on
    `device`; ConfigError naming the key when they cannot run there (checked once, in the job plan)."""
    # Imported here: torchao takes seconds to import, which only runs that use float8 should pay.
    from tessera import float8

    path, section = _section(config, name)
    options = float8.Float8Options(
        recipe_name=section.recipe_name or "tensorwise",  # "" (torchtitan: None) = torchao's default recipe
        filter_fqns=tuple(name for name in section.filter_fqns if name != AUTO_FILTER_FLAG),
        auto_filter_small_kn=AUTO_FILTER_FLAG in section.filter_fqns,
        # On CPU the float8 matmul itself is always emulated (the casts and scales stay float8's):
        # torch's CPU _scaled_mm is a reference kernel on many CPUs, measured 1,000x an fp32 matmul
        # of the same 64x256x256 shape, so the same run took minutes or seconds by machine.
        emulate=section.emulate or device == "cpu",
        enable_fsdp_float8_all_gather=section.enable_fsdp_float8_all_gather,
        precompute_float8_dynamic_scale_for_fsdp=section.precompute_float8_dynamic_scale_for_fsdp,
    )
    try:
        float8.check_options(options, device)
    except ValueError as e:
        raise ConfigError(f"config section [{path}]: {e}") from None
    if dims.fsdp_enabled:
        return options
    # Like torchtitan: the FSDP-only switches are dropped where there is no FSDP, so one config
    # serves every layout.
    return dataclasses.replace(
        options, enable_fsdp_float8_all_gather=False, precompute_float8_dynamic_scale_for_fsdp=False,
    )


def _factory(name: str, config: JobConfig, dims: ParallelDims, device: str) -> ModelConverter:
    from tessera import float8

    options = float8_options(config, dims, device, name)
    return ModelConverter(
        name=name,
        convert=functools.partial(float8.convert, options=options),
        tp_styles=float8.tp_styles(options),
        post_optimizer_hooks=float8.post_optimizer_hooks(options), options=options,
        selects=functools.partial(float8.selected, options=options),
        patterns=(f"{_section(config, name)[0]}.filter_fqns", options.filter_fqns),
        selects_by_name=functools.partial(float8.selected, options=dataclasses.replace(options, auto_filter_small_kn=False)),
    )


def _mx_factory(name: str, config: JobConfig, dims: ParallelDims, device: str) -> ModelConverter:
    from tessera import float8

    path, section = _section(config, name)
    options = float8.MXOptions(recipe_name=section.recipe_name, filter_fqns=tuple(section.filter_fqns))
    try:
        float8.check_mx_options(options, device)
    except ValueError as e:
        raise ConfigError(f"config section [{path}]: {e}") from None
    if dims.tp_enabled:  # torchao 0.18 has no MX tensor-parallel styles
        raise ConfigError(f"model.converters {name} with tensor_parallel_degree > 1 is not supported")
    return ModelConverter(name=name, convert=functools.partial(float8.convert_mx, options=options),
                          selects=functools.partial(float8.mx_selected, options=options),
                          patterns=(f"{path}.filter_fqns", options.filter_fqns))


def _grouped_factory(name: str, config: JobConfig, dims: ParallelDims, device: str) -> ModelConverter:
    """The experts' weights are wrapped before expert parallel and FSDP shard them on dim 0
    (torchtitan's order); layouts no test here has proven are refused."""
    from tessera import float8

    path, section = _section(config, name)
    # [quantize.grouped_mm.float8] has no recipe_name: torchao has one float8 grouped recipe
    recipe = getattr(section, "recipe_name", float8.FLOAT8_ROWWISE)
    options = float8.GroupedMMOptions(recipe_name=recipe, fqns=tuple(section.fqns))
    try:
        float8.check_grouped_mm_options(options, device)
    except ValueError as e:
        raise ConfigError(f"config section [{path}]: {e}") from None
    for degree_key, degree in (("tensor_parallel_degree", dims.tp), ("pipeline_parallel_degree", dims.pp),
                               ("context_parallel_degree", dims.cp), ("data_parallel_replicate_degree", dims.dp_replicate)):
        if degree > 1:
            raise ConfigError(f"model.converters {name} with parallelism.{degree_key} {degree} is not supported yet "
                              "(expert parallel and FSDP are)")
    if config.compile.enable and "model" in config.compile.components:
        # measured: inductor fails on torchao 0.18's emulated MXFP8 grouped GEMM on CPU (an index
        # assertion); no CUDA run has proven it either
        raise ConfigError(f"model.converters {name} with compile.enable (model) is not supported yet: run it eager")
    # The experts' weights in compute: FSDP casts them to mixed_precision_param, autocast leaves
    # them as stored. fp32 ones take the per-expert loop, which would bypass the quantised GEMMs.
    dtype_key = "mixed_precision_param" if dims.fsdp_enabled else "dtype"
    if getattr(config.training, dtype_key) != "bfloat16":
        raise ConfigError(f"model.converters {name} needs bfloat16 experts for torch's grouped GEMMs: set training.{dtype_key} "
                          f"bfloat16{' (FSDP computes in it)' if dims.fsdp_enabled else ''}")
    return ModelConverter(name=name, convert=functools.partial(float8.convert_grouped_mm, options=options),
                          selects=functools.partial(float8.grouped_mm_selected, options=options),
                          patterns=(f"{path}.fqns", options.fqns))


# Each converter reads the table of its own name; [float8] is torchtitan 0.1's name of [quantize.linear.float8].
for _name, _factory_of in (("float8", _factory), (LINEAR_FLOAT8, _factory), ("quantize.linear.mx", _mx_factory),
                           ("quantize.grouped_mm.float8", _grouped_factory), ("quantize.grouped_mm.mx", _grouped_factory)):
    register_converter(_name, functools.partial(_factory_of, _name), section=_name)
