"""Llama 4 text models (Scout, Maverick): iRoPE attention and interleaved mixture of experts."""

from tessera.models.llama4.args import Llama4Args
from tessera.models.llama4.flavors import llama4_flavors
from tessera.models.llama4.model import Attention, Llama4, attention_temperature, l2_norm, layer_mask
from tessera.models.llama4.spec import active_params, flops_per_token, llama4_spec, tp_divisible

__all__ = [
    "Attention",
    "Llama4",
    "Llama4Args",
    "active_params",
    "attention_temperature",
    "flops_per_token",
    "l2_norm",
    "layer_mask",
    "llama4_flavors",
    "llama4_spec",
    "tp_divisible",
]
