import math

import torch

from tessera.models.llama import RopeScaling, apply_rotary_emb, precompute_freqs_cis, rope_frequencies


def test_llama31_scaling_matches_hand_computation():
    head_dim, theta = 128, 500000.0
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    plain = rope_frequencies(head_dim, theta)
    scaled = rope_frequencies(head_dim, theta, scaling)
    bands = set()
    for i in range(head_dim // 2):
        freq = theta ** (-2 * i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4:  # high frequency: unchanged
            expected, band = freq, "high"
        elif wavelen > 8192 / 1:  # low frequency: divided by the factor
            expected, band = freq / 8, "low"
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            expected, band = (1 - smooth) * freq / 8 + smooth * freq, "mid"
            assert freq / 8 < expected < freq
        bands.add(band)
        assert math.isclose(scaled[i].item(), expected, rel_tol=1e-5), i
        assert math.isclose(plain[i].item(), freq, rel_tol=1e-5), i
    assert bands == {"high", "mid", "low"}


def test_freqs_cis_are_unit_rotations_by_position():
    freqs_cis = precompute_freqs_cis(8, 5, 10000.0)
    assert freqs_cis.shape == (5, 4) and freqs_cis.dtype == torch.complex64
    torch.testing.assert_close(freqs_cis.abs(), torch.ones(5, 4))
    torch.testing.assert_close(freqs_cis[3].angle(), 3 * rope_frequencies(8, 10000.0))


def test_rotation_depends_only_on_relative_position():
    head_dim = 8
    freqs_cis = precompute_freqs_cis(head_dim, 12, 10000.0)
    q, k = torch.randn(1, 1, 1, head_dim), torch.randn(1, 1, 1, head_dim)

    def score(q_pos, k_pos):
        rq, _ = apply_rotary_emb(q, q, freqs_cis[q_pos : q_pos + 1])
        _, rk = apply_rotary_emb(k, k, freqs_cis[k_pos : k_pos + 1])
        return (rq * rk).sum()

    torch.testing.assert_close(score(5, 2), score(9, 6))
