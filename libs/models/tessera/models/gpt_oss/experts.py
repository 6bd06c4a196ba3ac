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
"""

import torch
from torch import nn


def clamped_swiglu(h: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """[..., 2 hidden] interleaved gate/up -> [..., hidden] (the module docstring's formula)."""
    gate, up = h[..., 0::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


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

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """One expert at a time over its rows (reads the counts on the host)."""
        bias_share = self.down_proj.shape[1] / self.hidden_dim  # 1, or 1/tp of the hidden features
        outputs = []
        for e, rows in enumerate(x.split(num_tokens_per_expert.tolist())):
            hidden = clamped_swiglu(rows @ self.gate_up_proj[e] + self.gate_up_proj_bias[e], self.limit, self.alpha)
            outputs.append(hidden @ self.down_proj[e] + bias_share * self.down_proj_bias[e])
        return torch.cat(outputs)
