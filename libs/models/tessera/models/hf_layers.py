"""Renaming decoder state dicts to and from Hugging Face names, shared by the families' adapters:
top-level names, a family's per-layer name map, and routed experts, which Tessera
stacks ([E, ...] per weight, ``layers.N.moe.experts.w1``) and HF stores one tensor per expert
(``model.layers.N.mlp.experts.E.gate_proj.weight``).

Stacking makes one Tessera tensor out of E HF tensors, so ``from_hf`` needs all of a layer's
experts of a weight in one call; a subset raises. A loader converting one tensor at a time
places each expert's tensor itself, as ``expert_slice`` says (tessera.ckpt's ``import_hf``).
Everything else converts key by key, so any subset of keys works.
"""

import re

import torch

TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Grouped-query attention's projections (HF's Llama/Qwen3/Llama 4 layout; not DeepSeek's MLA).
ATTENTION = {f"attention.w{p}.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"}
# Per-layer names outside attention, common to the families (HF's Llama/Qwen/DeepSeek layout).
NORMS_AND_FFN = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
DENSE_NORMS_AND_FFN = {name: hf for name, hf in NORMS_AND_FFN.items() if not name.startswith("moe.")}
ROUTER_BIAS = "moe.expert_bias"
HF_ROUTER_BIAS = "mlp.gate.e_score_correction_bias"  # DeepSeek-V3's name for it
EXPERTS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT_OF_HF = {hf: tessera for tessera, hf in EXPERTS.items()}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight")


def to_hf(state_dict: dict[str, torch.Tensor], per_layer: dict[str, str], family: str,
          tie_embeddings: bool = False) -> dict[str, torch.Tensor]:
    """Tessera -> HF names. Stacked experts become one view per expert; with tied embeddings
    ``lm_head.weight`` is left out, as HF does. An unknown key is a ValueError naming it."""
    out = {}
    for key, value in state_dict.items():
        if key in TOP_LEVEL:
            if not (key == "output.weight" and tie_embeddings):
                out[TOP_LEVEL[key]] = value
            continue
        match = _LAYER.fullmatch(key)
        layer, name = match.groups() if match else (None, None)
        expert_weight = name.removeprefix("moe.experts.") if name else None
        if expert_weight in EXPERTS:
            for expert, weight in enumerate(value.unbind(0)):
                out[f"model.layers.{layer}.mlp.experts.{expert}.{EXPERTS[expert_weight]}.weight"] = weight
        elif name in per_layer:
            out[f"model.layers.{layer}.{per_layer[name]}"] = value
        else:
            raise ValueError(f"to_hf: unknown Tessera {family} key {key!r}")
    return out


def expert_slice(hf_key: str) -> tuple[str, int] | None:
    """(Tessera key, expert) when ``hf_key`` is one routed expert's weight, which is that
    expert's row of the stacked Tessera tensor as it is; else None."""
    match = _HF_LAYER.fullmatch(hf_key)
    expert = _HF_EXPERT.fullmatch(match.group(2)) if match else None
    if expert is None:
        return None
    return f"layers.{match.group(1)}.moe.experts.{_EXPERT_OF_HF[expert.group(2)]}", int(expert.group(1))


def from_hf(state_dict: dict[str, torch.Tensor], per_layer: dict[str, str], family: str, n_experts: int,
            tie_embeddings: bool = False) -> dict[str, torch.Tensor]:
    """HF -> Tessera names, stacking each layer's per-expert tensors (all ``n_experts`` of a weight
    must be present). With tied embeddings a missing ``output.weight`` is the embedding; HF's
    cached ``rotary_emb.inv_freq`` buffers are skipped. An unknown key is a ValueError naming it."""
    top_level = {hf: tessera for tessera, hf in TOP_LEVEL.items()}
    layer_names = {hf: tessera for tessera, hf in per_layer.items()}
    out, experts = {}, {}
    for key, value in state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if key in top_level:
            out[top_level[key]] = value
            continue
        match = _HF_LAYER.fullmatch(key)
        layer, name = match.groups() if match else (None, None)
        expert = expert_slice(key) if n_experts else None  # a dense model's: an unknown key
        if expert:
            experts.setdefault(expert[0], {})[expert[1]] = value
        elif name in layer_names:
            out[f"layers.{layer}.{layer_names[name]}"] = value
        else:
            raise ValueError(f"from_hf: unknown Hugging Face {family} key {key!r}")
    for stacked, parts in experts.items():
        if sorted(parts) != list(range(n_experts)):
            layer, weight = stacked.split(".")[1], EXPERTS[stacked.rpartition(".")[2]]
            raise ValueError(f"from_hf: layer {layer} has {len(parts)} of {n_experts} experts' {weight} "
                             f"weights (expert ids {sorted(parts)[:8]}...); stacking needs all of them in one call "
                             "(a loader reading one tensor at a time places them itself: expert_slice)")
        out[stacked] = torch.stack([parts[e] for e in range(n_experts)])
    if tie_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


def without_router_bias(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict less the routers' ``expert_bias`` (for HF formats without one)."""
    return {key: value for key, value in state_dict.items() if not key.endswith(f".{ROUTER_BIAS}")}


def zero_router_bias(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A zero float32 ``expert_bias`` next to every router gate weight, for HF formats without one:
    the bias comes with the gate, so converting one tensor at a time still yields it."""
    gate = ".moe.router.gate.weight"
    return {
        key.removesuffix(gate) + f".{ROUTER_BIAS}": torch.zeros(len(value), dtype=torch.float32, device=value.device)
        for key, value in state_dict.items() if key.endswith(gate)
    }
