"""RoPE frequencies of DeepSeek-V2/V3's rotary dims, with YaRN scaling (see ``YarnScaling``)."""

import math

import torch

from tessera.models.deepseek_v3.args import YarnScaling
from tessera.models.rotary import inverse_frequencies


def _correction_dim(rotations: float, dim: int, theta: float, context: int) -> float:
    """The index i (of dim // 2) whose wavelength 2 pi theta^(2i/dim) fits ``rotations`` times into ``context``."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_frequencies(dim: int, theta: float, yarn: YarnScaling | None, max_seq_len: int) -> torch.Tensor:
    """Frequencies [dim // 2] float32: ``theta ** (-2i / dim)``, YaRN-interpolated when ``yarn`` is
    given and ``max_seq_len`` exceeds its original context."""
    freqs = inverse_frequencies(dim, theta)
    if yarn is None or max_seq_len <= yarn.original_max_position_embeddings:
        return freqs
    context = yarn.original_max_position_embeddings
    low = max(math.floor(_correction_dim(yarn.beta_fast, dim, theta, context)), 0)
    high = min(math.ceil(_correction_dim(yarn.beta_slow, dim, theta, context)), dim - 1)
    # 0 up to ``low`` (fast rotations: kept), 1 from ``high`` on (slow ones: divided by factor).
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return freqs / yarn.factor * ramp + freqs * (1 - ramp)
