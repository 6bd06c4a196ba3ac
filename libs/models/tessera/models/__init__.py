"""Tessera model code, per-block transforms and the model-spec registry. Importing registers
"llama2" and "llama3"."""

from tessera.models.attention import CausalSDPA
from tessera.models.blocks import AC_MODES, apply_activation_checkpointing, apply_compile
from tessera.models.spec import (
    ModelSpec,
    get_model_spec,
    list_model_specs,
    num_params,
    register_model_spec,
)
from tessera.models.llama import llama2_spec, llama3_spec

register_model_spec(llama2_spec)
register_model_spec(llama3_spec)

__all__ = [
    "AC_MODES",
    "CausalSDPA",
    "ModelSpec",
    "apply_activation_checkpointing",
    "apply_compile",
    "get_model_spec",
    "list_model_specs",
    "num_params",
    "register_model_spec",
]
