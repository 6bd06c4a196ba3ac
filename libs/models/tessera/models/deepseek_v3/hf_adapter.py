"""Convert state dicts between Tessera's DeepSeek names and Hugging Face ``DeepseekV3ForCausalLM``
(and ``DeepseekV2ForCausalLM``).

RoPE needs no permutation: both apply it to interleaved pairs (HF's DeepSeek code reorders q and
k at run time). DeepSeek-V3's format (sigmoid routing) keeps the router bias as
``mlp.gate.e_score_correction_bias``; V2's has none, so ``to_hf`` drops the bias and ``from_hf``
starts it at zero. ``from_hf`` skips the multi-token-prediction layers V3 stores after the last
decoder layer (``model.layers.{n_layers}...``). The released V3 weights are float8 with
``weight_scale_inv`` tensors: dequantise them first (an unknown key is a ValueError).
"""

import re

import torch

from tessera.models import hf_layers
from tessera.models.deepseek_v3.args import DeepSeekV3Args

_ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_HF_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def _hf_has_router_bias(args: DeepSeekV3Args) -> bool:
    return args.moe.score_func == "sigmoid"  # V3's "noaux_tc" routing


def _per_layer(args: DeepSeekV3Args) -> dict[str, str]:
    bias = {hf_layers.ROUTER_BIAS: hf_layers.HF_ROUTER_BIAS} if _hf_has_router_bias(args) else {}
    return {**_ATTENTION, **hf_layers.NORMS_AND_FFN, **bias}


def to_hf(state_dict: dict[str, torch.Tensor], args: DeepSeekV3Args) -> dict[str, torch.Tensor]:
    if not _hf_has_router_bias(args):
        state_dict = hf_layers.without_router_bias(state_dict)
    return hf_layers.to_hf(state_dict, _per_layer(args), "DeepSeek-V3")


def _multi_token_prediction(key: str, args: DeepSeekV3Args) -> bool:
    match = _HF_LAYER_INDEX.match(key)
    return match is not None and int(match.group(1)) >= args.n_layers


def from_hf(state_dict: dict[str, torch.Tensor], args: DeepSeekV3Args) -> dict[str, torch.Tensor]:
    kept = {key: value for key, value in state_dict.items() if not _multi_token_prediction(key, args)}
    out = hf_layers.from_hf(kept, _per_layer(args), "DeepSeek-V3", args.moe.n_experts)
    if not _hf_has_router_bias(args):
        out.update(hf_layers.zero_router_bias(out))
    return out


def stacked_slice(hf_key: str, args: DeepSeekV3Args) -> tuple[str, int] | None:
    """(Tessera key, expert) of a routed expert's HF tensor, for loaders placing them one by one;
    None for the multi-token-prediction layers' experts, which ``from_hf`` drops."""
    return None if _multi_token_prediction(hf_key, args) else hf_layers.expert_slice(hf_key)
