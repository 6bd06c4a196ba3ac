"""Capacity-factor dispatch, GShard's and Megatron's "drop and pad": every expert takes at most C
of a layer's routed slots, so the experts' input is E groups of C rows whatever the routing:
static shapes, no count read on the host, expert-parallel splits known in advance.

    C = ceil(capacity_factor * slots / E), rounded up to the multiple the experts ask for

(slots: the layer's tokens on this rank times top_k; under expert parallel each rank's own,
before the exchange, so every rank sends C rows per expert.) Which slots an expert keeps: its C
with the highest routing weights (Megatron's "probs" drop policy). A slot over capacity:

- "drop": contributes nothing; its token keeps its other experts, the shared experts and the
  residual;
- "reroute": one more round: each dropped slot of a token goes to the token's best expert it has
  not chosen (by score + bias, as the router chooses; the group limit not applied), the token's
  j-th dropped slot to its j-th such expert, weighted by that expert's score on the same scale
  as the weight it replaces (the router's normalisation and route scale); an expert takes
  rerouted slots into the room the first round left it, best weights first; the rest drop.

With a factor large enough that no expert is over capacity the layer computes what the dropless
one does (the same rows through the same experts, in another layout).
"""

import math

import torch

CAPACITY_OVERFLOW = ("drop", "reroute")


def expert_capacity(n_slots: int, n_experts: int, factor: float, multiple: int = 1) -> int:
    """C: ``ceil(factor * n_slots / n_experts)``, at least 1, rounded up to ``multiple``."""
    capacity = max(1, math.ceil(factor * n_slots / n_experts))
    return -(-capacity // multiple) * multiple


def _positions(expert: torch.Tensor, priority: torch.Tensor, n_groups: int):
    """Each slot's place among its expert's slots, highest priority first, and the slots per
    expert ([n_groups]): two stable sorts and a scatter, static sizes."""
    by_priority = torch.argsort(priority, descending=True, stable=True)
    order = by_priority[torch.argsort(expert[by_priority], stable=True)]
    counts = torch.zeros(n_groups, dtype=torch.long, device=expert.device).scatter_add_(0, expert, torch.ones_like(expert))
    starts = counts.cumsum(0) - counts
    place = torch.arange(expert.shape[0], device=expert.device) - starts[expert[order]]
    return torch.empty_like(expert).scatter_(0, order, place), counts


def assign_capacity(experts: torch.Tensor, weights: torch.Tensor, scores: torch.Tensor, choice: torch.Tensor,
                    capacity: int, overflow: str = "drop"):
    """experts, weights [N, K]: the router's choice and weights; scores [N, E]: the affinities
    the weights come from; choice [N, E]: what the router ranks experts by (scores + bias).
    Returns (row of each slot in the [E * capacity] buffer ([N * K] long; E * capacity where the
    slot is dropped), the weights ([N, K], zero where dropped, a rerouted slot's new weight),
    kept [N, K] bool, slots dropped ([] long)). No host read."""
    n_tokens, top_k = experts.shape
    n_experts = scores.shape[-1]
    flat, w = experts.flatten(), weights.flatten()
    place, counts = _positions(flat, w, n_experts)
    kept = place < capacity
    dest = torch.where(kept, flat * capacity + place, n_experts * capacity)
    if overflow == "reroute":
        dropped = ~kept
        unchosen = choice.scatter(-1, experts, float("-inf"))
        next_score, next_expert = unchosen.topk(min(top_k, n_experts), dim=-1)
        nth = (dropped.view(n_tokens, top_k).cumsum(-1) - 1).clamp(min=0, max=next_expert.shape[-1] - 1)
        new_expert = next_expert.gather(-1, nth).flatten()
        candidate = dropped & (next_score.gather(-1, nth).flatten() > float("-inf"))
        old_score = scores.gather(-1, experts).flatten()
        scale = torch.where(old_score > 0, w / old_score.clamp(min=torch.finfo(old_score.dtype).tiny), 0.0)
        new_weight = scores.gather(-1, new_expert.view(n_tokens, top_k)).flatten() * scale
        taken = counts.clamp(max=capacity)
        group = torch.where(candidate, new_expert, n_experts)  # n_experts: not rerouted
        place2, _ = _positions(group, new_weight, n_experts + 1)
        used = torch.cat([taken, taken.new_full((1,), capacity)])[group]
        moved = candidate & (place2 < capacity - used)
        dest = torch.where(moved, new_expert * capacity + used + place2, dest)
        w = torch.where(moved, new_weight, w)
        kept = kept | moved
    weights = torch.where(kept, w, 0.0).view(n_tokens, top_k)
    return dest, weights, kept.view(n_tokens, top_k), (~kept).sum()
