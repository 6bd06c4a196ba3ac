"""Warmup-stable-decay learning-rate schedule (linear warmup, optional plateau, decay)."""

from __future__ import annotations

import functools
import math

import torch

DECAY_TYPES = ("linear", "sqrt", "cosine")


def lr_factor(
    step: int, *, warmup_steps: int, total_steps: int, decay_ratio: float | None,
    decay_type: str, min_lr_factor: float,
) -> float:
    """Multiplier of the base lr for optimizer step `step` (1-based: the first update is step 1).

    Warmup rises linearly to 1 over warmup_steps; decay covers the last decay_ratio of the steps
    after warmup (None: all of them, i.e. no stable phase) and falls from 1 to min_lr_factor.
    """
    if step <= warmup_steps:
        return step / (warmup_steps + 1)  # never 0: a zero first lr would waste a step
    after_warmup = total_steps - warmup_steps
    decay_steps = after_warmup if decay_ratio is None else round(after_warmup * decay_ratio)
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps == 0:
        return 1.0
    progress = min((step - decay_start) / decay_steps, 1.0)
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr decay_type {decay_type!r}")
    return min_lr_factor + (1.0 - min_lr_factor) * remaining


def build_lr_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, **schedule) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over lr_factor; LambdaLR counts from 0, so epoch e sets the lr of step e + 1."""
    factor = functools.partial(lr_factor, total_steps=total_steps, **schedule)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: factor(epoch + 1))


class LockstepSchedulers:
    """The schedules of the per-part optimizers (one per pipeline stage), stepped together.
    They are equal, so one state is saved: the same as a single-part run's, and either loads
    into the other."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LRScheduler]) -> None:
        self.schedulers = schedulers

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict) -> None:
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state)
