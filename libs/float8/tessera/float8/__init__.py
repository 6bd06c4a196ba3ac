"""Float8 training for a model's linears through torchao: options checked up front, the module
swap, tensor-parallel styles for tessera.tp, the FSDP scale-precompute hook, and MXFP8; and
float8 / MXFP8 grouped GEMMs for MoE experts."""

import logging
from contextlib import contextmanager


@contextmanager
def _quiet_torchao_import():
    """torchao's import logs a warning for each optional kernel library this machine cannot load
    (CUDA-only ones on CPU) and torch's deprecation of its Enum pytree registrations: on every run
    of every program importing this library, about nothing it runs. Only the import is quietened."""
    noisy = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in noisy]
    for logger in noisy:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(noisy, levels):
            logger.setLevel(level)


with _quiet_torchao_import():
    from tessera.float8.convert import convert, post_optimizer_hooks, selected
    from tessera.float8.grouped_mm import (
        FLOAT8_ROWWISE,
        GROUPED_RECIPES,
        GroupedMMOptions,
        check_grouped_mm_options,
        convert_grouped_mm,
        grouped_mm_selected,
    )
    from tessera.float8.mx import MX_RECIPES, MXOptions, check_mx_options, convert_mx, mx_selected
    from tessera.float8.options import RECIPES, Float8Options, check_options
    from tessera.float8.size_filter import fits_float8_hardware, large_enough
    from tessera.float8.tensor_parallel import BLOCK_INPUT, COLWISE, ROWWISE, tp_styles

__all__ = [
    "BLOCK_INPUT",
    "COLWISE",
    "FLOAT8_ROWWISE",
    "Float8Options",
    "GROUPED_RECIPES",
    "GroupedMMOptions",
    "MXOptions",
    "MX_RECIPES",
    "RECIPES",
    "ROWWISE",
    "check_grouped_mm_options",
    "check_mx_options",
    "check_options",
    "convert",
    "convert_grouped_mm",
    "convert_mx",
    "fits_float8_hardware",
    "grouped_mm_selected",
    "large_enough",
    "mx_selected",
    "post_optimizer_hooks",
    "selected",
    "tp_styles",
]
