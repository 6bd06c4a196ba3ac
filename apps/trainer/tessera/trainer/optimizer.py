"""The optimizer of each model part, as torchtitan's [optimizer] keys describe it; public, so
tools (the estimator) build the very optimizer a run steps."""

from __future__ import annotations

import torch

from tessera.trainer.lr_schedule import build_lr_scheduler
from tessera.trainer.sub_plans import OptimizerPlan


def build_optimizer(part: torch.nn.Module, plan: OptimizerPlan) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        part.parameters(), lr=plan.lr, betas=plan.betas, eps=plan.eps, weight_decay=plan.weight_decay,
        foreach=plan.implementation == "foreach", fused=plan.implementation == "fused",
    )


def build_scheduler(optimizer: torch.optim.Optimizer, plan: OptimizerPlan) -> torch.optim.lr_scheduler.LambdaLR:
    """The plan's warmup-stable-decay schedule over its total steps."""
    return build_lr_scheduler(optimizer, plan.total_steps, warmup_steps=plan.warmup_steps, decay_ratio=plan.decay_ratio,
                              decay_type=plan.decay_type, min_lr_factor=plan.min_lr_factor)
