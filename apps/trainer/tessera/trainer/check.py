"""What `--check` prints: the job plan in a few lines, with parameter counts from a model built on
the meta device (no storage, so a 405B plan costs about a second and no memory)."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tessera import tp
from tessera.trainer.parallelize import convert
from tessera.trainer.plan import JobPlan


def _tp_sharded(model: torch.nn.Module, plan: JobPlan) -> set[int]:
    """ids of the parameters tensor parallel splits: those of modules with a column- or row-wise style."""
    layouts = tp.Layouts(sequence_parallel=True, loss_parallel=plan.loss_parallel)
    sharded = set()
    for path, role in tp.resolve_plan(model, plan.spec.tp_plan, plan.tp_styles.keys()).items():
        if isinstance(plan.tp_styles[role](layouts), (ColwiseParallel, RowwiseParallel)):
            sharded.update(id(p) for p in model.get_submodule(path).parameters(recurse=False))
    return sharded


def parameter_counts(plan: JobPlan) -> tuple[int, int]:
    """(parameters of the model, parameters one rank holds) under the plan's TP and FSDP sharding:
    exact where the degrees divide the sharded dims (fully_shard pads dim 0 otherwise, a few
    rows more)."""
    with torch.device("meta"):
        model = plan.spec.build(plan.model_args)
    convert(model, plan)
    dims = plan.dims
    tp_sharded = _tp_sharded(model, plan) if dims.tp_enabled else set()
    fsdp_degree = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    total = per_rank = 0
    for param in model.parameters():
        total += param.numel()
        per_rank += math.ceil(param.numel() // (dims.tp if id(param) in tp_sharded else 1) / fsdp_degree)
    return total, per_rank


def describe(plan: JobPlan) -> str:
    config, dims, batch = plan.config, plan.dims, plan.batch
    total, per_rank = parameter_counts(plan)
    degrees = " x ".join(f"{name} {degree}" for name, degree in dims.degrees().items() if degree > 1) or "single process"
    ac = config.activation_checkpoint
    lines = [
        f"job plan: {plan.spec.name}/{config.model.flavor} on {plan.world_size} {plan.device} rank(s); nothing was built",
        f"  model       {total:,} parameters; {per_rank:,} per rank ({degrees})",
        f"  meshes      {plan.meshes.describe()}",
        f"  batch       {batch.local} sequences x {batch.dp} data-parallel x {batch.accumulation} micro-batches = "
        f"{batch.global_size} x {batch.seq_len} tokens per step; {batch.tokens_per_device:,.0f} tokens per device",
        f"  compute     params {str(plan.param_dtype).removeprefix('torch.')}, reductions "
        f"{str(plan.reduce_dtype).removeprefix('torch.')} ({'autocast' if plan.autocast else 'FSDP mixed precision' if dims.fsdp_enabled else 'no casts'}); "
        f"loss parallel {'on' if plan.loss_parallel else 'off'}; activation checkpointing {ac.mode}; "
        f"compile {'on' if config.compile.enable else 'off'}; converters {[c.name for c in plan.converters] or 'none'}",
        f"  flops       {plan.flops_per_token:.3e} per token; {plan.flops_per_token * batch.tokens_per_device:.3e} per device per step",
    ]
    lines += [f"  note        {note}" for note in plan.notes]
    return "\n".join(lines)
