"""Data parallelism for models that follow Tessera's module conventions.

Conventions: ``model.layers`` is an ``nn.ModuleDict`` of transformer blocks (a pipeline stage may
have deleted some), and ``model.tok_embeddings``, ``model.norm`` and ``model.output`` are optional
(absent or None on a pipeline stage that does not own them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

RESHARD_POLICIES = ("default", "always", "never")
# Parameter / gradient-reduction dtypes of mixed precision, by the names configs use.
MIXED_PRECISION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _blocks(model: nn.Module) -> nn.ModuleDict:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError(f"{type(model).__name__} has no `layers` nn.ModuleDict of transformer blocks")
    return layers


def _tied(embedding: nn.Module | None, output: nn.Module | None) -> bool:
    """True when the output projection shares its weight with the embedding (tied embeddings)."""
    if embedding is None or output is None:
        return False
    return any(p is q for p in embedding.parameters() for q in output.parameters())


class _ByteAllGather(DefaultAllGather):
    """torch's all-gather, with 1-byte float tensors sent as their bytes (uint8): gloo takes no
    float8 dtype ("Invalid scalar type"), and FSDP gathers a group whose parameters all
    all-gather in float8 (torchao's float8 all-gather, e.g. the output projection's own group)
    in that dtype."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if input_tensor.dtype.is_floating_point and input_tensor.dtype.itemsize == 1:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return super().__call__(output_tensor, input_tensor, group, async_op)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: str = "default",
    cpu_offload: bool = False,
    own_meshes: Sequence[tuple[nn.Module, DeviceMesh, Callable | None]] = (),
    keep_output_gathered: bool = False,
) -> nn.Module:
    """Shards ``model`` in place with FSDP2 over ``dp_mesh`` and returns it.

    A 1-D ``dp_mesh`` fully shards; a 2-D (dp_replicate, dp_shard) mesh shards on the second dim
    and replicates on the first (HSDP). Communication groups: one per block of ``model.layers``,
    one for ``tok_embeddings``, one for ``output``, and the root (``norm`` and anything left).
    With tied embeddings, embedding and output stay together in the root group.

    ``reshard_after_forward``: "default" frees a group's gathered weights after its forward
    except where backward needs them straight away (the last block, the output projection,
    the root), saving those all-gathers; "always" frees every group (least memory); "never"
    keeps every group gathered from forward to backward (no backward all-gathers, ZeRO-2-like
    memory).

    ``keep_output_gathered``: the output projection's group is never freed after its forward,
    whatever the policy: for a loss that reads its weights after the model's forward (one that
    projects the hidden states chunk by chunk).

    ``own_meshes``: (submodule, mesh, shard_placement_fn or None) for parameters sharded over
    another mesh than ``dp_mesh`` — expert-parallel experts over the ranks left beside ep. Each
    gets its own group, resharded like the block around it, before that block's.
    """
    if reshard_after_forward not in RESHARD_POLICIES:
        raise ValueError(
            f"reshard_after_forward={reshard_after_forward!r} is not one of {list(RESHARD_POLICIES)}"
        )
    blocks = _blocks(model)
    policy = {"mesh": dp_mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if cpu_offload:
        # pinning needs an accelerator; CPUOffloadPolicy() fails on a machine without one
        policy["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())

    def reshard(needed_first_in_backward: bool) -> bool:
        if reshard_after_forward == "default":
            return not needed_first_in_backward
        return reshard_after_forward == "always"

    embedding, output = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if not _tied(embedding, output):
        # The embedding runs first in forward and its gradient comes last in backward: its own
        # group is freed in between instead of staying gathered with the root for the whole step
        # (vocab x dim weights, the largest in the model).
        if embedding is not None:
            fully_shard(embedding, reshard_after_forward=reshard(False), **policy)
        # The output projection is as large, and its own group lets its reduce-scatter overlap
        # the blocks' backward instead of waiting for the root's at the end. Backward needs it
        # first, so "default" keeps it gathered.
        if output is not None:
            fully_shard(output, reshard_after_forward=reshard(True) and not keep_output_gathered, **policy)
    names = list(blocks)
    for name in names:
        last = name == names[-1]
        for module, mesh, placement in own_meshes:
            if any(m is module for m in blocks[name].modules()):
                fully_shard(module, reshard_after_forward=reshard(last), **{**policy, "mesh": mesh},
                            shard_placement_fn=placement)
        fully_shard(blocks[name], reshard_after_forward=reshard(last), **policy)
    fully_shard(model, reshard_after_forward=reshard(True), **policy)
    if dp_mesh.device_type == "cpu":  # gloo
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(_ByteAllGather())
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Replicates ``model`` over the 1-D ``dp_mesh`` (DDP: gradients all-reduced in buckets).

    Uses the composable ``torch.distributed._composable.replicate``, which wraps
    DistributedDataParallel and leaves parameters plain tensors (the FSDP-based replicate in
    ``replicate_with_fsdp`` turns them into DTensors). For models small enough that every rank
    holds all weights and optimizer state.
    """
    if dp_mesh.ndim != 1:
        raise ValueError(f"apply_ddp needs a 1-D data-parallel mesh, got {dp_mesh.ndim} dims {dp_mesh.mesh_dim_names}")
    replicate(model, device_mesh=dp_mesh)
    return model
