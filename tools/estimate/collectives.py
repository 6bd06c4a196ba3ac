"""Bytes each collective moves, by kind and by the mesh dimension whose process group ran it,
counted at the dispatcher (FSDP, DTensor and the pipeline all reach c10d through it)."""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# op name (without overload) -> (kind, index of the argument whose size is the collective's buffer:
# the gathered output of an all-gather, the unreduced input of a reduce-scatter, the tensor otherwise)
_OPS = {
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0), "all_gather_into_tensor": ("all_gather", "out"),
    "all_gather_into_tensor_out": ("all_gather", "out"), "all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1), "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_out": ("reduce_scatter", 0), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "allreduce_": ("all_reduce", 0), "all_reduce": ("all_reduce", 0), "all_reduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0), "all_reduce_coalesced": ("all_reduce", 0),
    "all_reduce_coalesced_": ("all_reduce", 0),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1), "all_to_all_single": ("all_to_all", 0),
    "send": ("send_recv", 0), "recv_": ("send_recv", 0),
    "broadcast_": ("broadcast", 0), "broadcast": ("broadcast", 0),
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group_name(args) -> str | None:
    """c10d ops take the ProcessGroup object, functional ones its name (a str)."""
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return dist.ProcessGroup.unbox(a).group_name
    strings = [a for a in args if isinstance(a, str)]
    return strings[-1] if strings else None


class Collectives(TorchDispatchMode):
    """bytes[(kind, mesh dim)]: the collectives' buffer sizes (see _OPS), summed over the run;
    `dims` maps a process group's name to the mesh dimension (a Meshes key) it belongs to; `key`
    names a storage (LiveBytes.key) for `buffers`."""

    def __init__(self, dims: dict[str, str], key) -> None:
        super().__init__()
        self.dims, self.key = dims, key
        self.bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()  # how many, by the same key
        self.buffers: set[int] = set()  # storage keys of tensors a collective read or wrote

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._opname
        if func.namespace in ("c10d", "_c10d_functional") and name in _OPS:
            kind, index = _OPS[name]
            sized = out if index == "out" else args[index]
            group = _group_name(args)
            key = (kind, self.dims.get(group, group or "?"))
            self.bytes[key] += _nbytes(sized)
            self.calls[key] += 1
            for t in [*_flat(args), *_flat(out)]:
                self.buffers.add(self.key(t.untyped_storage()))
        return out


def _flat(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return []


def _named_groups(meshes) -> dict[str, tuple[str, dist.ProcessGroup]]:
    """Process-group name -> (what it is to the job, the group): the Meshes accessor ("fsdp", "tp",
    "pp", ...; HSDP's outer dim "dp_replicate"), else the mapping key of the group. Expert
    parallel's group is often another dimension's too (ep carved out of dp_shard x cp): then both
    are named, "fsdp=ep"."""
    named: dict[str, tuple[str, dist.ProcessGroup]] = {}
    accessors = [(name, getattr(meshes, name)) for name in ("fsdp", "tp", "pp", "cp", "ep", "expert_fsdp", "dp_replicate", "loss", "batch")]
    for key, mesh in [*accessors, *meshes.items()]:
        if mesh is None or key == "world":
            continue
        for i, dim in enumerate(mesh.mesh_dim_names or ()):
            group = mesh.get_group(i)
            name = key if i == mesh.ndim - 1 else dim
            if name == "ep" and group.group_name in named and named[group.group_name][0] != "ep":
                name = f"{named.pop(group.group_name)[0]}=ep"
            named.setdefault(group.group_name, (name, group))
    return named


def group_dims(meshes) -> dict[str, str]:
    """Process-group name -> what it is to the job (_named_groups)."""
    return {group: name for group, (name, _) in _named_groups(meshes).items()}


def group_ranks(meshes) -> dict[str, tuple[int, ...]]:
    """What a group is to the job -> the global ranks of this rank's group: the nodes a
    collective along it crosses."""
    return {name: tuple(dist.get_process_group_ranks(group)) for name, group in _named_groups(meshes).values()}
