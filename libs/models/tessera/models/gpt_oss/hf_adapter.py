"""Convert state dicts between Tessera's GPT-OSS names and Hugging Face ``GptOssForCausalLM``.

No RoPE permutation (the model uses HF's half-split layout) and no expert stacking: the experts'
tensors are HF's (``mlp.experts.gate_up_proj`` [E, dim, 2 hidden] with gate/up interleaved,
``down_proj``, and their biases), so every tensor converts alone. HF's router has no balancing
bias: ``to_hf`` drops ``expert_bias`` (the exported model routes without it: ``export_note``
says so), ``from_hf`` starts it at zero. The released checkpoints' MXFP4 experts (``<name>_blocks`` +
``<name>_scales``) are dequantised by ``from_hf`` when both tensors come in one call, as
``tessera.ckpt.import_hf`` hands them over while streaming.
"""

import torch

from tessera.models import hf_layers
from tessera.models.gpt_oss.args import GptOssArgs
from tessera.models.gpt_oss.mxfp4 import dequantize_mxfp4

_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_PER_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attention.w{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")},
    "attention.inner_attention.sinks": "self_attn.sinks",
    "moe.router.gate.weight": "mlp.router.weight",
    "moe.router.gate.bias": "mlp.router.bias",
    **{f"moe.experts.{name}": f"mlp.experts.{name}" for name in _EXPERTS},
}
_BLOCKS, _SCALES = "_blocks", "_scales"
# The quantisation formats from_hf dequantises (transformers' quant_method names): what lets a
# trainer load a quantized checkpoint (checkpoint.initial_load_in_hf_quantized).
quantized_formats = ("mxfp4",)


def to_hf(state_dict: dict[str, torch.Tensor], args: GptOssArgs) -> dict[str, torch.Tensor]:
    return hf_layers.to_hf(hf_layers.without_router_bias(state_dict), _PER_LAYER, "GPT-OSS")


def _dequantized(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with each MXFP4 pair replaced by its dequantised tensor; half a pair is a
    ValueError naming it."""
    out = {}
    for key, value in state_dict.items():
        if key.endswith(_SCALES) and key.removesuffix(_SCALES) + _BLOCKS in state_dict:
            continue
        if key.endswith((_BLOCKS, _SCALES)):
            stem = key.removesuffix(_BLOCKS).removesuffix(_SCALES)
            if stem + _SCALES not in state_dict or stem + _BLOCKS not in state_dict:
                raise ValueError(f"from_hf: MXFP4 tensor {key!r} needs {stem + _BLOCKS!r} and {stem + _SCALES!r} "
                                 "in one call")
            out[stem] = dequantize_mxfp4(value, state_dict[stem + _SCALES])
        else:
            out[key] = value
    return out


def from_hf(state_dict: dict[str, torch.Tensor], args: GptOssArgs) -> dict[str, torch.Tensor]:
    out = hf_layers.from_hf(_dequantized(state_dict), _PER_LAYER, "GPT-OSS", args.moe.n_experts)
    out.update(hf_layers.zero_router_bias(out))
    return out



def export_note(args: GptOssArgs) -> str | None:
    """What an export of ``args``' trained state cannot hold, in one line (None: nothing)."""
    if args.moe.bias_update_rate == 0:
        return None
    return ("GPT-OSS's Hugging Face format has no balancing bias: the export routes without the expert_bias that "
            "auxiliary-loss-free balancing learned, so its logits differ from the trained model's "
            "(moe.bias_update_rate 0 trains without one)")
