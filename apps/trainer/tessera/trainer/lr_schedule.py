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
    """Multiplier of the base lr for optimizer step `step` (1-based: the first update is step 1),
    with torchtitan 0.2's meaning of each setting, so a config gives the same curve in both.

    Warm-up: step s <= warmup_steps uses s / warmup_steps. Decay covers the last
    round(decay_ratio * total_steps) steps (None: every step after warm-up) and runs towards
    min_lr_factor as if there were one step more, so the last step's lr is not the floor; steps
    in between keep the full lr. Warm-up and decay are cut to fit total_steps; steps past
    total_steps (training longer than the schedule) stay at the floor.
    """
    warmup = min(warmup_steps, total_steps)
    decay = decay_steps(total_steps, warmup_steps, decay_ratio)
    if step <= warmup:
        return step / warmup
    decay_start = total_steps + 1 - decay  # the last step at the full lr
    if step <= decay_start or decay == 0:  # no decay phase: full lr to the end and past it
        return 1.0
    progress = min((step - decay_start) / decay, 1.0)
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr decay_type {decay_type!r}")
    return min_lr_factor + (1.0 - min_lr_factor) * remaining


def decay_steps(total_steps: int, warmup_steps: int, decay_ratio: float | None) -> int:
    """The steps the decay covers, as torchtitan counts them: round(decay_ratio * total_steps),
    cut to the steps after warm-up (all of them when decay_ratio is None)."""
    after_warmup = total_steps - min(warmup_steps, total_steps)
    return after_warmup if decay_ratio is None else min(round(total_steps * decay_ratio), after_warmup)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, **schedule) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over lr_factor; LambdaLR counts from 0, so epoch e sets the lr of step e + 1."""
    factor = functools.partial(lr_factor, total_steps=total_steps, **schedule)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: factor(epoch + 1))


class LockstepSchedulers:
    """The schedules of every optimizer (per pipeline stage, AdamW and Muon), stepped together.
    They share one position, so one is saved: the same as a single-optimizer run's, and either
    loads into the other; each keeps its own groups' base lrs."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LambdaLR], lr: float) -> None:
        """lr: the optimizer's lr, of which get_last_lr gives the scheduled share (a group's
        lr_scale left out)."""
        self.schedulers, self.lr = schedulers, lr
        self.replaced: float | None = None  # a loaded checkpoint's optimizer.lr, where it differs from lr

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> list[float]:
        first = self.schedulers[0]
        return [self.lr * first.lr_lambdas[0](first.last_epoch)]

    def state_dict(self) -> dict:
        first = self.schedulers[0].state_dict()
        return {"last_epoch": first["last_epoch"], "_step_count": first["_step_count"]}

    def load_state_dict(self, state: dict) -> None:
        """The position. Every group's lr follows this run's lr from there, also where the
        optimizer's state (loaded before) brought a checkpoint's other lr: the lr logged is the lr
        applied, from the first step on. That other lr is kept in ``replaced`` to be said. A load
        that leaves the schedule out calls this with the run's own position (``state_dict()``)."""
        self.replaced = None
        for scheduler in self.schedulers:
            factor = scheduler.lr_lambdas[0](state["last_epoch"])
            for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
                saved = group.get("initial_lr", base)
                if self.replaced is None and not math.isclose(saved, base, rel_tol=1e-6):
                    self.replaced = self.lr * saved / base if base else saved  # a group of lr 0 states its own
                group["initial_lr"], group["lr"] = base, base * factor
            own = scheduler.state_dict()
            own.update(last_epoch=state["last_epoch"], _step_count=state["_step_count"],
                       _last_lr=[group["lr"] for group in scheduler.optimizer.param_groups])
            scheduler.load_state_dict(own)
