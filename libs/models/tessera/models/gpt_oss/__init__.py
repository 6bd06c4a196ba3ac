"""GPT-OSS decoder models: sliding-window and full attention with sinks, YaRN, mixture of experts."""

from tessera.models.gpt_oss.args import GptOssArgs
from tessera.models.gpt_oss.experts import GptOssExperts, clamped_swiglu
from tessera.models.gpt_oss.flavors import gpt_oss_flavors
from tessera.models.gpt_oss.model import Attention, GptOss
from tessera.models.gpt_oss.mxfp4 import dequantize_mxfp4
from tessera.models.gpt_oss.spec import active_params, flops_per_token, gpt_oss_spec, tp_divisible

__all__ = [
    "Attention",
    "GptOss",
    "GptOssArgs",
    "GptOssExperts",
    "active_params",
    "clamped_swiglu",
    "dequantize_mxfp4",
    "flops_per_token",
    "gpt_oss_flavors",
    "gpt_oss_spec",
    "tp_divisible",
]
