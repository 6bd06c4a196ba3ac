"""The mixture-of-experts feed-forward layer: route, dispatch, run the experts, combine.

    y_t = shared_experts(x_t) + sum_k w_{t,k} * expert_{e_{t,k}}(x_t)

Dispatch sorts the (token, k) slots by expert (a stable argsort, no loop over tokens), hands the
experts submodule the gathered rows and the number per expert, and puts the results back in slot
order with an index copy; each token's k results are then summed with their weights: one
permutation each way, nothing read on the host. With a capacity factor (``capacity.py``,
``set_expert_capacity``) each expert gets exactly C rows instead (static shapes): the slots are
placed into an [E * C] buffer by one gather, and each slot's result read back by another.
``experts`` is a seam: expert parallelism replaces or wraps it with a module of the same
signature that exchanges rows between ranks (see ``tessera.models.moe.experts``).
"""

import math

import torch
from torch import nn

from tessera.models.feed_forward import FeedForward
from tessera.models.moe.args import MoEArgs
from tessera.models.moe.aux_loss import attach_aux_loss, sequence_balance_loss
from tessera.models.moe.capacity import assign_capacity, expert_capacity
from tessera.models.moe.experts import GroupedExperts
from tessera.models.moe.router import TopKRouter


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Slots routed to each expert, [n_experts] long (a fixed-size scatter: no device sync)."""
    flat = experts.flatten()
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def combine(routed: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """routed [N * K, dim] in expert order (row j is slot ``order[j]`` = token * K + k) ->
    [N, dim], each token's K rows summed with its weights [N, K]."""
    n_tokens, top_k = weights.shape
    by_slot = torch.zeros_like(routed).index_copy(0, order, routed).view(n_tokens, top_k, -1)
    return torch.bmm(weights.unsqueeze(1).to(routed.dtype), by_slot).squeeze(1)


def _recomputing() -> bool:
    """Whether this forward is an activation-checkpoint recomputation: one that runs inside
    backward (FSDP2 tells them apart the same way). Compiled code recomputes in its own backward
    graph without rerunning this Python."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """x [B, T, dim] -> [B, T, dim]. Submodules ``router`` (``gate``), ``experts``
    (``GroupedExperts``, or the module given: ``forward(x, num_tokens_per_expert)`` and
    ``init_weights(init_std)``), ``shared_experts`` (a SwiGLU, or None).

    Buffers: ``expert_bias`` [E] float32 (persistent; added to the scores to choose experts,
    updated by ``tessera.models.moe.update_expert_bias``), ``tokens_per_expert`` [E] long (slots
    routed by training forwards since the last update; activation-checkpoint recomputations do
    not count: split-backward pipeline schedules recompute some micro-batches more often than
    others, which would skew the load), ``aux_loss`` (the
    last sequence-wise balance loss, times alpha, for logging), ``dropped_slots`` (slots over
    capacity that training forwards dropped since the last bias update; 0 when dropless).

    ``capacity_factor`` None (the default): dropless, exact. A number: capacity-factor dispatch
    (``tessera.models.moe.capacity``), with ``capacity_overflow`` "drop" or "reroute".
    """

    def __init__(self, dim: int, args: MoEArgs, experts: nn.Module | None = None):
        super().__init__()
        self.args = args
        self.router = TopKRouter(dim, args)
        # a family with experts of its own layout (GPT-OSS) passes them; they follow the same seam
        self.experts = experts if experts is not None else GroupedExperts(dim, args.hidden_dim, args.n_experts)
        shared = args.n_shared_experts * args.hidden_dim
        self.shared_experts = FeedForward(dim, shared) if shared else None
        self.aux_loss_scale = 1.0  # the trainer's loss scale (set_aux_loss_scale)
        self.capacity_factor: float | None = None  # set_expert_capacity
        self.capacity_overflow = "drop"
        self.register_buffer("expert_bias", torch.zeros(args.n_experts, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts, dtype=torch.long), persistent=False)
        self.register_buffer("aux_loss", torch.zeros((), dtype=torch.float32), persistent=False)
        self.register_buffer("dropped_slots", torch.zeros((), dtype=torch.long), persistent=False)

    def init_weights(self, init_std: float, buffer_device: torch.device | str | None = None) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        with torch.device(buffer_device or self.expert_bias.device):
            self.expert_bias = torch.zeros(self.args.n_experts, dtype=torch.float32)
            self.tokens_per_expert = torch.zeros(self.args.n_experts, dtype=torch.long)
            self.aux_loss = torch.zeros((), dtype=torch.float32)
            self.dropped_slots = torch.zeros((), dtype=torch.long)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # Module.to(dtype) casts buffers too (rounding the bias once); later 1e-3 steps need float32.
        if self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq_len, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, experts, scores = self.router(tokens, self.expert_bias)
        counts = expert_counts(experts, self.args.n_experts)
        # the bias follows the training tokens' load, not validation's, each token once
        counting = self.training and not _recomputing()
        if counting:
            with torch.no_grad():
                self.tokens_per_expert += counts
        if self.capacity_factor is not None:
            out = self._with_capacity(tokens, weights, experts, scores, counting)
        else:
            order = torch.argsort(experts.flatten(), stable=True)
            rows = tokens[order // self.args.top_k]
            if self.args.score_before_experts:  # the expert sees its input scaled by the routing weight
                rows = rows * weights.flatten()[order].unsqueeze(-1).to(rows.dtype)
                weights = torch.ones_like(weights)
            routed = self.experts(rows, counts)
            out = combine(routed, order, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        out = out.view(bs, seq_len, dim)
        if self.args.aux_loss_alpha and torch.is_grad_enabled():
            balance = sequence_balance_loss(scores.view(bs, seq_len, -1), experts.view(bs, seq_len, -1))
            loss = self.args.aux_loss_alpha * balance
            self.aux_loss.copy_(loss.detach())
            out = attach_aux_loss(out, loss, self.aux_loss_scale)
        return out

    def _with_capacity(self, tokens: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, scores: torch.Tensor,
                       counting: bool) -> torch.Tensor:
        """The routed experts' part of the output with capacity-factor dispatch: the experts get
        [E * C, dim] (C rows each, empty ones zero) and no counts."""
        n_tokens, top_k = experts.shape
        n_experts, slots = self.args.n_experts, experts.numel()
        capacity = expert_capacity(slots, n_experts, self.capacity_factor, capacity_multiple(self.experts))
        choice = (scores if self.router.force_load_balance else scores + self.expert_bias).detach()
        dest, weights, kept, dropped = assign_capacity(experts, weights, scores, choice, capacity, self.capacity_overflow)
        rows = n_experts * capacity
        with torch.no_grad():
            if counting:
                self.dropped_slots += dropped
            # the slot each buffer row holds (slots, an empty row's mark, reads the zero row below)
            slot_of_row = torch.full((rows + 1,), slots, dtype=torch.long, device=tokens.device)
            slot_of_row = slot_of_row.scatter_(0, dest, torch.arange(slots, device=tokens.device))[:rows]
        buffer = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[-1])])[slot_of_row // top_k]
        if self.args.score_before_experts:  # the expert sees its input scaled by the routing weight
            scale = torch.cat([weights.flatten(), weights.new_zeros(1)])[slot_of_row]
            buffer = buffer * scale.unsqueeze(-1).to(buffer.dtype)
            weights = kept.to(weights.dtype)
        routed = self.experts(buffer, None)
        # a dropped slot reads some row, weighted 0
        by_slot = routed[dest.clamp(max=rows - 1)].view(n_tokens, top_k, -1)
        return torch.bmm(weights.unsqueeze(1).to(routed.dtype), by_slot).squeeze(1)


def capacity_multiple(experts: nn.Module) -> int:
    """What the experts need C to be a multiple of: a low-precision recipe's block
    (``token_group_alignment``) and an expert-parallel split of each expert's rows over tensor
    parallel ranks (``capacity_multiple``, set by tessera.ep)."""
    return math.lcm(getattr(experts, "token_group_alignment", 0) or 1, getattr(experts, "capacity_multiple", 1))
