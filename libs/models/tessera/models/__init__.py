"""Tessera model code and the model-spec registry. Importing registers "llama2" and "llama3"."""

from tessera.models.spec import (
    TP_ROLES,
    ModelSpec,
    get_model_spec,
    list_model_specs,
    num_params,
    register_model_spec,
)
from tessera.models.llama import llama2_spec, llama3_spec

register_model_spec(llama2_spec)
register_model_spec(llama3_spec)

__all__ = ["TP_ROLES", "ModelSpec", "get_model_spec", "list_model_specs", "num_params", "register_model_spec"]
