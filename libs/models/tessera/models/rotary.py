"""Rotary position embedding (RoFormer) in real arithmetic, in the two feature layouts models use.

A table holds ``cos`` and ``sin`` of ``position * freq_i`` side by side: ``[positions, dim]``, the
first ``dim // 2`` columns cosines, the rest sines, float32. A model indexes it by position ids
once and hands the rows to its blocks (one tensor, so it passes pipeline stages and compiled
blocks as one input).

Layouts (how feature pairs are formed inside a head of ``dim`` features):
- interleaved: pairs (2i, 2i+1), as the complex form of Meta's Llama and DeepSeek's reference
  code (DeepSeek-V3's Hugging Face weights are in this layout too);
- half: pairs (i, i + dim/2), Hugging Face's ``rotate_half`` (Qwen3, Llama in HF).
Pair i is rotated by the angle ``position * freq_i`` in both.
"""

import torch


def inverse_frequencies(dim: int, theta: float) -> torch.Tensor:
    """``theta ** (-2i / dim)`` for i < dim/2, float32."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


def rope_table(freqs: torch.Tensor, end: int) -> torch.Tensor:
    """[end, 2 * len(freqs)]: cos then sin of ``t * freqs`` for positions t < end, float32."""
    angles = torch.outer(torch.arange(end, dtype=torch.float32, device=freqs.device), freqs.float())
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _cos_sin(rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [(bs,) seqlen, 1, dim // 2], broadcasting over the heads of [bs, seqlen, heads, dim]."""
    cos, sin = rope.unsqueeze(-2).chunk(2, dim=-1)
    return cos, sin


def apply_rope_interleaved(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate x [bs, seqlen, heads, dim] by rope ([seqlen, dim] shared by the batch or
    [bs, seqlen, dim]) with pairs (2i, 2i+1); computed in float32, returned in x's dtype."""
    cos, sin = _cos_sin(rope)
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def apply_rope_half(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Like ``apply_rope_interleaved`` with pairs (i, i + dim/2) (Hugging Face ``rotate_half``)."""
    cos, sin = _cos_sin(rope)
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1).type_as(x)
