"""What `--check` prints: the job plan in a few lines, with parameter counts from a model built on
the meta device (no storage, so a 405B plan costs about a second and no memory)."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tessera import pp, tp
from tessera.trainer.lr_schedule import decay_steps
from tessera.trainer.parallelize import convert
from tessera.trainer.plan import JobPlan


def _tp_sharded(model: torch.nn.Module, plan: JobPlan) -> set[int]:
    """ids of the parameters tensor parallel splits: those of modules with a column- or row-wise
    style, and the Shard-placed ones of LocalShards modules (routed experts, unless expert
    parallel takes them whole; attention sinks)."""
    layouts = tp.Layouts(sequence_parallel=True, loss_parallel=plan.loss.parallel)
    sharded = set()
    for path, role in tp.resolve_plan(model, plan.spec.tp_plan, plan.tensor_parallel.styles.keys(), missing_ok=True).items():
        style, module = plan.tensor_parallel.styles[role](layouts), model.get_submodule(path)
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            sharded.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(style, tp.LocalShards):
            sharded.update(id(module.get_parameter(name)) for name, placement in style.placements_of(module).items()
                           if placement.is_shard())
    return sharded


def parameter_counts(plan: JobPlan) -> tuple[int, int]:
    """(parameters of the model, parameters one rank holds) under the plan's TP, FSDP and
    pipeline split (the busiest pp rank): exact where the degrees divide the sharded dims
    (fully_shard pads dim 0 otherwise, a few rows more)."""
    with torch.device("meta"):
        model = plan.spec.build(plan.model_args)
    convert(model, plan)
    dims = plan.dims
    tp_sharded = _tp_sharded(model, plan) if dims.tp_enabled else set()
    fsdp_degree = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    stage_of = _stage_of(plan)
    total, per_stage = 0, [0] * (len(plan.pipeline.parts) if plan.pipeline else 1)
    for name, param in model.named_parameters():
        total += param.numel()
        per_stage[stage_of(name)] += math.ceil(param.numel() // (dims.tp if id(param) in tp_sharded else 1) / fsdp_degree)
    if plan.pipeline is None:
        return total, per_stage[0]
    schedule, n_stages = plan.pipeline.schedule, len(plan.pipeline.parts)
    return total, max(sum(per_stage[s] for s in pp.stage_ids(r, dims.pp, n_stages, schedule)) for r in range(dims.pp))


def _stage_of(plan: JobPlan):
    """parameter name -> the pipeline stage holding it (0 without pipeline parallelism)."""
    if plan.pipeline is None:
        return lambda name: 0
    owner = {module: stage for stage, part in enumerate(plan.pipeline.parts) for module in part}

    def stage_of(name: str) -> int:
        parts = name.split(".")
        return next(owner[".".join(parts[:n])] for n in range(1, len(parts)) if ".".join(parts[:n]) in owner)

    return stage_of


def describe(plan: JobPlan) -> str:
    config, dims, batch = plan.config, plan.dims, plan.batch
    total, per_rank = parameter_counts(plan)
    degrees = " x ".join(f"{name} {degree}" for name, degree in dims.degrees().items() if degree > 1) or "single process"
    ac, opt = plan.checkpointing, plan.optimizer
    moments = f", AdamW moments in {str(opt.state_dtype).removeprefix('torch.')}" if opt.state_dtype else ""
    lines = [
        f"job plan: {plan.spec.name}/{config.model.flavor} on {plan.world_size} {plan.device} rank(s); nothing was built",
        f"  model       {total:,} parameters; {per_rank:,} per rank ({degrees})",
        f"  meshes      {plan.meshes.describe()}",
        *([f"  pipeline    {plan.pipeline.describe()}"] if plan.pipeline else []),
        *([f"  replicas    {plan.fault_tolerance.describe()}"] if plan.fault_tolerance.enabled else []),
        f"  batch       {batch.local} sequences x {batch.dp} data-parallel x {batch.accumulation} micro-batches = "
        f"{batch.global_size} x {batch.seq_len} tokens per step; {batch.tokens_per_device:,.0f} tokens per device",
        f"  compute     {plan.precision.describe()} "
        f"({'autocast' if plan.precision.autocast else 'FSDP mixed precision' if dims.fsdp_enabled else 'no casts'}); "
        f"loss parallel {'on' if plan.loss.parallel else 'off'}; activation checkpointing {ac.mode}; "
        f"compile {'blocks' if plan.compile.blocks else 'off'}{' + loss' if plan.loss.compiled else ''}; "
        f"converters {[c.name for c in plan.converters] or 'none'}",
        f"  attention   {plan.attention.describe()}",
        *([f"  fsdp        reshard after forward {plan.fsdp.reshard_after_forward}; reduce "
           f"{'every micro-batch' if plan.fsdp.reduce_every_microbatch else 'once per step'}"
           f"{'; CPU offload' if plan.fsdp.cpu_offload else ''}"] if dims.fsdp_enabled else []),
        f"  optimizer   {opt.name} ({opt.implementation}{moments}) lr {opt.lr:g}, clip {opt.max_norm:g}; "
        f"{opt.warmup_steps} warm-up steps, {opt.decay_type} decay over the last "
        f"{decay_steps(opt.total_steps, opt.warmup_steps, opt.decay_ratio)} of {opt.total_steps} steps",
        f"  groups      {opt.describe_groups()}",
        *([f"  muon        {opt.muon.adjust_lr} lr, momentum {opt.muon.momentum:g}{' (Nesterov)' if opt.muon.nesterov else ''}, "
           f"{opt.muon.ns_steps} Newton-Schulz steps in {str(opt.muon.ns_dtype).removeprefix('torch.')}"] if opt.muon else []),
        f"  flops       {plan.flops_per_token:.3e} per token; {plan.flops_per_token * batch.tokens_per_device:.3e} per device per step",
    ]
    lines += [f"  note        {note}" for note in plan.notes]
    lines += [f"  warning     {what}" for what in plan.warnings]
    return "\n".join(lines)
