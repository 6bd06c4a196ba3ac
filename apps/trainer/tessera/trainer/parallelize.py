"""The model a run trains, built in a fixed order — build, convert, parallelise, materialise —
because each stage wraps what the previous one produced:

1. build: the spec's model, whole on CPU, on the meta device on GPU;
2. convert: the plan's model converters swap modules (float8 linears) while the module tree is
   still plain;
3. parallelise: tensor parallel (with the converters' styles), activation checkpointing and
   per-block compile, then FSDP/HSDP or DDP outermost;
4. materialise: a meta-built model gets storage and its initial weights, now sharded.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera import fsdp, tp
from tessera.mesh import Meshes
from tessera.models import apply_activation_checkpointing, apply_compile
from tessera.trainer.plan import JobPlan


def build_model(plan: JobPlan) -> nn.Module:
    """On CPU the full model is built and initialised before sharding, so every layout starts
    from the single-process weights (DTensor has no cross-rank RNG on CPU). On GPU it is built on
    the meta device and initialised after sharding, so no rank ever holds the whole model."""
    if plan.device == "cpu":
        return plan.spec.build(plan.model_args)
    with torch.device("meta"):
        return plan.spec.build(plan.model_args)


def convert(model: nn.Module, plan: JobPlan) -> None:
    for converter in plan.converters:
        converter.convert(model)


def parallelize(model: nn.Module, plan: JobPlan, meshes: Meshes | None) -> nn.Module:
    """Applies the planned parallelisms and wrappers; returns the model to train."""
    config, dims = plan.config, plan.dims
    if dims.tp_enabled:
        tp.apply_tp(
            model, meshes.tp, plan.spec.tp_plan,
            sequence_parallel=True, loss_parallel=plan.loss_parallel, styles=plan.tp_styles,
        )
    ac = config.activation_checkpoint
    if ac.mode != "none":
        apply_activation_checkpointing(model, ac.mode, ac.selective_ac_option)
    if config.compile.enable and "model" in config.compile.components:
        apply_compile(model)
    if dims.fsdp_enabled:
        fsdp.apply_fsdp(
            model, meshes.fsdp, param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype,
            reshard_after_forward=config.parallelism.fsdp_reshard_after_forward,
            cpu_offload=config.training.enable_cpu_offload,
        )
    elif dims.dp_replicate > 1:
        fsdp.apply_ddp(model, meshes.dp_replicate)
    return model


def materialise(model: nn.Module, plan: JobPlan) -> None:
    """Allocates and initialises a meta-built model; FSDP-offloaded parameters live on CPU."""
    if plan.device != "cpu":
        model.to_empty(device="cpu" if plan.config.training.enable_cpu_offload else plan.device)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device(plan.device))


def build_parallel_model(plan: JobPlan, meshes: Meshes | None) -> nn.Module:
    model = build_model(plan)
    convert(model, plan)
    model = parallelize(model, plan, meshes)
    materialise(model, plan)
    return model
