"""Swap a model's linears for torchao's float8 training linears, and the per-step hook FSDP's
float8 all-gather wants."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torchao.float8 import convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

from tessera.float8.options import Float8Options
from tessera.float8.size_filter import fits_float8_hardware, large_enough


def selected(fqn: str, module: nn.Module, options: Float8Options) -> bool:
    """Whether `convert` swaps `module`, found at `fqn`.

    Only plain nn.Linear: a subclass has its own forward, which Float8Linear would drop (and
    an already converted Float8Linear is one).
    """
    return (
        type(module) is nn.Linear
        and not any(name in fqn for name in options.filter_fqns)
        and fits_float8_hardware(module)
        and (not options.auto_filter_small_kn or large_enough(module, options.recipe_name))
    )


def convert(model: nn.Module, options: Float8Options) -> list[str]:
    """Swaps, in place, the linears `selected` keeps for float8 ones; returns their names.

    Run it on the plain model, before tensor parallel, activation checkpointing, compile and
    FSDP wrap it. Works on a meta-device model: weights are kept, not copied.
    """
    converted: list[str] = []

    def keep(module: nn.Module, fqn: str) -> bool:
        if selected(fqn, module, options):
            converted.append(fqn)
            return True
        return False

    convert_to_float8_training(model, module_filter_fn=keep, config=options.torchao_config())
    return converted


def post_optimizer_hooks(options: Float8Options) -> tuple[Callable[[nn.Module], None], ...]:
    """What to call with the model after every optimizer step.

    With float8 all-gather, FSDP2 casts each weight shard before gathering it and needs the
    scale of the whole weight; torchao's precompute computes all of them in one all-reduce
    instead of one per weight during the next forward.
    """
    if options.precompute_float8_dynamic_scale_for_fsdp:
        return (precompute_float8_dynamic_scale_for_fsdp,)
    return ()
