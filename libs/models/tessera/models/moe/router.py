"""Token-choice top-k routing (DeepSeek-V3 section 2.1.2, Qwen3-MoE)."""

import torch
from torch import nn

from tessera.models.moe.args import MoEArgs


def expert_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """Token-to-expert affinities [N, E] in float32: softmax over experts, or sigmoid per expert."""
    logits = logits.float()
    return logits.softmax(dim=-1) if score_func == "softmax" else logits.sigmoid()


def select_experts(scores: torch.Tensor, top_k: int, bias: torch.Tensor | None = None, n_groups: int = 1,
                   topk_groups: int = 1, group_score_top: int = 2) -> torch.Tensor:
    """Indices [N, top_k] of each token's experts: the top_k of ``scores + bias`` (the bias steers
    the choice only), restricted to the ``topk_groups`` best of ``n_groups`` groups of
    consecutive experts when n_groups > 1, a group scoring the sum of its ``group_score_top``
    best choice scores."""
    choice = scores if bias is None else scores + bias
    if n_groups > 1:
        groups = choice.unflatten(-1, (n_groups, -1))  # [N, G, E / G]
        group_scores = groups.topk(group_score_top, dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, kept, True)
        choice = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
    return choice.topk(top_k, dim=-1).indices


class TopKRouter(nn.Module):
    """gate: Linear(dim -> n_experts); forward(x [N, dim], bias [E] or None) ->
    (weights [N, top_k] float32, experts [N, top_k] long, scores [N, E] float32).

    ``force_load_balance`` (a debugging switch for benchmarks): slot i of the N * top_k goes to
    expert i mod E whatever the scores, so every expert gets the same load; weights are still
    the chosen experts' scores."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.gate = nn.Linear(dim, args.n_experts, bias=args.gate_bias)
        self.args = args
        self.force_load_balance = False

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None):
        a = self.args
        scores = expert_scores(self.gate(x), a.score_func)
        if self.force_load_balance:
            experts = torch.arange(scores.shape[0] * a.top_k, device=scores.device).remainder(a.n_experts).view(-1, a.top_k)
        else:
            experts = select_experts(scores, a.top_k, bias, a.n_groups, a.topk_groups, a.group_score_top)
        weights = scores.gather(-1, experts)
        if a.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * a.route_scale, experts, scores
