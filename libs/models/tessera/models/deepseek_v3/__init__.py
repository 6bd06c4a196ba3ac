"""DeepSeek-V2/V3 decoder models: multi-head latent attention, YaRN RoPE, mixture of experts."""

from tessera.models.deepseek_v3.args import DeepSeekV3Args, YarnScaling
from tessera.models.deepseek_v3.flavors import deepseek_v3_flavors
from tessera.models.deepseek_v3.model import Attention, DeepSeekV3
from tessera.models.rotary import yarn_frequencies
from tessera.models.deepseek_v3.spec import active_params, deepseek_v3_spec, flops_per_token, tp_divisible

__all__ = [
    "Attention",
    "DeepSeekV3",
    "DeepSeekV3Args",
    "YarnScaling",
    "active_params",
    "deepseek_v3_flavors",
    "deepseek_v3_spec",
    "flops_per_token",
    "tp_divisible",
    "yarn_frequencies",
]
