"""Convert state dicts between Tessera's Llama names and Hugging Face ``LlamaForCausalLM``.

Tessera applies RoPE to interleaved feature pairs (2i, 2i+1) as complex numbers; HF's
``rotate_half`` pairs feature i with i + head_dim/2. The rows of wq/wk are permuted within
each head to move between the two layouts, which leaves attention scores unchanged.
Works on any subset of keys (e.g. one pipeline stage's).
"""

import re

import torch

from tessera.models.llama.args import ModelArgs

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_ROTATED = ("attention.wq.weight", "attention.wk.weight")
_TESSERA_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _interleaved_to_half(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head: (re0, im0, re1, im1, ...) -> (re0, re1, ..., im0, im1, ...)."""
    return w.view(-1, head_dim // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def _half_to_interleaved(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    return w.view(-1, 2, head_dim // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Tessera names -> HF names. With tied embeddings ``lm_head.weight`` is left out, as HF does."""
    out = {}
    for key, value in state_dict.items():
        if key in _TOP_LEVEL:
            if key == "output.weight" and args.tie_embeddings:
                continue
            out[_TOP_LEVEL[key]] = value
            continue
        match = _TESSERA_LAYER.fullmatch(key)
        if match is None or match.group(2) not in _PER_LAYER:
            raise ValueError(f"to_hf: unknown Tessera Llama key {key!r}")
        layer, name = match.groups()
        if name in _ROTATED:
            value = _interleaved_to_half(value, args.head_dim)
        out[f"model.layers.{layer}.{_PER_LAYER[name]}"] = value
    return out


def from_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF names -> Tessera names. With tied embeddings a missing ``lm_head.weight`` is
    filled with the embedding; HF's cached ``rotary_emb.inv_freq`` buffers are skipped."""
    top_level = {hf: tessera for tessera, hf in _TOP_LEVEL.items()}
    per_layer = {hf: tessera for tessera, hf in _PER_LAYER.items()}
    out = {}
    for key, value in state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if key in top_level:
            out[top_level[key]] = value
            continue
        match = _HF_LAYER.fullmatch(key)
        if match is None or match.group(2) not in per_layer:
            raise ValueError(f"from_hf: unknown Hugging Face Llama key {key!r}")
        layer, hf_name = match.groups()
        name = per_layer[hf_name]
        if name in _ROTATED:
            value = _half_to_interleaved(value, args.head_dim)
        out[f"layers.{layer}.{name}"] = value
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out
