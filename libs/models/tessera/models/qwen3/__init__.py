"""Qwen3 decoder models, dense and mixture of experts."""

from tessera.models.qwen3.args import Qwen3Args
from tessera.models.qwen3.flavors import qwen3_flavors
from tessera.models.qwen3.model import Attention, Qwen3
from tessera.models.qwen3.spec import active_params, flops_per_token, qwen3_spec, tp_divisible

__all__ = [
    "Attention",
    "Qwen3",
    "Qwen3Args",
    "active_params",
    "flops_per_token",
    "qwen3_flavors",
    "qwen3_spec",
    "tp_divisible",
]
