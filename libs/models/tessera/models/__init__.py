"""Tessera model code, per-block transforms and the model-spec registry. Importing registers
"llama2", "llama3", "deepseek_v3", "qwen3", "gpt_oss" and "llama4"."""

from tessera.models.attention import KERNELS, AttentionBatch, InnerAttention, choose_kernel, inner_attentions, plain_causal
from tessera.models.masks import CAUSAL, AttentionMask
from tessera.models.blocks import (AC_MODES, FORCE_RECOMPUTE_DEFAULT, apply_activation_checkpointing, apply_compile,
                                   force_recompute_shapes)
from tessera.models.offload import offload_activations
from tessera.models.hf_config import CONFIG_FILE, read_hf_config
from tessera.models.module_names import unwrapped_name
from tessera.models.rms_norm import RMSNorm
from tessera.models.spec import (
    ARGS_FILE,
    ModelSpec,
    RunLayout,
    StepHooks,
    args_record,
    get_model_spec,
    list_model_specs,
    num_params,
    read_args_record,
    register_model_spec,
)
from tessera.models.llama import llama2_spec, llama3_spec
from tessera.models.deepseek_v3 import deepseek_v3_spec
from tessera.models.qwen3 import qwen3_spec
from tessera.models.gpt_oss import gpt_oss_spec
from tessera.models.llama4 import llama4_spec

register_model_spec(llama2_spec)
register_model_spec(llama3_spec)
register_model_spec(deepseek_v3_spec)
register_model_spec(qwen3_spec)
register_model_spec(gpt_oss_spec)
register_model_spec(llama4_spec)

__all__ = [
    "AC_MODES",
    "ARGS_FILE",
    "CONFIG_FILE",
    "AttentionBatch",
    "AttentionMask",
    "CAUSAL",
    "FORCE_RECOMPUTE_DEFAULT",
    "InnerAttention",
    "KERNELS",
    "ModelSpec",
    "RunLayout",
    "RMSNorm",
    "StepHooks",
    "apply_activation_checkpointing",
    "apply_compile",
    "choose_kernel",
    "force_recompute_shapes",
    "inner_attentions",
    "args_record",
    "get_model_spec",
    "list_model_specs",
    "num_params",
    "offload_activations",
    "plain_causal",
    "read_args_record",
    "read_hf_config",
    "register_model_spec",
    "unwrapped_name",
]
