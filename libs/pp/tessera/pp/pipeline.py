"""Pipeline stages over torch.distributed.pipelining and the schedule that runs them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineScheduleRuntime

from tessera.pp.shared import SharedCopies, shared_modules
from tessera.pp.split import keep_only, model_parts_names
from tessera.pp.stages import schedule_class, stage_ids


@dataclasses.dataclass
class Pipeline:
    """What one pp rank runs: its model parts (one per local stage, in stage order of the
    schedule), the schedule, and whether it holds the first / last stage (which take the
    inputs / compute the loss)."""

    schedule: object
    parts: list[nn.Module]
    stages: list[PipelineStage]
    has_first: bool
    has_last: bool
    owners: list[int]  # the pp rank running each stage
    group: dist.ProcessGroup
    shared: SharedCopies  # this rank's copies of the modules shared with the last stage

    def run(self, inputs: torch.Tensor, labels: torch.Tensor, /, **kwargs) -> torch.Tensor | None:
        """One pass of the whole batch through the pipeline, forward and backward; returns the
        sum of the micro-batch losses on the rank holding the last stage, else None.

        Every pp rank calls it; inputs go in on the first stage, labels on the last. kwargs go
        to every stage's forward, split along dim 0 like the inputs (a model's own ``labels=``
        too: the arguments before them are positional only). The copies of modules
        shared with the last stage leave with their gradients summed (tessera.pp.shared).
        """
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        target = labels if self.has_last else None
        args = (inputs.contiguous(),) if self.has_first else ()  # torch 2.11 checks each micro-batch's strides
        kwargs = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        kept = self.shared.set_aside_grads()
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        self.shared.sum_grads(kept)
        return torch.stack(losses).sum() if self.has_last else None

    def shared_copies(self) -> list[nn.Parameter]:
        """The parameters of this rank's last-stage copies of shared modules: a gradient norm
        counts them out (their first-stage twins count), and clips them alike."""
        return self.shared.last_copies()

    def copy_shared_weights(self) -> None:
        """The last stage's copies take the first stage's weights; call it where the stages were
        initialised apart (each its own seed), before training. Every pp rank calls it."""
        self.shared.copy_weights()

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], /, **kwargs) -> torch.Tensor | None:
        """loss_fn(output, labels) of the whole batch, forward only, on the last stage's rank
        (else None). Runs the stages in order, without micro-batches or a schedule: the
        schedules' forward-only mode fails for stages that hand activations to one another on
        the same rank (torch 2.13). Every pp rank calls it."""
        me, local = dist.get_rank(self.group), {stage.stage_index: part for stage, part in zip(self.stages, self.parts)}
        h, loss = inputs, None
        for stage_id, owner in enumerate(self.owners):
            before = self.owners[stage_id - 1] if stage_id else owner
            if owner == me and before != me:
                h = _receive(self.group, before, inputs.device)
            elif owner != me and before == me:
                _send(h, self.group, owner)
            if owner == me:
                h = local[stage_id](h, **kwargs)
        if self.owners[-1] == me:
            loss = loss_fn(h, labels)
        return loss


class _BufferKeepingStage(PipelineStage):
    """A PipelineStage whose shape inference leaves the module's buffers as it found them.

    Before its first step, torch infers what the stages exchange by running each stage's forward
    (2.13: and backward) once more: on the first micro-batch at the first stage, on uninitialized
    memory of the right shape at the others. Buffers a forward updates (an MoE layer's tokens per
    expert, running statistics) kept that extra run, so the later stages counted garbage: the
    router bias then moved differently from run to run. Values are put back in place once the
    inference is done (2.13: after its backward, which uses the forward's saved tensors)."""

    _kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _prepare_forward_infra(self, num_microbatches, args, kwargs=None, *more, **more_kwargs):
        """torch 2.13 passes has_backward (then runs the inference's backward too); 2.11 runs the
        forward alone and passes nothing more."""
        self._kept = [(buffer, buffer.detach().clone()) for buffer in self.submod.buffers()]
        result = super()._prepare_forward_infra(num_microbatches, args, kwargs, *more, **more_kwargs)
        if not (more[0] if more else more_kwargs.get("has_backward", False)):
            self._restore_buffers()
        return result

    def _prepare_backward_infra(self, *args, **kwargs):
        result = super()._prepare_backward_infra(*args, **kwargs)
        self._restore_buffers()
        return result

    @torch.no_grad()
    def _restore_buffers(self) -> None:
        for buffer, value in self._kept or ():
            buffer.copy_(value)
        self._kept = None


def _send(tensor: torch.Tensor, group: dist.ProcessGroup, to: int) -> None:
    """A tensor of a shape and dtype the receiver does not know: a header first."""
    header = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape], device=tensor.device)
    dist.send(torch.nn.functional.pad(header, (0, 8 - header.numel())), group=group, group_dst=to)
    dist.send(tensor.contiguous(), group=group, group_dst=to)


def _receive(group: dist.ProcessGroup, source: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(8, dtype=torch.long, device=device)
    dist.recv(header, group=group, group_src=source)
    dtype, ndim, *shape = header.tolist()
    tensor = torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)
    dist.recv(tensor, group=group, group_src=source)
    return tensor


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def build_pipeline(
    model: nn.Module, pp_mesh: DeviceMesh, device: torch.device | str, *, parts: Sequence[Sequence[str]],
    schedule: str, n_microbatches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    parallelize: Callable[[nn.Module], nn.Module] = lambda part: part, schedule_csv: str | None = None,
    layers: str = "layers",
) -> Pipeline:
    """Cuts `model` into len(parts) stages (parts[i]: the module names of stage i), keeps the
    ones this pp rank runs, applies `parallelize` (TP, AC, FSDP, ...) to each, and builds the
    named schedule over them, or runs the actions a CSV file lays out (one row per pp rank, in
    torch's action notation, e.g. "0F0,0F1,0B0"; stages placed as the named schedule places them).
    The last stage also keeps a copy of the inputs the model names in ``shared_with_last_stage``
    (tessera.pp.shared).

    loss_fn(output, labels) is the mean loss of one micro-batch; it is divided by
    n_microbatches here, so the micro-batch losses (and gradients) sum to the batch mean, as
    without pipelining. Every pp rank must call this together.
    """
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    cls = schedule_class(schedule)
    local = stage_ids(pp_rank, pp, len(parts), schedule)
    shared = shared_modules(model, model_parts_names(model, layers)[0])
    last = len(parts) - 1
    modules, stages = [], []
    for stage_id in local:
        part = parallelize(keep_only(model, [*parts[stage_id], *(shared if stage_id == last else ())], layers))
        modules.append(part)
        stages.append(_BufferKeepingStage(part, stage_id, len(parts), torch.device(device), group=pp_mesh.get_group()))

    def micro_batch_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, labels) / n_microbatches

    if schedule_csv:  # actions from the file; stages stay where the named schedule places them
        cls = _PipelineScheduleRuntime
    looped = issubclass(cls, PipelineScheduleMulti)
    runner = cls(stages if looped else stages[0], n_microbatches=n_microbatches, loss_fn=micro_batch_loss, scale_grads=False)
    if schedule_csv:
        runner._load_csv(schedule_csv)
    owners = [rank for stage in range(len(parts)) for rank in range(pp) if stage in stage_ids(rank, pp, len(parts), schedule)]
    part_of, ends = dict(zip(local, modules)), (owners[0], owners[last])
    peer = ends[1 - ends.index(pp_rank)] if pp_rank in ends and ends[0] != ends[1] else None  # the other copy's rank
    copies = SharedCopies(shared, part_of.get(0), part_of.get(last), peer, pp_mesh.get_group())
    return Pipeline(runner, modules, stages, any(s.is_first for s in stages), any(s.is_last for s in stages), owners,
                    pp_mesh.get_group(), copies)
