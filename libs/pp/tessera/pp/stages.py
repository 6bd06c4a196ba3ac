"""Which modules each pipeline stage holds and which stages each pp rank runs, decided from
numbers alone, so a job planner can check a layout before any process or tensor exists.

Conventions on the model (no import of any model library): the blocks live in one
``nn.ModuleDict`` child (default name ``layers``, keyed "0".."n-1"); the other direct children
registered before it are the stage-0 inputs (e.g. ``tok_embeddings``), those after it the
last stage's outputs (e.g. ``norm``, ``output``).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _Action


def _torch_schedules():
    """torch's schedules module, loaded at first use: it loads dynamo with it (about a second at
    each process start, measured), which a job without pipeline parallelism never needs."""
    from torch.distributed.pipelining import schedules

    return schedules


SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

# Schedules that split the weight gradient (dW) from the input gradient (dI) and run dW later:
# measured on torch 2.13 (CPU gloo, PP 2 x FSDP 2) they train with wrong gradients, silently,
# when FSDP reshards parameters after forward. Callers must keep parameters unsharded then.
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def canonical_schedule(name: str) -> str:
    """One of SCHEDULES as spelled there (names are case-insensitive, as in torch); ValueError
    for any other name."""
    match = {s.lower(): s for s in SCHEDULES}.get(name.lower())
    if match is None:
        raise ValueError(f"pipeline schedule {name!r} is not one of {list(SCHEDULES)}")
    return match


def schedule_class(name: str) -> type:
    return _torch_schedules().get_schedule_class(canonical_schedule(name))


def is_single_stage(name: str) -> bool:
    """One stage per rank (GPipe, 1F1B) rather than several looped or V-placed ones."""
    return issubclass(schedule_class(name), _torch_schedules().PipelineScheduleSingle)


def is_v_shaped(name: str) -> bool:
    """Two stages per rank placed in V order: rank r holds stages r and 2*pp-1-r."""
    torch_schedules = _torch_schedules()
    return schedule_class(name) in (torch_schedules.ScheduleZBVZeroBubble, torch_schedules.ScheduleDualPipeV)


def check_backend(name: str, device_type: str) -> None:
    """ValueError where torch cannot run the named schedule on the device's backend: torch 2.11's
    V-shaped schedules send between a rank's own two stages, which gloo (CPU) cannot (measured:
    'Pair is not connected' at the first step; NCCL can, and torch 2.13 passes them locally)."""
    release = tuple(int(part) for part in torch.__version__.split(".")[:2])
    if is_v_shaped(name) and device_type == "cpu" and release < (2, 12):
        raise ValueError(f"{canonical_schedule(name)} on CPU needs torch 2.12 or newer: torch {torch.__version__} sends "
                         "between a rank's own two stages, which gloo cannot")


def splits_backward(name: str, schedule_csv: str | None = None) -> bool:
    """Whether the named schedule, or the actions of `schedule_csv` that replace its order (torch's
    notation, a row per rank), run a micro-batch's input gradient (I) apart from its weight
    gradient (W): activation checkpointing must then keep what the second pass reads. A malformed
    action is a ValueError naming it."""
    if not schedule_csv:
        return canonical_schedule(name) in SPLIT_BACKWARD_SCHEDULES
    actions = [a for row in _read_csv(schedule_csv) for a in row if a is not None]
    torch_schedules = _torch_schedules()
    return any(a.computation_type in (torch_schedules.BACKWARD_INPUT, torch_schedules.BACKWARD_WEIGHT) for a in actions)


def _read_csv(path: str) -> list[list[_Action | None]]:
    """The file's rows of actions, as torch's runtime reads them; ValueError naming a bad cell."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    action = _torch_schedules()._Action
    try:
        return [[action.from_str(cell) for cell in row] for row in rows]
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


def check_schedule_csv(path: str, schedule: str, pp: int, n_stages: int, n_microbatches: int) -> None:
    """ValueError naming `path` and its first fault, for what torch would otherwise find in every
    worker: a row per pp rank, compute actions (F, B, I, W) only, stages and micro-batches in
    range and on the ranks `schedule` places them, every micro-batch forward and backward once,
    and an order whose sends and receives can be scheduled. Needs no process group."""
    rows = _read_csv(path)
    if not any(a is not None for row in rows for a in row):
        raise ValueError(f"{path} holds no actions")
    if len(rows) != pp:
        raise ValueError(f"{path} has {len(rows)} row{'s' * (len(rows) != 1)}; pipeline_parallel_degree {pp} needs one "
                         "per pp rank")
    owner = {stage: rank for rank in range(pp) for stage in stage_ids(rank, pp, n_stages, schedule)}
    for rank, row in enumerate(rows):
        for action in filter(None, row):
            for one in action.sub_actions or (action,):
                where = f"{path} row {rank + 1} (pp rank {rank}): {action}"
                if not one.is_compute_op:
                    raise ValueError(f"{where} is not a compute action (F, B, I or W); the sends and receives are added for you")
                if not 0 <= one.stage_index < n_stages:
                    raise ValueError(f"{where} names stage {one.stage_index}; the pipeline has stages 0..{n_stages - 1}")
                if one.microbatch_index is None or not 0 <= one.microbatch_index < n_microbatches:
                    raise ValueError(f"{where} names micro-batch {one.microbatch_index}; the step has 0..{n_microbatches - 1}")
                if owner[one.stage_index] != rank:
                    raise ValueError(f"{where}: {schedule} places stage {one.stage_index} on pp rank {owner[one.stage_index]}")
    actions = {rank: [a for a in row if a is not None] for rank, row in enumerate(rows)}
    torch_schedules = _torch_schedules()
    try:  # torch's own checks, then its lowering to sends and receives, dry-run for deadlocks
        torch_schedules._validate_schedule(actions, pp, n_stages, n_microbatches)
        lowered = torch_schedules._add_send_recv(actions, owner.__getitem__, n_stages)
        torch_schedules._simulate_comms_compute(lowered, owner.__getitem__, n_stages)
    except (AssertionError, ValueError, RuntimeError) as e:
        first = " ".join(str(e).strip().split("\n\n")[0].split())  # torch appends the whole schedule
        raise ValueError(f"{path}: torch cannot run this order: {first}") from None


def stage_count(
    pp: int, schedule: str, n_layers: int, *, layers_per_stage: int | None = None,
    first_stage_less_layers: int = 1, last_stage_less_layers: int = 1,
) -> int:
    """How many stages the model is cut into, as torchtitan 0.2 counts them: with
    ``layers_per_stage``, ceil((layers + first + last weights) / layers_per_stage), which must
    divide by pp and give one stage per rank to single-stage schedules, two or more to looped
    ones, exactly two to V-shaped ones; without it, pp (single-stage) or 2*pp stages."""
    single = is_single_stage(schedule)
    if layers_per_stage is None:
        return pp if single else 2 * pp
    if layers_per_stage < 1:
        raise ValueError(f"pipeline_parallel_layers_per_stage {layers_per_stage} must be >= 1")
    stages = math.ceil((n_layers + first_stage_less_layers + last_stage_less_layers) / layers_per_stage)
    check_stage_count(stages, pp, schedule,
                      f"pipeline_parallel_layers_per_stage {layers_per_stage} cuts {n_layers} layers into {stages} stages")
    return stages


def check_stage_count(stages: int, pp: int, schedule: str, what: str) -> None:
    """The stages must divide over the pp ranks: one per rank for single-stage schedules, two or
    more for looped ones, exactly two for V-shaped ones. `what` says where the count came from."""
    if stages % pp:
        raise ValueError(f"{what}, which does not divide by pipeline_parallel_degree {pp}")
    per_rank = stages // pp
    if is_single_stage(schedule) and per_rank != 1:
        raise ValueError(f"{what}: schedule {schedule} runs one stage per rank, this is {per_rank} per rank")
    if not is_single_stage(schedule) and per_rank < 2:
        raise ValueError(f"{what}: schedule {schedule} runs several stages per rank, this is {per_rank}")
    if is_v_shaped(schedule) and per_rank != 2:
        raise ValueError(f"{what}: V-shaped schedule {schedule} runs exactly 2 stages per rank, this is {per_rank}")


def check_microbatches(schedule: str, pp: int, n_stages: int, n_microbatches: int) -> None:
    """What torch 2.13's schedule constructors ask of the micro-batch count, checked before any
    process starts (they raise inside every worker): 1F1B and DualPipeV need at least one per
    stage; the interleaved ones (Interleaved1F1B, InterleavedZeroBubble) split the micro-batches
    into ``max(1, n_microbatches // pp)`` rounds, evenly. ValueError naming the rule."""
    if schedule in ("1F1B", "DualPipeV") and n_microbatches < n_stages:
        raise ValueError(f"schedule {schedule} needs at least as many micro-batches as stages: "
                         f"{n_microbatches} < {n_stages} stages")
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ValueError(f"schedule {schedule} runs max(1, micro-batches // pipeline_parallel_degree {pp}) = "
                             f"{rounds} rounds: {n_microbatches} micro-batches do not split evenly into them")


def even_split(
    n_stages: int, n_layers: int, *, first_stage_less_layers: int = 1, last_stage_less_layers: int = 1,
    inputs: Sequence[str] = ("tok_embeddings",), outputs: Sequence[str] = ("norm", "output"), layers: str = "layers",
) -> list[list[str]]:
    """Module names per stage: the inputs count as ``first_stage_less_layers`` blocks on stage 0
    and the outputs as ``last_stage_less_layers`` blocks on the last stage, and the n_layers +
    both weights units are spread as evenly as integers allow (earlier stages take the extra
    ones), so the stages' compute is balanced (torchtitan 0.2's meaning of the two keys)."""
    if n_stages == 1:
        return [[*inputs, *(f"{layers}.{i}" for i in range(n_layers)), *outputs]]
    units = n_layers + first_stage_less_layers + last_stage_less_layers
    base, extra = divmod(units, n_stages)
    if base == 0:
        raise ValueError(f"{n_stages} pipeline stages outnumber the model's {n_layers} layers "
                         f"(+{first_stage_less_layers} first, +{last_stage_less_layers} last stage weights)")
    if max(first_stage_less_layers, last_stage_less_layers) > base:
        raise ValueError(f"pipeline_parallel_first/last_stage_less_layers ({first_stage_less_layers}, "
                         f"{last_stage_less_layers}) exceed the {base} layers a stage holds")
    parts, next_layer = [], 0
    for stage in range(n_stages):
        size = base + (stage < extra)
        size -= first_stage_less_layers if stage == 0 else 0
        size -= last_stage_less_layers if stage == n_stages - 1 else 0
        count = min(size, n_layers - next_layer)
        blocks = [f"{layers}.{i}" for i in range(next_layer, next_layer + count)]
        next_layer += count
        parts.append([*(inputs if stage == 0 else ()), *blocks, *(outputs if stage == n_stages - 1 else ())])
    if any(not part for part in parts):
        raise ValueError(f"{n_stages} pipeline stages leave a stage without modules for {n_layers} layers")
    return parts


def check_split(
    parts: Sequence[Sequence[str]], n_layers: int, *, inputs: Sequence[str] = ("tok_embeddings",),
    outputs: Sequence[str] = ("norm", "output"), layers: str = "layers",
) -> None:
    """An explicit split (module_fqns_per_model_part) must name every module exactly once, keep
    the blocks in order, put the inputs on the first stage and the outputs on the last."""
    known = [*inputs, *(f"{layers}.{i}" for i in range(n_layers)), *outputs]
    named = [name for part in parts for name in part]
    unknown = sorted(set(named) - set(known))
    if unknown:
        raise ValueError(f"module_fqns_per_model_part names {unknown}, which the model does not have")
    missing = [name for name in known if name not in named]
    if missing:
        raise ValueError(f"module_fqns_per_model_part leaves out {missing}")
    twice = sorted({name for name in named if named.count(name) > 1})
    if twice:
        raise ValueError(f"module_fqns_per_model_part names {twice} more than once")
    if any(not part for part in parts):
        raise ValueError("module_fqns_per_model_part has an empty stage")
    if named != known:
        raise ValueError("module_fqns_per_model_part must list the modules in model order "
                         f"({', '.join(inputs)} first, the {layers} in order, then {', '.join(outputs)})")


def stage_ids(pp_rank: int, pp: int, n_stages: int, schedule: str) -> tuple[int, ...]:
    """The stages a pp rank runs: looped (rank r: r, r+pp, ...) or, for V-shaped schedules,
    r and n_stages-1-r, so the last stage comes back to rank 0."""
    if n_stages % pp:
        raise ValueError(f"{n_stages} pipeline stages do not divide over pipeline_parallel_degree {pp}")
    if is_v_shaped(schedule):
        return (pp_rank, n_stages - 1 - pp_rank)
    return tuple(range(pp_rank, n_stages, pp))
