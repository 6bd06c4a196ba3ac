"""Model converters: named steps that swap modules of a freshly built model before tensor parallel
and FSDP wrap it (float8 linears now, other quantisations later), as `model.converters` lists them.

A converter is registered under its config name with a factory and, declared by the converter's
module, the config table it reads (e.g. "quantize.linear.float8"): the plan warns of such a table
set while its converter is not listed, and the factory finds its table through the registry
(`converter_sections`). The job plan calls the factory with the config, the parallel degrees and
the device the job runs on (a plan checked for a cluster's GPUs may be made on a CPU host), so a
converter that cannot serve a layout raises its ConfigError there, once, before any worker
starts. What the factory returns says everything the rest of the build needs from it: the swap
itself, tensor-parallel styles for roles its modules need (handed to tessera.tp), and hooks to
run after every optimizer step (e.g. float8 scale precompute for FSDP).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from tessera.mesh import ParallelDims
    from tessera.trainer.config import JobConfig


@dataclasses.dataclass(frozen=True)
class ModelConverter:
    name: str
    convert: Callable[[nn.Module], None]  # swaps modules in place; runs before TP, AC, compile, FSDP
    tp_styles: Mapping[str, Callable] = dataclasses.field(default_factory=dict)  # role -> tessera.tp StyleFactory
    post_optimizer_hooks: tuple[Callable[[nn.Module], None], ...] = ()
    options: Any = None  # what it was configured with (float8: tessera.float8.Float8Options), for tools that model it
    # which modules `convert` swaps, (fqn, module) -> bool, and the config key of the name patterns
    # it reads with them: the job plan refuses a converter that would swap nothing, and says which
    # pattern matches no module (a typo would otherwise convert what it meant to keep)
    selects: Callable[[str, nn.Module], bool] | None = None
    patterns: tuple[str, tuple[str, ...]] = ("", ())
    # `selects` without the size filters a user may switch on (float8's auto_filter_small_kn):
    # what they leave out is said in a warning, as torchtitan converts nothing silently then
    selects_by_name: Callable[[str, nn.Module], bool] | None = None


ConverterFactory = Callable[["JobConfig", "ParallelDims", str], ModelConverter]

_REGISTRY: dict[str, tuple[ConverterFactory, str]] = {}


def register_converter(name: str, factory: ConverterFactory, section: str = "") -> None:
    """Makes `name` usable in `model.converters`; a taken name is a ValueError. `section`: the
    dotted config table the converter reads, if any."""
    if name in _REGISTRY:
        raise ValueError(f"model converter {name!r} is already registered")
    _REGISTRY[name] = (factory, section)


def registered_converters() -> list[str]:
    return sorted(_REGISTRY)


def converter_sections() -> dict[str, str]:
    """converter name -> the config table it reads, for the converters that read one."""
    return {name: section for name, (_, section) in sorted(_REGISTRY.items()) if section}


def build_converters(config: JobConfig, dims: ParallelDims, device: str) -> tuple[ModelConverter, ...]:
    """The configured converters for a job on `device` ("cpu", "cuda"), in the order
    `model.converters` lists them."""
    return tuple(_REGISTRY[name][0](config, dims, device) for name in config.model.converters)
