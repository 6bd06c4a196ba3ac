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
        # what each forward's loss is multiplied by before backward: a pipeline divides it among its micro-batches too
        scale = plan.loss.scale / (plan.pipeline.microbatches if plan.pipeline is not None else 1)
        for part in parts:  # the family divides its own whole-on-every-tp-rank losses by tp
            hooks.set_loss_scale(part, scale, plan.dims.tp)
            if plan.loss.mtp_scale is not None:
                hooks.set_mtp_scale(part, plan.loss.mtp_scale * scale)
            if plan.experts.force_load_balance:
                hooks.force_load_balance(part)
            if plan.experts.capacity_factor is not None:
                hooks.set_expert_capacity(part, plan.experts.capacity_factor, plan.experts.capacity_overflow)
        self._after = hooks.after_optimizer_step
        # ranks whose tokens differ: their expert loads add up (a model-parallel rank sees its peers')
        self._group = meshes.loss.get_group() if meshes.loss is not None else None
        self._latest: dict[str, torch.Tensor] = {}

    def __call__(self, part: nn.Module) -> None:
        self._latest.update(self._after(part, self._group))

    def metrics(self) -> dict[str, float]:
        """Per reported layer: the fewest and most tokens an expert got in the last step, and
        max / mean (1 = balanced); with a capacity factor also the slots it dropped."""
        if not self._latest:
            return {}
        names = [name for name in self._latest if not name.endswith("/dropped")]
        dropped = [name for name in self._latest if name.endswith("/dropped")]
        loads = torch.stack([self._latest[name].float() for name in names])
        rows = torch.stack([loads.min(dim=1).values, loads.max(dim=1).values, loads.max(dim=1).values / loads.mean(dim=1)])
        values = torch.cat([rows.t().flatten(), *(self._latest[name].float().view(1) for name in dropped)]).tolist()
        # one host read for every layer
        metrics = {f"moe/{name}/{kind}": values[3 * i + j] for i, name in enumerate(names)
                   for j, kind in enumerate(("load_min", "load_max", "imbalance"))}
        return metrics | {f"moe/{name}": value for name, value in zip(dropped, values[3 * len(names):])}
