"""The world DeviceMesh and the named meshes each parallelism receives."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator, Mapping

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessera.mesh.layout import ACCESSORS, MeshLayout, mesh_layout
from tessera.mesh.parallel_dims import ParallelDims


@dataclasses.dataclass(frozen=True, eq=False)
class Meshes(Mapping[str, DeviceMesh]):
    """The meshes of one job; an accessor is None when its parallelism is off.

    - world: every rank, dims as in `layout` (None in a process without a process group).
    - batch: the data-parallel ranks the data loader shards batches over (dp_replicate x dp_shard).
    - loss: where the loss and metrics are averaged (dp_replicate x dp_shard x cp).
    - fsdp: what FSDP shards parameters over: dp_shard x cp flattened, or 2-D
      (dp_replicate, dp_shard_cp) for HSDP; None when dp_shard*cp == 1.
    - dp_replicate (DDP, or HSDP's replication), tp, pp, cp, ep: one dim each.
    - expert_fsdp: what expert weights are FSDP-sharded over when ep > 1: the dp_shard_mod_ep
      ranks (dp_shard*cp/ep, possibly 1), 2-D with dp_replicate first when dp_replicate > 1.

    Also a read-only mapping over the keys build_meshes returned before it had accessors
    ("world", each active parallel dim, "dp", "dp_shard_cp", "dp_cp"); new code uses the accessors.
    """

    layout: MeshLayout
    world: DeviceMesh | None
    batch: DeviceMesh | None
    loss: DeviceMesh | None
    fsdp: DeviceMesh | None
    dp_replicate: DeviceMesh | None
    tp: DeviceMesh | None
    pp: DeviceMesh | None
    cp: DeviceMesh | None
    ep: DeviceMesh | None
    expert_fsdp: DeviceMesh | None
    by_key: Mapping[str, DeviceMesh] = dataclasses.field(repr=False)

    @classmethod
    def single(cls) -> Meshes:
        """A plain process with no process group: every mesh is None, so each library runs
        unsharded (the libraries all accept mesh=None)."""
        layout = mesh_layout(ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1))
        return cls(layout=layout, world=None, **{name: None for name in ACCESSORS if name != "world"},
                   by_key=types.MappingProxyType({}))

    def __getitem__(self, key: str) -> DeviceMesh:
        return self.by_key[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.by_key)

    def __len__(self) -> int:
        return len(self.by_key)


def _group_mesh(world: DeviceMesh, name: str, parts: tuple[str, ...]) -> DeviceMesh:
    """A world dim as it is, or the world dims `parts` flattened into a 1-D mesh called `name`."""
    return world[name] if parts == (name,) else world[parts]._flatten(mesh_dim_name=name)


def _join(meshes: list[DeviceMesh]) -> DeviceMesh:
    """1-D meshes as the dims of one mesh. Concatenating (rather than slicing a flattened dim back
    out of the world mesh, which torch deprecates) also lets HSDP shard over a flattened dp_shard x cp."""
    return meshes[0] if len(meshes) == 1 else DeviceMesh._concatenate(meshes)


def build_meshes(dims: ParallelDims, device: str) -> Meshes:
    """Builds mesh_layout(dims) on the default process group: all ranks must call it together.

    Every process group is created here, once, so later accessors cost no collective set-up.
    """
    if dims.world_size != dist.get_world_size():
        raise ValueError(f"parallel dims describe {dims.world_size} ranks but the world has {dist.get_world_size()}")
    layout = mesh_layout(dims)
    world = init_device_mesh(device, layout.shape, mesh_dim_names=layout.dim_names)
    groups = {name: _group_mesh(world, name, parts) for name, parts in layout.groups}
    groups["world"] = world
    accessors = {name: _join([groups[g] for g in axes]) for name, axes in layout.accessors}
    return Meshes(
        layout=layout,
        world=world,
        **{name: accessors.get(name) for name in ACCESSORS if name != "world"},
        by_key=types.MappingProxyType({key: groups[key] for key in layout.mapping_keys}),
    )
