"""One training step, as the parts the loop calls:

- the loss, a component: (logits, labels) -> mean loss;
- `forward_backward(inputs, labels) -> loss`: one micro-batch's forward and backward. The plain
  one is here; a pipelined schedule (loss on the last stage) or a context-parallel variant
  (sequence shards) is another function of the same shape;
- `make_train_step`: micro-batches with gradient sync on the last, clipping across every
  parallel dimension, the optimizer step when the norm is finite, then the post-optimizer hooks
  (float8 scale precompute, MoE router-bias updates) and the lr schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tessera import fsdp, tp
from tessera.trainer.plan import JobPlan

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (inputs, labels) of one micro-batch -> its detached loss, already divided by the micro-batch count
ForwardBackward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss in fp32 (logits come in the parameter/compute dtype)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build_loss(plan: JobPlan) -> LossFn:
    compile_ = plan.config.compile
    return torch.compile(cross_entropy) if compile_.enable and "loss" in compile_.components else cross_entropy


def plain_value(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor: under loss parallel the loss is a replicated DTensor."""
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def compute_context(plan: JobPlan) -> Callable[[], contextlib.AbstractContextManager]:
    """Autocast to the low-precision dtype where FSDP's mixed precision does not cast already."""
    if not plan.autocast:
        return contextlib.nullcontext
    return lambda: torch.autocast(plan.device, dtype=plan.param_dtype)


def plain_forward_backward(model: nn.Module, loss_fn: LossFn, plan: JobPlan) -> ForwardBackward:
    """The whole model on every rank of a data-parallel (and tensor-parallel) group."""
    autocast, scale = compute_context(plan), plan.batch.accumulation

    def forward_backward(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # loss parallel's cross-entropy backward only works inside its context, too
        with tp.loss_parallel_context(plan.loss_parallel):
            with autocast():
                loss = loss_fn(model(inputs), labels) / scale
            loss.backward()
        return plain_value(loss)

    return forward_backward


def gradient_sync(model: nn.Module) -> Callable[[bool], None]:
    """Turns FSDP's reduce-scatter on for the last micro-batch only; a no-op elsewhere."""
    if isinstance(model, FSDPModule):
        return model.set_requires_gradient_sync
    return lambda enabled: None


@dataclasses.dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # this rank's mean loss over the step's micro-batches (on the device)
    grad_norm: torch.Tensor  # global norm before clipping, every parallel dimension included
    lr: float  # the lr the step used
    skipped: bool  # non-finite gradient norm: the optimizer step was left out


def make_train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, forward_backward: ForwardBackward,
    plan: JobPlan, post_optimizer_hooks: Sequence[Callable[[nn.Module], None]] = (),
) -> Callable[[Iterator[tuple[torch.Tensor, torch.Tensor]]], StepResult]:
    sync = gradient_sync(model)
    accumulation, max_norm, device = plan.batch.accumulation, plan.config.training.max_norm, plan.device

    def train_step(batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        loss = torch.zeros((), device=device)
        for micro in range(accumulation):
            sync(micro == accumulation - 1)  # reduce gradients once, after the last micro-batch
            inputs, labels = next(batches)
            loss += forward_backward(inputs.to(device), labels.to(device))
        grad_norm = fsdp.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
        lr = scheduler.get_last_lr()[0]
        skipped = not torch.isfinite(grad_norm)  # one bad batch must not poison the weights
        if not skipped:
            optimizer.step()
            for hook in post_optimizer_hooks:
                hook(model)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, grad_norm, lr, skipped)

    return train_step
