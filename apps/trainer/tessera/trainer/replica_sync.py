"""The step's seam for replicas of the whole job (fault tolerance's replica groups, torchft):
between the backward passes and clipping the step's gradients (and loss) become the replicas'
mean, and before the optimizer step the replicas decide whether the step counts. Without
replica groups the job is alone: nothing to average, every step counts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class ReplicaSync(Protocol):
    def average(self, params: Sequence[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        """Replaces every parameter's gradient with the replicas' mean; returns the mean loss."""

    def commit(self) -> bool:
        """Whether this step counts: the optimizer steps only if so (the same answer on every rank)."""


class Alone:
    """No replicas: the job's own gradients, and every step counts."""

    def average(self, params: Sequence[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        return loss

    def commit(self) -> bool:
        return True


ALONE = Alone()
