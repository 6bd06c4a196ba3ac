"""Whole matrices for sharded DTensors, one owner each: a rank gathers a matrix's shards, applies a
function to the whole, and scatters the result back as each rank's shard. Nothing is gathered to
every rank, and with one matrix per owner in turn each rank computes only its share.

Only mesh dimensions that split the matrix dimensions (the last two) take part: a mesh dimension
that replicates the tensor, or splits a stack of matrices on a leading dimension (MoE experts
under expert parallelism), leaves each rank with whole matrices along it. The collectives run
along one mesh dimension at a time (its process group), innermost first, so the mesh needs no
flattened group.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def matrix_mesh_dims(param: DTensor) -> list[int]:
    """The mesh dimensions that split param's last two dimensions."""
    last_two = (param.ndim - 2, param.ndim - 1)
    # _StridedShard (FSDP over tensor-parallel rows) is no Shard subclass, but leaves each rank one block too
    return [d for d, p in enumerate(param.placements)
            if isinstance(p, (Shard, _StridedShard)) and p.dim % param.ndim in last_two]


def whole_locally(param: torch.Tensor) -> bool:
    """Whether this rank holds every matrix of its shard whole (a plain tensor, or no mesh
    dimension splits the matrices)."""
    return not isinstance(param, DTensor) or not matrix_mesh_dims(param)


def _record_size(param: DTensor, local: torch.Tensor, dims: list[int]) -> int:
    """The most elements any rank's shard has, given that the ranks of a group share the leading
    dimensions: ceil(n / k) per matrix dimension split k ways (nested chunks round the same)."""
    splits = {param.ndim - 2: 1, param.ndim - 1: 1}
    for d in dims:
        splits[param.placements[d].dim % param.ndim] *= param.device_mesh.size(d)
    rows, cols = (math.ceil(param.shape[i] / splits[i]) for i in (param.ndim - 2, param.ndim - 1))
    return math.prod(local.shape[:-2]) * rows * cols


def apply_whole(param: DTensor, local: torch.Tensor, owner: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn applied to the whole matrices that `local` (this rank's shard of something shaped and
    placed like param) is a piece of, returned as this rank's piece. owner picks the rank (by
    index over the matrix-splitting mesh dimensions, modulo their size) that gathers and calls
    fn; every rank of the mesh must call this for the same params in the same order."""
    mesh, dims = param.device_mesh, matrix_mesh_dims(param)
    sizes = [mesh.size(d) for d in dims]
    owner_at, rest = [], owner % math.prod(sizes)
    for n in reversed(sizes):  # the owner's coordinate on each matrix-splitting mesh dimension
        rest, at = divmod(rest, n)
        owner_at.insert(0, at)
    here = mesh.get_coordinate()
    size = _record_size(param, local, dims)
    data = torch.zeros(size, dtype=local.dtype, device=local.device)
    data[:local.numel()] = local.reshape(-1)

    stages = []  # (index into dims, whether this rank received) of every gather this rank joined
    for i in reversed(range(len(dims))):
        group, dst = mesh.get_group(dims[i]), owner_at[i]
        receives = here[dims[i]] == dst
        datas = [torch.empty_like(data) for _ in range(sizes[i])] if receives else None
        dist.gather(data, datas, group=group, group_dst=dst)
        stages.append((i, receives))
        if not receives:
            break
        data = torch.cat(datas)

    if all(received for _, received in stages):  # the owner: every shard is here, in coordinate order
        blocks = _blocks(param, here, dims)
        data = _pieces(fn(_whole(param, local, blocks, data, size)), blocks, size)

    for i, receives in reversed(stages):
        group, src = mesh.get_group(dims[i]), owner_at[i]
        out = torch.empty(data.numel() // sizes[i] if receives else data.numel(), dtype=local.dtype, device=local.device)
        dist.scatter(out, list(data.chunk(sizes[i])) if receives else None, group=group, group_src=src)
        data = out
    return data[:local.numel()].view(local.shape)


def _blocks(param: DTensor, here: list[int], dims: list[int]) -> list[tuple[int, int, int, int]]:
    """(row, column, rows, columns) of the matrix block each rank of the gathering holds, in the
    order the gathers concatenate them (the first gathered dimension slowest), computed here
    rather than sent, in plain Python (fake tensors trace it too)."""
    mesh = param.device_mesh
    blocks = []
    for at in itertools.product(*(range(mesh.size(d)) for d in dims)):
        coordinate = list(here)
        for d, c in zip(dims, at):
            coordinate[d] = c
        blocks.append(_block(param, coordinate))
    return blocks


def _block(param: DTensor, coordinate: list[int]) -> tuple[int, int, int, int]:
    """The block of the last two dimensions the rank at `coordinate` holds. DTensor splits like
    torch.chunk (pieces of ceil(n / k), the last ones short or empty), mesh dimension by mesh
    dimension; a _StridedShard splits what the later Shards of its dimension left (FSDP over
    tensor-parallel rows)."""
    placements, ndim = param.placements, param.ndim
    start, length = [0, 0], [param.shape[-2], param.shape[-1]]
    order = ([d for d, p in enumerate(placements) if isinstance(p, Shard)]
             + [d for d, p in enumerate(placements) if isinstance(p, _StridedShard)])
    for d in order:
        axis = placements[d].dim % ndim - (ndim - 2)
        if axis < 0:
            continue  # a stack's leading dimension
        chunk = math.ceil(length[axis] / param.device_mesh.size(d))
        begin = min(coordinate[d] * chunk, length[axis])
        start[axis], length[axis] = start[axis] + begin, min(chunk, length[axis] - begin)
    return start[0], start[1], length[0], length[1]


def _whole(param: DTensor, local: torch.Tensor, blocks: list[tuple[int, int, int, int]], data: torch.Tensor,
           size: int) -> torch.Tensor:
    lead = local.shape[:-2]
    whole = torch.empty(*lead, param.shape[-2], param.shape[-1], dtype=local.dtype, device=local.device)
    for (row, col, rows, cols), piece in zip(blocks, data.split(size)):
        whole[..., row:row + rows, col:col + cols] = piece[:math.prod(lead) * rows * cols].view(*lead, rows, cols)
    return whole


def _pieces(whole: torch.Tensor, blocks: list[tuple[int, int, int, int]], size: int) -> torch.Tensor:
    """whole cut back into the blocks, each padded to size, end to end."""
    out = torch.zeros(len(blocks) * size, dtype=whole.dtype, device=whole.device)
    for (row, col, rows, cols), piece in zip(blocks, out.split(size)):
        block = whole[..., row:row + rows, col:col + cols]
        piece[:block.numel()] = block.reshape(-1)
    return out
