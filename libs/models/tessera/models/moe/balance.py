"""What a training loop calls on a model's MoE layers: the auxiliary-loss-free bias update (a
post-optimizer hook), the aux-loss scale, expert-load readings for metrics, and the layouts an
MoE family refuses."""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tessera.models.module_names import unwrapped_name
from tessera.models.moe.layer import MoE
from tessera.models.spec import RunLayout, StepHooks


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
    every rank applies the same update. Returns the loads used, per layer ([E] long), for metrics.
    """
    layers = moe_layers(model)
    if not layers:
        return {}
    loads = torch.stack([layer.tokens_per_expert for layer in layers.values()])
    if group is not None:
        dist.all_reduce(loads, group=group)
    for load, layer in zip(loads, layers.values()):
        load = load.float()
        layer.expert_bias += layer.args.bias_update_rate * torch.sign(load.mean() - load)
        layer.tokens_per_expert.zero_()
    return dict(zip(layers, loads))


def force_load_balance(model: nn.Module) -> None:
    """Every MoE router of ``model`` routes round-robin (``TopKRouter.force_load_balance``)."""
    for layer in moe_layers(model).values():
        layer.router.force_load_balance = True


def set_aux_loss_scale(model: nn.Module, scale: float, tp: int = 1) -> None:
    """The factor the trainer multiplies the training loss by before backward (1 / micro-batches
    per step): the sequence-wise balance loss's gradient gets the same (see ``aux_loss``),
    divided by the tensor-parallel degree, since every tp rank routes all tokens and computes
    the loss whole, while each rank's backward gives its share of a gradient."""
    for layer in moe_layers(model).values():
        layer.aux_loss_scale = scale / tp


def moe_refusals(n_experts) -> Callable:
    """ModelSpec.refusals of an MoE family whose flavors may be dense (``n_experts(args)`` 0)."""

    def refusals(args, layout: RunLayout) -> tuple[tuple[str, str], ...]:
        if n_experts(args) and layout.tp > 1 and layout.compile:
            # measured (torch 2.13, CPU): the experts' token counts are data-dependent sizes, and
            # the backward of their tensor-parallel shards cannot guard on them inside the compiled block
            return (("compile.enable with tensor_parallel_degree > 1", "its MoE layers fail to compile under TP"),)
        return ()

    return refusals


# ModelSpec.step_hooks of the MoE families: the balance loss's scale, the router-bias update.
MOE_STEP_HOOKS = StepHooks(set_loss_scale=set_aux_loss_scale, after_optimizer_step=update_expert_bias,
                           force_load_balance=force_load_balance)
