"""One training step, as the parts the loop calls:

- the loss, a component: (logits, labels) -> mean loss;
- `forward_backward(inputs, labels) -> loss`: one micro-batch's forward and backward: plain (the
  whole model on this rank) or pipelined (tessera.pp's schedule, loss on the last stage); a
  context-parallel variant (sequence shards) is another function of the same shape;
- `make_train_step`: micro-batches with gradient sync on the last, clipping across every
  parallel dimension (pipeline stages included), the optimizers' step when the norm is finite
  (decided on the device for fused optimizers), then the post-optimizer hooks (float8 scale
  precompute, MoE router-bias updates) and the lr schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tessera import cp, fsdp, pp, tp
from tessera.trainer.chunked_loss import ChunkedCrossEntropy
from tessera.trainer.faults import TrainingError
from tessera.trainer.plan import JobPlan
from tessera.trainer.replica_sync import ALONE, ReplicaSync

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (inputs, labels, **model_kwargs) of one micro-batch -> its detached loss, already divided by
# the micro-batch count; model_kwargs: what the model's forward takes besides the tokens, per
# token ([batch, seq]): `positions` when a rank holds part of each sequence (context parallel),
# `document_ids` for block-causal masking
ForwardBackward = Callable[..., torch.Tensor]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss in fp32 (logits come in the parameter/compute dtype)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build_loss(plan: JobPlan) -> LossFn:
    """cross_entropy, compiled where the plan says (never under loss parallel, see LossPlan); or,
    with training.loss_chunk_size, the chunked loss of the final hidden states, which the model
    built for this plan returns (bound to its output projection by build_parallel_model)."""
    backend = plan.compile.backend if plan.loss.compiled else None
    if plan.loss.chunk_size:
        return ChunkedCrossEntropy(plan.loss.chunk_size, gather_logits=not plan.loss.parallel, compile_backend=backend)
    return torch.compile(cross_entropy, backend=backend) if backend else cross_entropy


def plain_value(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor: under loss parallel the loss is a replicated DTensor."""
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def compute_context(plan: JobPlan) -> Callable[[], contextlib.AbstractContextManager]:
    """Autocast to the low-precision dtype where FSDP's mixed precision does not cast already."""
    if not plan.precision.autocast:
        return contextlib.nullcontext
    return lambda: torch.autocast(plan.device, dtype=plan.precision.param)


def micro_batch_loss(loss_fn: LossFn, plan: JobPlan) -> LossFn:
    """The loss a micro-batch's backward runs on, the one place the loss is normalised: its mean
    over the micro-batch's tokens (``loss_fn``) times the plan's scale (1 / micro-batches per step),
    so that a step's gradient is the global batch's mean loss's. Plain and pipelined steps both
    use it; a family's own losses get the same scale (``FamilyHooks``)."""
    scale = plan.loss.scale
    return lambda out, labels: loss_fn(out, labels) * scale


def _training_labels(plan: JobPlan, labels: torch.Tensor) -> dict:
    """The model's own keyword for the labels: a model with multi-token prediction trains its
    modules on them inside its forward (ModelSpec.mtp_layers); validation passes none."""
    return {"labels": labels} if plan.loss.mtp_scale is not None else {}


def plain_forward_backward(model: nn.Module, loss_fn: LossFn, plan: JobPlan) -> ForwardBackward:
    """The whole model on every rank of a data-parallel (and tensor-parallel) group."""
    autocast, step_loss = compute_context(plan), micro_batch_loss(loss_fn, plan)

    def forward_backward(inputs: torch.Tensor, labels: torch.Tensor, **model_kwargs) -> torch.Tensor:
        # loss parallel's cross-entropy backward only works inside its context, too
        with tp.loss_parallel_context(plan.loss.parallel):
            with autocast():
                loss = step_loss(model(inputs, **_training_labels(plan, labels), **model_kwargs), labels)
            loss.backward()
        return plain_value(loss)

    return forward_backward


def _stage_kwargs(inputs: torch.Tensor, plan: JobPlan, model_kwargs: dict) -> dict:
    """Under sequence parallel a later stage receives a sequence shard and cannot count the
    positions itself; the model's `positions` convention carries them to every stage. Every
    keyword tensor goes as one row per sequence: the schedule splits them along dim 0 into
    micro-batches."""
    if plan.dims.tp_enabled and "positions" not in model_kwargs:
        model_kwargs = {**model_kwargs, "positions": torch.arange(inputs.shape[1], device=inputs.device)}
    return {name: value.expand(inputs.shape) for name, value in model_kwargs.items()}


def context_parallel(run: Callable[..., torch.Tensor], plan: JobPlan, cp_mesh) -> Callable[..., torch.Tensor]:
    """`run` (a forward_backward or an evaluation loss) on this cp rank's part of every sequence:
    inputs, labels and per-token keywords cut to its tokens (load-balanced), which go with their
    positions."""
    positions = cp.local_positions(plan.batch.seq_len, plan.dims.cp, cp_mesh.get_local_rank(),
                                   plan.attention.cp_load_balance, plan.device)

    def on_shard(inputs: torch.Tensor, labels: torch.Tensor, **model_kwargs) -> torch.Tensor:
        shard = {name: cp.shard_sequence(value, positions) for name, value in model_kwargs.items()}
        return run(cp.shard_sequence(inputs, positions), cp.shard_sequence(labels, positions), positions=positions, **shard)

    return on_shard


def document_masking(run: Callable[..., torch.Tensor], bos_id: int) -> Callable[..., torch.Tensor]:
    """`run` with block-causal attention: every token's document, counted from the BOS tokens
    that open documents in a packed window (before any sequence sharding), goes to the model."""

    def with_documents(inputs: torch.Tensor, labels: torch.Tensor, **model_kwargs) -> torch.Tensor:
        return run(inputs, labels, document_ids=torch.cumsum(inputs == bos_id, dim=1), **model_kwargs)

    return with_documents


def _from_last_stage(loss: torch.Tensor | None, device: str, pp_mesh) -> torch.Tensor:
    """The loss exists on the last stage's rank only; a sum over the pp ranks gives it to all."""
    loss = torch.zeros((), device=device) if loss is None else plain_value(loss).float()
    dist.all_reduce(loss, group=pp_mesh.get_group())
    return loss


def pipelined_forward_backward(pipeline: pp.Pipeline, plan: JobPlan, pp_mesh) -> ForwardBackward:
    """The micro-batch through this rank's pipeline stages; the loss comes summed over the
    pipeline's own micro-batches, each already divided by their count and the accumulation."""
    autocast = compute_context(plan)

    def forward_backward(inputs: torch.Tensor, labels: torch.Tensor, **model_kwargs) -> torch.Tensor:
        kwargs = _stage_kwargs(inputs, plan, {**_training_labels(plan, labels), **model_kwargs})
        with tp.loss_parallel_context(plan.loss.parallel), autocast():
            loss = pipeline.run(inputs, labels, **kwargs)
        return _from_last_stage(loss, plan.device, pp_mesh)

    return forward_backward


def evaluation_loss(parts: Sequence[nn.Module], pipeline: pp.Pipeline | None, loss_fn: LossFn, plan: JobPlan,
                    pp_mesh=None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(inputs, labels) -> the batch's mean loss, forward only, on every rank."""
    autocast = compute_context(plan)
    if pipeline is None:
        def plain(inputs: torch.Tensor, labels: torch.Tensor, **model_kwargs) -> torch.Tensor:
            with autocast(), tp.loss_parallel_context(plan.loss.parallel):
                return plain_value(loss_fn(parts[0](inputs, **model_kwargs), labels))

        return plain

    def pipelined(inputs: torch.Tensor, labels: torch.Tensor, **model_kwargs) -> torch.Tensor:
        with autocast(), tp.loss_parallel_context(plan.loss.parallel):
            loss = pipeline.evaluate(inputs, labels, loss_fn, **_stage_kwargs(inputs, plan, model_kwargs))
        return _from_last_stage(loss, plan.device, pp_mesh)

    return pipelined


def step_functions(parts: Sequence[nn.Module], pipeline: pp.Pipeline | None, loss_fn: LossFn, plan: JobPlan,
                   meshes, bos_id: int) -> tuple[ForwardBackward, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The planned (forward_backward, evaluation loss): plain or pipelined, each on this rank's
    sequence shard under context parallel, with block-causal masks when model.attn_mask_type
    asks (document ids counted on whole sequences, then sharded)."""
    if pipeline is None:
        forward_backward = plain_forward_backward(parts[0], loss_fn, plan)
    else:
        forward_backward = pipelined_forward_backward(pipeline, plan, meshes.pp)
    evaluate = evaluation_loss(parts, pipeline, loss_fn, plan, meshes.pp)
    if plan.dims.cp_enabled:
        forward_backward, evaluate = (context_parallel(f, plan, meshes.cp) for f in (forward_backward, evaluate))
    if plan.attention.documents:
        forward_backward, evaluate = (document_masking(f, bos_id) for f in (forward_backward, evaluate))
    return forward_backward, evaluate


def gradient_sync(parts: Sequence[nn.Module], plan: JobPlan) -> Callable[[bool], None]:
    """Turns FSDP's reduce-scatter on for the last micro-batch only: one reduction per step, while
    FSDP holds each gradient whole in the reduce dtype until then. A no-op when every micro-batch
    reduces (parallelism.fsdp_reduce_every_microbatch: sharded gradients only, as torchtitan), without
    FSDP, and under a pipeline, whose schedule reduces its stages' gradients itself, once per pass."""
    fsdp_parts = [part for part in parts if isinstance(part, FSDPModule)]
    if plan.pipeline is not None or plan.fsdp.reduce_every_microbatch or not fsdp_parts:
        return lambda enabled: None

    def sync(enabled: bool) -> None:
        for part in fsdp_parts:
            part.set_requires_gradient_sync(enabled)

    return sync


@dataclasses.dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # this rank's mean loss over the step's micro-batches (on the device)
    grad_norm: torch.Tensor  # global norm before clipping, every parallel dimension included
    lr: float  # the lr the step used
    skipped: torch.Tensor  # 1.0 (on the device) when the norm was not finite and the optimizer step left out, else 0.0


class SkippedSteps:
    """Optimizer steps skipped for a non-finite gradient norm, counted on the device: `add` reads
    nothing back, `check` (at log steps) reads the count once."""

    def __init__(self, limit: int, device: str) -> None:
        self.limit, self.reported = limit, 0
        self.count = torch.zeros((), device=device)
        self.latest_norm = torch.zeros((), device=device)  # the norm of the latest skipped step

    def add(self, result: StepResult) -> None:
        self.count += result.skipped
        self.latest_norm = torch.where(result.skipped.bool(), result.grad_norm, self.latest_norm)

    def check(self, step: int) -> str | None:
        """TrainingError once more than `limit` steps were skipped (training.max_skipped_steps);
        else a line about the steps skipped since the last check, or None."""
        count = int(self.count.item())
        if count > self.limit:
            raise TrainingError(f"step {step}: gradient norm {self.latest_norm.item()}; {count} optimizer steps skipped, "
                                f"more than training.max_skipped_steps = {self.limit}")
        new, self.reported = count - self.reported, count
        if not new:
            return None
        return (f"step {step}: {new} optimizer step(s) skipped since the last log for a non-finite gradient norm "
                f"(latest {self.latest_norm.item()}; {count} in this run)")


def make_train_step(
    parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], scheduler, forward_backward: ForwardBackward,
    plan: JobPlan, post_optimizer_hooks: Sequence[Callable[[nn.Module], None]] = (), pp_mesh=None,
    shared_copies: Sequence[torch.Tensor] = (), replicas: ReplicaSync = ALONE,
) -> Callable[[Iterator[tuple[torch.Tensor, torch.Tensor]]], StepResult]:
    """parts: the model or this rank's pipeline stages, one optimizer each; pp_mesh (pipeline
    parallel) joins the stages' gradient norms; shared_copies: the last stage's copies of modules
    it shares with the first (tessera.pp's Pipeline.shared_copies), whose weights the norm counts
    once, at the first stage, and which are clipped alike; replicas: fault tolerance's replica
    groups (tessera.trainer.replica_sync), which average the gradients and the loss before
    clipping and decide whether the step counts: a step that does not leaves the optimizers and
    the lr schedule as they were.

    A non-finite gradient norm skips the optimizer step: parameters, moments and step counts stay
    as they were (one bad batch must not poison the weights). Fused optimizers decide that on
    the device, through the `found_inf` tensor they take (GradScaler's mechanism), so the step
    reads nothing back and the host queues the next one at once; the post-optimizer hooks then
    run on every step (on a skipped one they see unchanged weights). Other implementations read
    the norm's finiteness each step and leave the step and the hooks out on the host."""
    sync = gradient_sync(parts, plan)
    accumulation, max_norm, device = plan.batch.accumulation, plan.optimizer.max_norm, plan.device
    copies = {id(p) for p in shared_copies}
    params = [p for part in parts for p in part.parameters() if id(p) not in copies]
    on_device = all(optimizer.defaults.get("fused") for optimizer in optimizers)

    def train_step(batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        loss = torch.zeros((), device=device)
        for micro in range(accumulation):
            sync(micro == accumulation - 1)  # reduce gradients after the last micro-batch (see gradient_sync)
            inputs, labels = next(batches)
            loss += forward_backward(inputs.to(device), labels.to(device))
        loss = replicas.average([*params, *shared_copies], loss)
        grad_norm = fsdp.clip_grad_norm_(params, max_norm, pp_mesh=pp_mesh, error_if_nonfinite=False)
        if shared_copies:  # the same coefficient as their first-stage twins, which hold the same gradients
            torch.nn.utils.clip_grads_with_norm_(shared_copies, max_norm, grad_norm)
        lr = scheduler.get_last_lr()[0]
        skipped = (~torch.isfinite(grad_norm)).float()
        if on_device:
            for optimizer in optimizers:
                optimizer.found_inf = skipped
        counts = replicas.commit()
        if counts and (on_device or not skipped.item()):
            for optimizer in optimizers:
                optimizer.step()
            for hook in post_optimizer_hooks:
                for part in parts:
                    hook(part)
        if counts:
            scheduler.step()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, grad_norm, lr, skipped)

    return train_step
