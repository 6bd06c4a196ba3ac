"""The float8 model converters, registered as "float8" (torchtitan 0.1.x's name, reading the
[float8] section) and "quantize.linear.float8" (torchtitan 0.2.x's, reading
[quantize.linear.float8], the same keys), the MXFP8 one, "quantize.linear.mx"
([quantize.linear.mx]), and the MoE experts' grouped-GEMM ones, "quantize.grouped_mm.float8" and
"quantize.grouped_mm.mx" (their sections). Importing this module registers them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from tessera.mesh import device_type
from tessera.trainer.converters import ModelConverter, register_converter

if TYPE_CHECKING:
    from tessera.float8 import Float8Options
    from tessera.mesh import ParallelDims
    from tessera.trainer.config import JobConfig

# In filter_fqns, torchtitan's switch for the size rule (tessera.float8.size_filter), not a name.
AUTO_FILTER_FLAG = "auto_filter_small_kn"
# converter name -> the config table it reads
SECTIONS = {"float8": ("float8",), "quantize.linear.float8": ("quantize", "linear", "float8")}
MX_NAME, MX_SECTION = "quantize.linear.mx", ("quantize", "linear", "mx")
GROUPED_SECTIONS = {f"quantize.grouped_mm.{kind}": ("quantize", "grouped_mm", kind) for kind in ("float8", "mx")}


def section_of(config: JobConfig, path: tuple[str, ...]):
    return functools.reduce(getattr, path, config)


def float8_options(config: JobConfig, dims: ParallelDims, name: str = "float8") -> Float8Options:
    """The float8 keys of converter `name`'s section as tessera.float8 options for this layout;
    ConfigError naming the key when they cannot run here (checked once, in the job plan)."""
    # Imported here: config imports this module to register the names, and torchao takes
    # seconds to import, which only runs that use float8 should pay.
    from tessera import float8
    from tessera.trainer.config import ConfigError

    section = section_of(config, SECTIONS[name])
    options = float8.Float8Options(
        recipe_name=section.recipe_name or "tensorwise",  # "" (torchtitan: None) = torchao's default recipe
        filter_fqns=tuple(name for name in section.filter_fqns if name != AUTO_FILTER_FLAG),
        auto_filter_small_kn=AUTO_FILTER_FLAG in section.filter_fqns,
        # On CPU the float8 matmul itself is always emulated (the casts and scales stay float8's):
        # torch's CPU _scaled_mm is a reference kernel on many CPUs, measured 1,000x an fp32 matmul
        # of the same 64x256x256 shape, so the same run took minutes or seconds by machine.
        emulate=section.emulate or device_type() == "cpu",
        enable_fsdp_float8_all_gather=section.enable_fsdp_float8_all_gather,
        precompute_float8_dynamic_scale_for_fsdp=section.precompute_float8_dynamic_scale_for_fsdp,
    )
    try:
        float8.check_options(options, device_type())
    except ValueError as e:
        raise ConfigError(f"config section [{'.'.join(SECTIONS[name])}]: {e}") from None
    if dims.fsdp_enabled:
        return options
    # Like torchtitan: the FSDP-only switches are dropped where there is no FSDP, so one config
    # serves every layout.
    return dataclasses.replace(
        options, enable_fsdp_float8_all_gather=False, precompute_float8_dynamic_scale_for_fsdp=False,
    )


def _factory(name: str, config: JobConfig, dims: ParallelDims) -> ModelConverter:
    from tessera import float8

    options = float8_options(config, dims, name)
    return ModelConverter(
        name=name,
        convert=functools.partial(float8.convert, options=options),
        tp_styles=float8.tp_styles(options),
        post_optimizer_hooks=float8.post_optimizer_hooks(options), options=options,
    )


def _mx_factory(config: JobConfig, dims: ParallelDims) -> ModelConverter:
    from tessera import float8
    from tessera.trainer.config import ConfigError

    section = section_of(config, MX_SECTION)
    options = float8.MXOptions(recipe_name=section.recipe_name, filter_fqns=tuple(section.filter_fqns))
    try:
        float8.check_mx_options(options, device_type())
    except ValueError as e:
        raise ConfigError(f"config section [quantize.linear.mx]: {e}") from None
    if dims.tp_enabled:  # torchao 0.18 has no MX tensor-parallel styles
        raise ConfigError("model.converters quantize.linear.mx with tensor_parallel_degree > 1 is not supported")
    return ModelConverter(name=MX_NAME, convert=functools.partial(float8.convert_mx, options=options))


def _grouped_factory(name: str, config: JobConfig, dims: ParallelDims) -> ModelConverter:
    """The experts' weights are wrapped before expert parallel and FSDP shard them on dim 0
    (torchtitan's order); layouts no test here has proven are refused."""
    from tessera import float8
    from tessera.trainer.config import ConfigError

    section = section_of(config, GROUPED_SECTIONS[name])
    # [quantize.grouped_mm.float8] has no recipe_name: torchao has one float8 grouped recipe
    recipe = getattr(section, "recipe_name", float8.FLOAT8_ROWWISE)
    options = float8.GroupedMMOptions(recipe_name=recipe, fqns=tuple(section.fqns))
    try:
        float8.check_grouped_mm_options(options, device_type())
    except ValueError as e:
        raise ConfigError(f"config section [{name}]: {e}") from None
    for key, degree in (("tensor_parallel_degree", dims.tp), ("pipeline_parallel_degree", dims.pp),
                        ("context_parallel_degree", dims.cp), ("data_parallel_replicate_degree", dims.dp_replicate)):
        if degree > 1:
            raise ConfigError(f"model.converters {name} with parallelism.{key} {degree} is not supported yet "
                              "(expert parallel and FSDP are)")
    if config.compile.enable and "model" in config.compile.components:
        # measured: inductor fails on torchao 0.18's emulated MXFP8 grouped GEMM on CPU (an index
        # assertion); no CUDA run has proven it either
        raise ConfigError(f"model.converters {name} with compile.enable (model) is not supported yet: run it eager")
    # The experts' weights in compute: FSDP casts them to mixed_precision_param, autocast leaves
    # them as stored. fp32 ones take the per-expert loop, which would bypass the quantised GEMMs.
    key = "mixed_precision_param" if dims.fsdp_enabled else "dtype"
    if getattr(config.training, key) != "bfloat16":
        raise ConfigError(f"model.converters {name} needs bfloat16 experts for torch's grouped GEMMs: set training.{key} "
                          f"bfloat16{' (FSDP computes in it)' if dims.fsdp_enabled else ''}")
    return ModelConverter(name=name, convert=functools.partial(float8.convert_grouped_mm, options=options))


for _name in SECTIONS:
    register_converter(_name, functools.partial(_factory, _name))
register_converter(MX_NAME, _mx_factory)
for _name in GROUPED_SECTIONS:
    register_converter(_name, functools.partial(_grouped_factory, _name))
