"""GPT-OSS's routed experts: the clamped SwiGLU with biases, gate and up projections interleaved
in one tensor, as the released checkpoints store them.

    h = x W_gate_up + b_gate_up;  gate, up = h[..., 0::2], h[..., 1::2]
    g = min(gate, limit);  u = clamp(up, -limit, limit)
    y = ((u + 1) * g * sigmoid(alpha g)) W_down + b_down        (alpha 1.702, limit 7)

Weights are laid out as Hugging Face's ``GptOssExperts`` holds them (x @ W: ``gate_up_proj``
[E, dim, 2 hidden], ``down_proj`` [E, hidden, dim]), so checkpoints map without transposes.
The module follows tessera's experts seam (``tessera.models.moe.experts``): rows grouped by
expert, every parameter stacked on dim 0, the number of experts read from the weights, so an
expert-parallel rank runs its local experts as is.

Tensor parallel splits each expert on its hidden features (``tp_shard_dims``: gate/up columns in
whole pairs, since a shard of an even count of interleaved columns holds whole pairs; down's
rows). The ranks' outputs are then partial sums, so each adds the share of ``down_proj_bias``
its hidden features are of the whole: the shares add up to the bias once.

As ``GroupedExperts``, the experts run without a loop over experts, in any dtype: grouped
matmuls for rows with counts (``tessera.models.moe.grouped_mm``), batched ones for E equal groups
(capacity-factor dispatch, counts None). The grouped path adds each row's biases by its expert
index: the gate/up bias to the real rows only, so a padding row stays zero through the
activation (clamped_swiglu(0) = 0) and adds nothing to any gradient. In the batched path an
empty capacity row gets the biases too; nothing reads its output, so it adds nothing either.
torchao's low-precision grouped GEMMs (tessera.float8.convert_grouped_mm) do not fit these
weights: they quantise each expert's weight stored (out, in), and HF's layout is (in, out).
"""

from collections.abc import Callable

import torch
from torch import nn

from tessera.models.moe.experts import pad_groups, row_alignment
from tessera.models.moe.grouped_mm import grouped_mm


def clamped_swiglu(h: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """[..., 2 hidden] interleaved gate/up -> [..., hidden] (the module docstring's formula)."""
    gate, up = h[..., 0::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def experts_grouped_mm(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, gate_up: torch.Tensor,
                       gate_up_bias: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor,
                       activation: Callable) -> torch.Tensor:
    """Two grouped matmuls over ``pad_groups``' layout (the weights are already [E, in, out];
    x as it is on CPU), each row's biases gathered by its expert: no loop, no host sync."""
    padded, offsets, rows = pad_groups(x, num_tokens_per_expert, row_alignment(x))
    expert = torch.repeat_interleave(torch.arange(gate_up.shape[0], device=x.device), num_tokens_per_expert,
                                     output_size=x.shape[0])
    h = grouped_mm(padded, gate_up, offsets)
    h = h + gate_up_bias[expert] if rows is None else h.index_add(0, rows, gate_up_bias[expert])
    out = grouped_mm(activation(h), down, offsets)
    return (out if rows is None else out[rows]) + down_bias[expert]


def experts_bmm(x: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                down_bias: torch.Tensor, activation: Callable) -> torch.Tensor:
    """x [E * C, dim]: C rows for each expert -> [E * C, dim], two batched matmuls (static shapes)."""
    rows = x.view(gate_up.shape[0], -1, x.shape[-1])
    h = torch.baddbmm(gate_up_bias.unsqueeze(1), rows, gate_up)
    return torch.baddbmm(down_bias.unsqueeze(1), activation(h), down).view(x.shape)


class GptOssExperts(nn.Module):
    """``n_experts`` clamped-SwiGLU MLPs with biases: forward(x [N, dim] grouped by expert,
    num_tokens_per_expert [E]) -> [N, dim]."""

    tp_shard_dims = {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1}

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, limit: float, alpha: float):
        super().__init__()
        self.hidden_dim, self.limit, self.alpha = hidden_dim, limit, alpha
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden_dim))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(n_experts, dim))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate_up_proj, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.down_proj, mean=0.0, std=init_std)
        nn.init.zeros_(self.gate_up_proj_bias)
        nn.init.zeros_(self.down_proj_bias)

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(h, self.limit, self.alpha)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor | None) -> torch.Tensor:
        """Grouped matmuls for rows with counts, batched ones for E equal groups (counts None)."""
        bias_share = self.down_proj.shape[1] / self.hidden_dim  # 1, or 1/tp of the hidden features
        weights = (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, bias_share * self.down_proj_bias)
        if num_tokens_per_expert is None:
            return experts_bmm(x, *weights, self.activation)
        return experts_grouped_mm(x, num_tokens_per_expert, *weights, self.activation)
