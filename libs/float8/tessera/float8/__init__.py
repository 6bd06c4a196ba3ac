"""Float8 training for a model's linears through torchao: options checked up front, the module
swap, tensor-parallel styles for tessera.tp, the FSDP scale-precompute hook, and MXFP8."""

from tessera.float8.convert import convert, post_optimizer_hooks, selected
from tessera.float8.mx import MX_RECIPES, MXOptions, check_mx_options, convert_mx, mx_selected
from tessera.float8.options import RECIPES, Float8Options, check_options
from tessera.float8.size_filter import fits_float8_hardware, large_enough
from tessera.float8.tensor_parallel import BLOCK_INPUT, COLWISE, ROWWISE, tp_styles

__all__ = [
    "BLOCK_INPUT",
    "COLWISE",
    "Float8Options",
    "MXOptions",
    "MX_RECIPES",
    "RECIPES",
    "ROWWISE",
    "check_mx_options",
    "check_options",
    "convert",
    "convert_mx",
    "fits_float8_hardware",
    "large_enough",
    "mx_selected",
    "post_optimizer_hooks",
    "selected",
    "tp_styles",
]
