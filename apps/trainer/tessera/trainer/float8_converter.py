"""The float8 model converter, registered as "float8" (torchtitan 0.1.x's name) and
"quantize.linear.float8" (torchtitan 0.2.x's). Importing this module registers both.

Both read the [float8] section: its keys are those of torchtitan 0.2.x's
[quantize.linear.float8], which config.py cannot load yet (it has no nested sections).
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
NAMES = ("float8", "quantize.linear.float8")


def float8_options(config: JobConfig, dims: ParallelDims) -> Float8Options:
    """The [float8] keys as tessera.float8 options for this layout; ConfigError naming the key
    when they cannot run here (checked once, in the job plan)."""
    # Imported here: config imports this module to register the names, and torchao takes
    # seconds to import, which only runs that use float8 should pay.
    from tessera import float8
    from tessera.trainer.config import ConfigError

    section = config.float8
    options = float8.Float8Options(
        recipe_name=section.recipe_name or "tensorwise",  # "" (torchtitan: None) = torchao's default recipe
        filter_fqns=tuple(name for name in section.filter_fqns if name != AUTO_FILTER_FLAG),
        auto_filter_small_kn=AUTO_FILTER_FLAG in section.filter_fqns,
        emulate=section.emulate,
        enable_fsdp_float8_all_gather=section.enable_fsdp_float8_all_gather,
        precompute_float8_dynamic_scale_for_fsdp=section.precompute_float8_dynamic_scale_for_fsdp,
    )
    try:
        float8.check_options(options, device_type())
    except ValueError as e:
        raise ConfigError(f"config section [float8]: {e}") from None
    if dims.fsdp_enabled:
        return options
    # Like torchtitan: the FSDP-only switches are dropped where there is no FSDP, so one config
    # serves every layout.
    return dataclasses.replace(
        options, enable_fsdp_float8_all_gather=False, precompute_float8_dynamic_scale_for_fsdp=False,
    )


def _factory(name: str, config: JobConfig, dims: ParallelDims) -> ModelConverter:
    from tessera import float8

    options = float8_options(config, dims)
    return ModelConverter(
        name=name,
        convert=functools.partial(float8.convert, options=options),
        tp_styles=float8.tp_styles(options),
        post_optimizer_hooks=float8.post_optimizer_hooks(options),
    )


for _name in NAMES:
    register_converter(_name, functools.partial(_factory, _name))
