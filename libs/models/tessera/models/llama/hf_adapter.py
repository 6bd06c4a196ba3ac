"""Convert state dicts between Tessera's Llama names and Hugging Face ``LlamaForCausalLM``.

Tessera applies RoPE to interleaved feature pairs (2i, 2i+1) as complex numbers; HF's
``rotate_half`` pairs feature i with i + head_dim/2. The rows of wq/wk are permuted within
each head to move between the two layouts, which leaves attention scores unchanged.
Works on any subset of keys (e.g. one pipeline stage's).
"""

import torch

from tessera.models import hf_layers
from tessera.models.llama.args import ModelArgs

_PER_LAYER = {**hf_layers.ATTENTION, **hf_layers.DENSE_NORMS_AND_FFN}
_ROTATED = (".attention.wq.weight", ".attention.wk.weight")


def _interleaved_to_half(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head: (re0, im0, re1, im1, ...) -> (re0, re1, ..., im0, im1, ...)."""
    return w.view(-1, head_dim // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def _half_to_interleaved(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    return w.view(-1, 2, head_dim // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def _permuted(state_dict: dict[str, torch.Tensor], permute, head_dim: int) -> dict[str, torch.Tensor]:
    """wq's and wk's rows permuted within each head (Tessera names), the rest as it is."""
    return {key: permute(value, head_dim) if key.endswith(_ROTATED) else value for key, value in state_dict.items()}


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Tessera names -> HF names. With tied embeddings ``lm_head.weight`` is left out, as HF does."""
    return hf_layers.to_hf(_permuted(state_dict, _interleaved_to_half, args.head_dim), _PER_LAYER, "Llama",
                           args.tie_embeddings)


def from_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF names -> Tessera names. With tied embeddings a missing ``lm_head.weight`` is
    filled with the embedding; HF's cached ``rotary_emb.inv_freq`` buffers are skipped."""
    return _permuted(hf_layers.from_hf(state_dict, _PER_LAYER, "Llama", 0, args.tie_embeddings), _half_to_interleaved,
                     args.head_dim)
