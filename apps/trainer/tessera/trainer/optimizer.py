"""The optimizer of each model part, as torchtitan's [optimizer] keys describe it; public, so
tools (the estimator) build the very optimizer a run steps."""

from __future__ import annotations

import torch

from tessera.trainer.config import JobConfig


def build_optimizer(part: torch.nn.Module, config: JobConfig) -> torch.optim.Optimizer:
    opt = config.optimizer
    return torch.optim.AdamW(
        part.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay,
        foreach=opt.implementation == "foreach", fused=opt.implementation == "fused",
    )
