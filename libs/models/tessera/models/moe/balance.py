"""What a training loop calls on a model's MoE layers: the auxiliary-loss-free bias update (a
post-optimizer hook), the aux-loss scale, the dispatch's capacity, expert-load and dropped-slot
readings for metrics."""

import torch
import torch.distributed as dist
from torch import nn

from tessera.models.module_names import unwrapped_name
from tessera.models.moe.capacity import CAPACITY_OVERFLOW
from tessera.models.moe.layer import MoE
from tessera.models.spec import StepHooks


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """The MoE layers of ``model`` (or of a pipeline stage) by module path, wrappers left out
    (the same names, and metrics, with or without checkpointing and compile)."""
    return {unwrapped_name(name): module for name, module in model.named_modules() if isinstance(module, MoE)}


def expert_load(model: nn.Module) -> dict[str, torch.Tensor]:
    """Slots routed to each expert since the last bias update, per MoE layer ([E] long, this
    rank's tokens only)."""
    return {name: layer.tokens_per_expert.clone() for name, layer in moe_layers(model).items()}


def load_imbalance(counts: torch.Tensor) -> torch.Tensor:
    """max / mean of per-expert loads: 1 when balanced, E when one expert takes every slot."""
    counts = counts.float()
    return counts.max() / counts.mean()


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """Auxiliary-loss-free load balancing (DeepSeek-V3 section 2.1.2; Wang et al. 2024): per MoE
    layer, ``expert_bias += rate * sign(mean load - load)``, so overloaded experts get chosen
    less; then the counts restart from zero. Call it after every optimizer step, on every rank
    (a post-optimizer hook ``hook(model)``: ``functools.partial(update_expert_bias, group=...)``).

    group: the ranks whose tokens count together (every rank that routes different tokens: the
    data-parallel and context-parallel ranks); their counts are summed with one all-reduce so
    every rank applies the same update. Returns the loads used, per layer ([E] long), for metrics,
    and for layers with a capacity factor the slots they dropped (``<layer>/dropped``, [] long),
    summed over ``group`` in the same all-reduce; those counts restart too.
    """
    layers = moe_layers(model)
    if not layers:
        return {}
    # each layer's loads and dropped slots in one row, so one all-reduce sums them all
    counts = torch.stack([torch.cat([layer.tokens_per_expert, layer.dropped_slots.view(1)]) for layer in layers.values()])
    if group is not None:
        dist.all_reduce(counts, group=group)
    loads, dropped = counts[:, :-1], counts[:, -1]
    readings = {}
    for name, load, lost, layer in zip(layers, loads, dropped, layers.values()):
        readings[name] = load
        if layer.capacity_factor is not None:
            readings[f"{name}/dropped"] = lost
        load = load.float()
        layer.expert_bias += layer.args.bias_update_rate * torch.sign(load.mean() - load)
        layer.tokens_per_expert.zero_()
        layer.dropped_slots.zero_()
    return readings


def force_load_balance(model: nn.Module) -> None:
    """Every MoE router of ``model`` routes round-robin (``TopKRouter.force_load_balance``)."""
    for layer in moe_layers(model).values():
        layer.router.force_load_balance = True


def set_expert_capacity(model: nn.Module, factor: float | None, overflow: str = "drop") -> None:
    """Every MoE layer of ``model`` dispatches with capacity ``factor`` (``capacity.py``: each
    expert takes at most ceil(factor * slots / E) slots, the rest dropped or rerouted as
    ``overflow`` says) or, ``factor`` None, dropless."""
    if overflow not in CAPACITY_OVERFLOW:
        raise ValueError(f"expert capacity overflow {overflow!r} is not one of {CAPACITY_OVERFLOW}")
    if factor is not None and factor <= 0:
        raise ValueError(f"expert capacity factor {factor} must be > 0")
    for layer in moe_layers(model).values():
        layer.capacity_factor, layer.capacity_overflow = factor, overflow


def set_aux_loss_scale(model: nn.Module, scale: float, tp: int = 1) -> None:
    """The factor the trainer multiplies the training loss by before backward (1 / micro-batches
    per step): the sequence-wise balance loss's gradient gets the same (see ``aux_loss``),
    divided by the tensor-parallel degree, since every tp rank routes all tokens and computes
    the loss whole, while each rank's backward gives its share of a gradient."""
    for layer in moe_layers(model).values():
        layer.aux_loss_scale = scale / tp


# ModelSpec.step_hooks of the MoE families: the balance loss's scale, the router-bias update.
MOE_STEP_HOOKS = StepHooks(set_loss_scale=set_aux_loss_scale, after_optimizer_step=update_expert_bias,
                           force_load_balance=force_load_balance, set_expert_capacity=set_expert_capacity)
