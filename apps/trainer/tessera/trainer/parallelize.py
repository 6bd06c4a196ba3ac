"""Turns a freshly built model into the configured layout: TP, activation checkpointing,
compile, then FSDP/HSDP or DDP — in that order, because each wraps what the previous produced."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from tessera import fsdp, tp
from tessera.mesh import ParallelDims
from tessera.trainer.config import ConfigError, JobConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Outputs kept by selective AC: recomputing matmuls dominates backward cost, the rest is cheap.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str, option: str) -> None:
    """Wraps blocks of model.layers: 'full' recomputes whole blocks, 'selective' either keeps
    matmul outputs ('op') or fully checkpoints every N-th block (an integer option)."""
    for index, (name, block) in enumerate(model.layers.named_children()):
        if mode == "full" or (mode == "selective" and option != "op" and index % int(option) == 0):
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        elif mode == "selective" and option == "op":
            wrapped = checkpoint_wrapper(
                block, preserve_rng_state=False,
                context_fn=lambda: create_selective_checkpoint_contexts(_save_matmuls),
            )
        else:
            continue
        model.layers.register_module(name, wrapped)


def apply_compile(model: nn.Module) -> None:
    """Compiles each block on its own: blocks are identical, so one graph is reused and FSDP's
    per-block hooks stay outside the compiled regions."""
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, fullgraph=True))


def check_layout(config: JobConfig, dims: ParallelDims, device: str) -> None:
    """Combinations the trainer cannot run, refused before anything is built."""
    par = config.parallelism
    if config.compile.enable and dims.tp_enabled:
        raise ConfigError(
            "compile.enable with tensor_parallel_degree > 1 is not supported: per-block compile "
            "fails in backward on TP-sharded embedding outputs"
        )
    if par.enable_async_tensor_parallel:
        # tessera.tp.enable_async_tp needs CUDA and torch.compile; compile with TP is refused above
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel needs CUDA and compile.enable with tensor parallel, "
            "which the trainer does not support yet (per-block compile fails with TP)"
        )
    if config.training.enable_cpu_offload and not dims.fsdp_enabled:
        raise ConfigError("training.enable_cpu_offload needs FSDP (data_parallel_shard_degree > 1)")


def parallelize(model: nn.Module, spec, args, config: JobConfig, dims: ParallelDims,
                meshes: dict[str, DeviceMesh], device: str) -> nn.Module:
    """Applies the configured parallelisms and wrappers; returns the model to train."""
    par = config.parallelism
    if dims.tp_enabled:
        # sequence parallel splits every sequence across the tp ranks, too
        tp.check_tp_degree(dims.tp, {**spec.tp_divisible(args), "seq_len": config.training.seq_len})
        tp.apply_tp(
            model, meshes["tp"], spec.tp_plan,
            sequence_parallel=True, loss_parallel=not par.disable_loss_parallel,
        )
    if config.activation_checkpoint.mode != "none":
        apply_activation_checkpointing(
            model, config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option
        )
    if config.compile.enable and "model" in config.compile.components:
        apply_compile(model)
    if dims.fsdp_enabled:
        dp_mesh = meshes["world"][("dp_replicate", "dp_shard")] if dims.hsdp_enabled else meshes["dp_shard"]
        fsdp.apply_fsdp(
            model, dp_mesh,
            param_dtype=DTYPES[config.training.mixed_precision_param],
            reduce_dtype=DTYPES[config.training.mixed_precision_reduce],
            reshard_after_forward=par.fsdp_reshard_after_forward,
            cpu_offload=config.training.enable_cpu_offload,
        )
    elif dims.dp_replicate > 1:
        fsdp.apply_ddp(model, meshes["dp_replicate"])
    return model
