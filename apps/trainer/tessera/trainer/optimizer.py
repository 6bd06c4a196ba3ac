"""The optimizers of each model part, as the job plan's [optimizer] describes them: AdamW over
its parameter groups (tessera.optim.AdamW for bfloat16 moments), and under Muon
tessera.optim.Muon for the matrices the plan gave it;
public, so tools (the estimator) build the very optimizers a run steps."""

from __future__ import annotations

import dataclasses

import torch

from tessera.optim import AdamW, Muon
from tessera.trainer.lr_schedule import LockstepSchedulers, build_lr_scheduler
from tessera.trainer.param_groups import part_groups
from tessera.trainer.sub_plans import OptimizerPlan


@dataclasses.dataclass
class PartOptimizers:
    per_part: list[list[torch.optim.Optimizer]]  # as tessera.ckpt's OptimizerState saves them
    scheduler: LockstepSchedulers  # every optimizer's schedule, stepped together

    @property
    def all(self) -> list[torch.optim.Optimizer]:
        return [optimizer for optimizers in self.per_part for optimizer in optimizers]


def build_optimizers(parts: list[torch.nn.Module], plan: OptimizerPlan) -> PartOptimizers:
    """The optimizers of every model part, and their schedules."""
    per_part = [part_optimizers(part, plan) for part in parts]
    schedules = [build_scheduler(optimizer, plan) for optimizers in per_part for optimizer in optimizers]
    return PartOptimizers(per_part, LockstepSchedulers(schedules, plan.lr))


def part_optimizers(part: torch.nn.Module, plan: OptimizerPlan) -> list[torch.optim.Optimizer]:
    """This part's optimizers (AdamW, then Muon when it steps any of the part's parameters): one
    torch param group per plan group, its lr the scheduled lr times the group's lr_scale."""
    groups = {"adamw": [], "muon": []}
    for group, params in part_groups(part, plan.groups):
        groups[group.algorithm].append({"params": params, "lr": plan.lr * group.lr_scale,
                                        "weight_decay": group.weight_decay})
    optimizers = []
    adamw = dict(lr=plan.lr, betas=plan.betas, eps=plan.eps, weight_decay=plan.weight_decay)
    if groups["adamw"] and plan.state_dtype is not None:
        optimizers.append(AdamW(groups["adamw"], **adamw, state_dtype=plan.state_dtype))
    elif groups["adamw"]:  # Adam: torch's, weight decay in the gradient (the "adamw" groups of every non-Muon run)
        kind = torch.optim.Adam if plan.name == "Adam" else torch.optim.AdamW
        optimizers.append(kind(groups["adamw"], **adamw, foreach=plan.implementation == "foreach",
                               fused=plan.implementation == "fused"))
    if groups["muon"]:
        muon = plan.muon
        optimizers.append(Muon(groups["muon"], lr=plan.lr, weight_decay=plan.weight_decay, momentum=muon.momentum,
                               nesterov=muon.nesterov, ns_steps=muon.ns_steps, adjust_lr_fn=muon.adjust_lr,
                               ns_dtype=muon.ns_dtype))
    return optimizers


def build_scheduler(optimizer: torch.optim.Optimizer, plan: OptimizerPlan) -> torch.optim.lr_scheduler.LambdaLR:
    """The plan's warmup-stable-decay schedule over its total steps, for every group in
    proportion to its lr."""
    return build_lr_scheduler(optimizer, plan.total_steps, warmup_steps=plan.warmup_steps, decay_ratio=plan.decay_ratio,
                              decay_type=plan.decay_type, min_lr_factor=plan.min_lr_factor)
