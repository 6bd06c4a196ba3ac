"""Rotary position embedding (RoFormer), in the interleaved complex form of Meta's Llama code.

Pairs of adjacent features (x[2i], x[2i+1]) are read as one complex number and rotated
by the angle ``position * freq_i``.
"""

import math

import torch

from tessera.models.llama.args import RopeScaling


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Rotation frequencies ``theta ** (-2i / head_dim)`` for i < head_dim/2, float32,
    with Llama 3.1 scaling applied when ``scaling`` is given."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return freqs
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / freqs
    # 0 at the low-frequency edge (wavelen == old_len / low), 1 at the high-frequency edge.
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > old_len / scaling.low_freq_factor, freqs / scaling.factor, smoothed)
    return torch.where(wavelen < old_len / scaling.high_freq_factor, freqs, scaled)


def precompute_freqs_cis(
    head_dim: int, end: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """``exp(i * t * freq)`` for positions t < end: complex64 of shape [end, head_dim // 2]."""
    freqs = rope_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k ([bs, seqlen, heads, head_dim]) by ``freqs_cis``: one rotation per token,
    [seqlen, head_dim // 2] shared by the batch or [bs, seqlen, head_dim // 2] per sequence."""
    rotation = freqs_cis.unsqueeze(-2)  # broadcast over heads (and batch when 2-D)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * rotation).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)
