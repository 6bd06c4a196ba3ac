"""Convert state dicts between Tessera's Qwen3 names and Hugging Face ``Qwen3ForCausalLM`` /
``Qwen3MoeForCausalLM``.

No RoPE permutation: the model uses HF's half-split layout. HF's Qwen3-MoE router has no bias:
``to_hf`` drops ``expert_bias`` (the exported model routes without the learned bias: ``export_note``
says so) and ``from_hf`` starts it at zero. With tied embeddings ``lm_head.weight`` is left out, as HF does.
"""

import torch

from tessera.models import hf_layers
from tessera.models.qwen3.args import Qwen3Args

_PER_LAYER = {
    **hf_layers.ATTENTION,
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    **hf_layers.NORMS_AND_FFN,
}


def to_hf(state_dict: dict[str, torch.Tensor], args: Qwen3Args) -> dict[str, torch.Tensor]:
    return hf_layers.to_hf(hf_layers.without_router_bias(state_dict), _PER_LAYER, "Qwen3", args.tie_embeddings)


def from_hf(state_dict: dict[str, torch.Tensor], args: Qwen3Args) -> dict[str, torch.Tensor]:
    n_experts = args.moe.n_experts if args.moe is not None else 0
    out = hf_layers.from_hf(state_dict, _PER_LAYER, "Qwen3", n_experts, args.tie_embeddings)
    out.update(hf_layers.zero_router_bias(out))
    return out


def export_note(args: Qwen3Args) -> str | None:
    """What an export of ``args``' trained state cannot hold, in one line (None: nothing)."""
    if args.moe is None or args.moe.bias_update_rate == 0:
        return None
    return ("Qwen3-MoE's Hugging Face format has no router bias: the export routes without the expert_bias that "
            "auxiliary-loss-free balancing learned, so its logits differ from the trained model's (a flavor with "
            "moe.bias_update_rate 0 trains without one)")


def stacked_slice(hf_key: str, args: Qwen3Args) -> tuple[str, int] | None:
    """(Tessera key, expert) of a routed expert's HF tensor, for loaders placing them one by one."""
    return hf_layers.expert_slice(hf_key)
