"""The model family's part in each step (tessera.models.StepHooks, a ModelSpec field) wired into
the run: the loss scale once, the after-optimizer hook on every model part, and its readings
(MoE: tokens per expert) turned into metrics at log steps only, so ordinary steps read nothing
back from the device."""

from __future__ import annotations

import torch
from torch import nn

from tessera.mesh import Meshes
from tessera.trainer.plan import JobPlan


class FamilyHooks:
    """A post-optimizer hook (``hook(part)``) that also remembers what the family reported."""

    def __init__(self, plan: JobPlan, parts: list[nn.Module], meshes: Meshes) -> None:
        hooks = plan.spec.step_hooks
        for part in parts:  # the family divides its own whole-on-every-tp-rank losses by tp
            hooks.set_loss_scale(part, plan.loss.scale, plan.dims.tp)
            if plan.experts.force_load_balance:
                hooks.force_load_balance(part)
        self._after = hooks.after_optimizer_step
        # ranks whose tokens differ: their expert loads add up (a model-parallel rank sees its peers')
        self._group = meshes.loss.get_group() if meshes.loss is not None else None
        self._latest: dict[str, torch.Tensor] = {}

    def __call__(self, part: nn.Module) -> None:
        self._latest.update(self._after(part, self._group))

    def metrics(self) -> dict[str, float]:
        """Per reported layer: the fewest and most tokens an expert got in the last step, and
        max / mean (1 = balanced)."""
        if not self._latest:
            return {}
        names = list(self._latest)
        loads = torch.stack([self._latest[name].float() for name in names])
        rows = torch.stack([loads.min(dim=1).values, loads.max(dim=1).values, loads.max(dim=1).values / loads.mean(dim=1)])
        values = rows.t().tolist()  # one host read for every layer
        return {f"moe/{name}/{kind}": value for name, row in zip(names, values)
                for kind, value in zip(("load_min", "load_max", "imbalance"), row)}
