"""Mixture-of-experts building blocks: top-k router (softmax or sigmoid scores, group-limited
choice), grouped experts, the MoE layer with shared experts, auxiliary-loss-free load balancing
and the sequence-wise balance loss."""

from tessera.models.moe.args import SCORE_FUNCS, MoEArgs
from tessera.models.moe.aux_loss import attach_aux_loss, sequence_balance_loss
from tessera.models.moe.balance import (
    expert_load, force_load_balance, load_imbalance, moe_layers, set_aux_loss_scale, update_expert_bias,
)
from tessera.models.moe.experts import (
    GroupedExperts, experts_grouped_mm, experts_loop, grouped_mm_supported, run_experts,
)
from tessera.models.moe.layer import MoE, combine, expert_counts
from tessera.models.moe.router import TopKRouter, expert_scores, select_experts
from tessera.models.moe.sharding import moe_tp_plan

__all__ = [
    "SCORE_FUNCS",
    "GroupedExperts",
    "MoE",
    "MoEArgs",
    "TopKRouter",
    "attach_aux_loss",
    "combine",
    "expert_counts",
    "expert_load",
    "expert_scores",
    "force_load_balance",
    "experts_grouped_mm",
    "experts_loop",
    "grouped_mm_supported",
    "load_imbalance",
    "moe_layers",
    "moe_tp_plan",
    "run_experts",
    "select_experts",
    "sequence_balance_loss",
    "set_aux_loss_scale",
    "update_expert_bias",
]
