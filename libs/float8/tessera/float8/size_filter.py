"""Which linears are worth float8: the hardware rule and torchao's measured size thresholds.

A linear's weight is [N, K] (out_features, in_features); a token batch of M rows makes an
M x K x N matmul. float8 adds per-call work (amax, scale, cast of input, weight and grad) that
scales with M*K + K*N + M*N, while it saves on the M*K*N matmul, so small K or N lose. The
thresholds are torchao 0.18's `_auto_filter_for_tensorwise` / `_auto_filter_for_rowwise`
(torchao/float8/float8_linear_utils.py), from its H100 benchmark tables
(https://github.com/pytorch/ao/tree/main/torchao/float8#performance); torchtitan applies them
when `filter_fqns` holds "auto_filter_small_kn".
"""

from __future__ import annotations

from torch import nn


def fits_float8_hardware(linear: nn.Linear) -> bool:
    """torch._scaled_mm needs both K and N to be multiples of 16."""
    n, k = linear.weight.shape
    return n % 16 == 0 and k % 16 == 0


def large_enough(linear: nn.Linear, recipe_name: str) -> bool:
    """True where torchao's benchmarks show float8 gaining for this recipe.

    torchao measured no thresholds for rowwise_with_gw_hp; it uses rowwise's, a lower bound:
    its forward and grad-input matmuls are rowwise float8 and its grad-weight matmul stays in
    high precision, so it gains at most what rowwise gains.
    """
    n, k = linear.weight.shape
    if recipe_name == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
