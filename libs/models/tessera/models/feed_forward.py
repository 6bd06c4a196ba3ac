"""The dense SwiGLU MLP of every family (Shazeer 2020), and the init of its projections."""

import torch
import torch.nn.functional as F
from torch import nn

BASE_INIT_STD = 0.02


def trunc_normal(weight: torch.Tensor, std: float) -> None:
    """Truncated normal init; bounds are absolute (+-2), as in torchtitan: for std <= 0.02 this
    barely truncates."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        trunc_normal(self.w1.weight, BASE_INIT_STD)
        trunc_normal(self.w2.weight, init_std)
        trunc_normal(self.w3.weight, init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
