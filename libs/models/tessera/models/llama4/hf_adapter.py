"""Convert state dicts between Tessera's Llama 4 names and Hugging Face ``Llama4ForCausalLM``
(``model.layers.*``); ``from_hf`` also takes the text part of the released multimodal
checkpoints (``language_model.model.layers.*``, ``language_model.lm_head``) and skips their
vision tower and projector.

No RoPE permutation: HF's Llama 4 rotates interleaved pairs, as the model does. HF stores each
MoE layer's routed experts fused, as its ``Llama4TextExperts`` multiplies x @ W:
``feed_forward.experts.gate_up_proj`` [E, dim, 2 hidden] (gate columns, then up) and
``down_proj`` [E, hidden, dim] (``save_pretrained`` writes them so, like the released
checkpoints). ``from_hf`` converts each HF tensor alone (one fused tensor gives w1 and w3), so
loaders stream them; ``to_hf`` needs a layer's w1 and w3 in one call to fuse them
(``export_group`` names them for streaming exporters). HF's router has no bias: ``to_hf`` drops
``expert_bias`` (``export_note``), ``from_hf`` starts it at zero.
"""

import re

import torch

from tessera.models import hf_layers
from tessera.models.llama4.args import Llama4Args

_PER_LAYER = {
    **hf_layers.ATTENTION,
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "feed_forward.gate_proj.weight",
    "feed_forward.w2.weight": "feed_forward.down_proj.weight",
    "feed_forward.w3.weight": "feed_forward.up_proj.weight",
    "moe.router.gate.weight": "feed_forward.router.weight",
    "moe.shared_experts.w1.weight": "feed_forward.shared_expert.gate_proj.weight",
    "moe.shared_experts.w2.weight": "feed_forward.shared_expert.down_proj.weight",
    "moe.shared_experts.w3.weight": "feed_forward.shared_expert.up_proj.weight",
}
_MULTIMODAL = "language_model."
_VISION = ("vision_model.", "multi_modal_projector.")
_EXPERT = re.compile(r"layers\.(\d+)\.moe\.experts\.(w1|w2|w3)")
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.feed_forward\.experts\.(gate_up_proj|down_proj)")


def to_hf(state_dict: dict[str, torch.Tensor], args: Llama4Args) -> dict[str, torch.Tensor]:
    """Tessera -> ``Llama4ForCausalLM`` names; a layer's experts.w1 and w3 must come together."""
    experts = {key: value for key, value in state_dict.items() if _EXPERT.fullmatch(key)}
    rest = {key: value for key, value in state_dict.items() if key not in experts}
    out = hf_layers.to_hf(hf_layers.without_router_bias(rest), _PER_LAYER, "Llama 4", args.tie_embeddings)
    for key, value in experts.items():
        layer, weight = _EXPERT.fullmatch(key).groups()
        prefix = f"model.layers.{layer}.feed_forward.experts"
        if weight == "w2":
            out[f"{prefix}.down_proj"] = value.transpose(1, 2).contiguous()  # as HF saves it
        elif weight == "w1":
            w3 = experts.get(f"layers.{layer}.moe.experts.w3")
            if w3 is None:
                raise ValueError(f"to_hf: {prefix}.gate_up_proj fuses layers.{layer}.moe.experts.w1 and w3: "
                                 "pass both in one call")
            out[f"{prefix}.gate_up_proj"] = torch.cat([value, w3], dim=1).transpose(1, 2).contiguous()
        elif f"layers.{layer}.moe.experts.w1" not in experts:
            raise ValueError(f"to_hf: {prefix}.gate_up_proj fuses layers.{layer}.moe.experts.w1 and w3: "
                             "pass both in one call")
    return out


def export_group(key: str, args: Llama4Args) -> str | None:
    """The HF tensor a model tensor is fused into with others, which ``to_hf`` needs in one call
    (a layer's experts w1 and w3: ``gate_up_proj``); None for a tensor that converts alone."""
    match = _EXPERT.fullmatch(key)
    if match is None or match[2] == "w2":
        return None
    return f"model.layers.{match[1]}.feed_forward.experts.gate_up_proj"


def from_hf(state_dict: dict[str, torch.Tensor], args: Llama4Args) -> dict[str, torch.Tensor]:
    """``Llama4ForCausalLM`` or multimodal ``Llama4ForConditionalGeneration`` names -> Tessera;
    any subset of keys converts alone."""
    text = {key.removeprefix(_MULTIMODAL): value for key, value in state_dict.items() if not key.startswith(_VISION)}
    experts = {key: value for key, value in text.items() if _HF_EXPERT.fullmatch(key)}
    out = hf_layers.from_hf({k: v for k, v in text.items() if k not in experts}, _PER_LAYER, "Llama 4", 0,
                            args.tie_embeddings)
    for key, value in experts.items():
        layer, weight = _HF_EXPERT.fullmatch(key).groups()
        prefix = f"layers.{layer}.moe.experts"
        if weight == "down_proj":
            out[f"{prefix}.w2"] = value.transpose(1, 2)
        else:
            gate, up = value.transpose(1, 2).chunk(2, dim=1)
            out[f"{prefix}.w1"], out[f"{prefix}.w3"] = gate, up
    out.update(hf_layers.zero_router_bias(out))
    return out


def export_note(args: Llama4Args) -> str | None:
    """What an export of ``args``' trained state cannot hold, in one line (None: nothing)."""
    if not args.moe_layers or args.moe.bias_update_rate == 0:
        return None
    return ("Llama 4's Hugging Face format has no router bias: the export routes without the expert_bias that "
            "auxiliary-loss-free balancing learned, so its logits differ from the trained model's (a flavor with "
            "moe.bias_update_rate 0 trains without one)")
