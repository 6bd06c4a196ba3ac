"""Rotary position embedding (RoFormer) in real arithmetic, in the two feature layouts models use.

A table holds ``cos`` and ``sin`` of ``position * freq_i`` side by side: ``[positions, dim]``, the
first ``dim // 2`` columns cosines, the rest sines, float32. A model indexes it by position ids
once and hands the rows to its blocks (one tensor, so it passes pipeline stages and compiled
blocks as one input).

Layouts (how feature pairs are formed inside a head of ``dim`` features):
- interleaved: pairs (2i, 2i+1), as the complex form of Meta's Llama and DeepSeek's reference
  code (DeepSeek-V3's Hugging Face weights are in this layout too);
- half: pairs (i, i + dim/2), Hugging Face's ``rotate_half`` (Qwen3, GPT-OSS, Llama in HF).
Pair i is rotated by the angle ``position * freq_i`` in both.

YaRN (Peng et al. 2023) rescales the frequencies for a longer context than the model was
pretrained on (DeepSeek-V2/V3, GPT-OSS): ``YarnScaling``, ``yarn_frequencies``.
"""

import math
from dataclasses import dataclass

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
    [bs, seqlen, dim]) with pairs (2i, 2i+1); computed in float32, returned in x's dtype. The
    pairs are adjacent, so the rotation is one complex multiply of x viewed as complex numbers:
    bit for bit the real form's (even cos - odd sin, even sin + odd cos) and, measured on CPU in
    eager mode, 7x faster forward and backward (one kernel instead of six and a stack)."""
    cos, sin = _cos_sin(rope)
    pairs = x.float().unflatten(-1, (-1, 2))
    # complex numbers need pairs at even offsets; compiled code gets a copy the compiler may drop
    # (dynamo cannot read a storage offset)
    if torch.compiler.is_compiling() or pairs.storage_offset() % 2 or any(s % 2 for s in pairs.stride()[:-1]):
        pairs = pairs.contiguous()
    return torch.view_as_real(torch.view_as_complex(pairs) * torch.complex(cos.float(), sin.float())).flatten(-2).type_as(x)


def apply_rope_half(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Like ``apply_rope_interleaved`` with pairs (i, i + dim/2) (Hugging Face ``rotate_half``)."""
    cos, sin = _cos_sin(rope)
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1).type_as(x)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling. Frequencies whose wavelength fits ``beta_fast`` times into the original
    context are kept, those fitting fewer than ``beta_slow`` times are divided by ``factor``,
    with a linear ramp between (its ends rounded out to whole frequencies when ``truncate``, as
    DeepSeek's code; GPT-OSS keeps them fractional); attention scores are multiplied by
    ``(0.1 * mscale * ln(factor) + 1) ** 2`` (Hugging Face's ``mscale_all_dim``; both q and k
    carry one factor in HF's code)."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    truncate: bool = True

    def attention_factor(self) -> float:
        """The factor on the softmax scale: (0.1 * mscale * ln(factor) + 1) ** 2."""
        return (0.1 * self.mscale * math.log(self.factor) + 1.0) ** 2 if self.factor > 1 else 1.0


def _correction_dim(rotations: float, dim: int, theta: float, context: int) -> float:
    """The index i (of dim // 2) whose wavelength 2 pi theta^(2i/dim) fits ``rotations`` times into ``context``."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_frequencies(dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """Frequencies [dim // 2] float32: ``theta ** (-2i / dim)``, YaRN-interpolated when ``yarn`` is
    given (when a model applies it is the model's rule: ``DeepSeekV3Args.yarn_active``)."""
    freqs = inverse_frequencies(dim, theta)
    if yarn is None:
        return freqs
    context = yarn.original_max_position_embeddings
    low = _correction_dim(yarn.beta_fast, dim, theta, context)
    high = _correction_dim(yarn.beta_slow, dim, theta, context)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    # 0 up to ``low`` (fast rotations: kept), 1 from ``high`` on (slow ones: divided by factor).
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return freqs / yarn.factor * ramp + freqs * (1 - ramp)
