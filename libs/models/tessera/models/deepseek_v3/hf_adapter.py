"""Convert state dicts between Tessera's DeepSeek names and Hugging Face ``DeepseekV3ForCausalLM``
(and ``DeepseekV2ForCausalLM``).

RoPE needs no permutation: both apply it to interleaved pairs (HF's DeepSeek code reorders q and
k at run time). DeepSeek-V3's format (sigmoid routing) keeps the router bias as
``mlp.gate.e_score_correction_bias``; V2's has none, so ``to_hf`` drops the bias and ``from_hf``
starts it at zero. V3 stores its multi-token-prediction modules as the layers after the last
decoder layer (``model.layers.{n_layers + k - 1}``, with ``enorm``, ``hnorm``, ``eh_proj`` and
``shared_head.norm``), each with copies of the shared embedding and output projection
(``embed_tokens``, ``shared_head.head``): ``from_hf`` keeps the modules the model has
(``num_mtp_layers``), skipping the copies and any further layers, and ``to_hf`` writes the copies
from the shared tensors. The released V3 weights are float8 with ``weight_scale_inv`` tensors:
dequantise them first (an unknown key is a ValueError).
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
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "mtp_norm.weight": "shared_head.norm.weight"}
_SHARED_COPIES = {"tok_embeddings.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}
_HF_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _hf_has_router_bias(args: DeepSeekV3Args) -> bool:
    return args.moe.score_func == "sigmoid"  # V3's "noaux_tc" routing


def _per_layer(args: DeepSeekV3Args) -> dict[str, str]:
    bias = {hf_layers.ROUTER_BIAS: hf_layers.HF_ROUTER_BIAS} if _hf_has_router_bias(args) else {}
    return {**_ATTENTION, **hf_layers.NORMS_AND_FFN, **bias, **_MTP}


def _mtp_layers(args: DeepSeekV3Args) -> range:
    return range(args.n_layers, args.n_layers + args.num_mtp_layers)


def to_hf(state_dict: dict[str, torch.Tensor], args: DeepSeekV3Args) -> dict[str, torch.Tensor]:
    if not _hf_has_router_bias(args):
        state_dict = hf_layers.without_router_bias(state_dict)
    out = hf_layers.to_hf(state_dict, _per_layer(args), "DeepSeek-V3")
    for key, copy in _SHARED_COPIES.items():
        if key in state_dict:
            out.update({f"model.layers.{layer}.{copy}": state_dict[key] for layer in _mtp_layers(args)})
    return out


def _dropped(key: str, args: DeepSeekV3Args) -> bool:
    """A layer beyond the model's modules, or a module's copy of a shared tensor."""
    match = _HF_LAYER_INDEX.fullmatch(key)
    if match is None:
        return False
    layer, name = int(match.group(1)), match.group(2)
    return layer >= args.n_layers + args.num_mtp_layers or (layer >= args.n_layers and name in _SHARED_COPIES.values())


def from_hf(state_dict: dict[str, torch.Tensor], args: DeepSeekV3Args) -> dict[str, torch.Tensor]:
    kept = {key: value for key, value in state_dict.items() if not _dropped(key, args)}
    out = hf_layers.from_hf(kept, _per_layer(args), "DeepSeek-V3", args.moe.n_experts)
    if not _hf_has_router_bias(args):
        out.update(hf_layers.zero_router_bias(out))
    return out


def stacked_slice(hf_key: str, args: DeepSeekV3Args) -> tuple[str, int] | None:
    """(Tessera key, expert) of a routed expert's HF tensor, for loaders placing them one by one;
    None for the experts of layers beyond the model's, which ``from_hf`` drops."""
    return None if _dropped(hf_key, args) else hf_layers.expert_slice(hf_key)
