"""Mixture-of-experts building blocks: top-k router (softmax or sigmoid scores, group-limited
choice), grouped experts, the MoE layer with shared experts (dropless, or with a capacity factor),
auxiliary-loss-free load balancing and the sequence-wise balance loss."""

from tessera.models.moe.args import SCORE_FUNCS, MoEArgs
from tessera.models.moe.aux_loss import attach_aux_loss, sequence_balance_loss
from tessera.models.moe.balance import (
    expert_load, force_load_balance, load_imbalance, moe_layers, set_aux_loss_scale, set_expert_capacity,
    update_expert_bias,
)
from tessera.models.moe.capacity import CAPACITY_OVERFLOW, assign_capacity, expert_capacity
from tessera.models.moe.experts import (
    GroupedExperts, experts_bmm, experts_grouped_mm, pad_groups, row_alignment, run_experts,
)
from tessera.models.moe.grouped_mm import grouped_mm
from tessera.models.moe.layer import MoE, capacity_multiple, combine, expert_counts
from tessera.models.moe.router import TopKRouter, expert_scores, select_experts
from tessera.models.moe.sharding import moe_tp_plan

__all__ = [
    "CAPACITY_OVERFLOW",
    "SCORE_FUNCS",
    "GroupedExperts",
    "MoE",
    "MoEArgs",
    "TopKRouter",
    "assign_capacity",
    "attach_aux_loss",
    "capacity_multiple",
    "combine",
    "expert_capacity",
    "expert_counts",
    "expert_load",
    "expert_scores",
    "force_load_balance",
    "experts_bmm",
    "experts_grouped_mm",
    "grouped_mm",
    "load_imbalance",
    "moe_layers",
    "moe_tp_plan",
    "pad_groups",
    "row_alignment",
    "run_experts",
    "select_experts",
    "sequence_balance_loss",
    "set_aux_loss_scale",
    "set_expert_capacity",
    "update_expert_bias",
]
