"""tessera.mesh: parallel degrees, device/backend choice, process groups and device meshes."""

from tessera.mesh.device import (
    WorldInfo,
    backend_for,
    destroy_distributed,
    device_type,
    init_distributed,
    world_info,
)
from tessera.mesh.layout import (
    MeshLayout,
    flattened_dims,
    mesh_dim_names,
    mesh_layout,
    mesh_shape,
    world_dims,
)
from tessera.mesh.meshes import Meshes, build_meshes
from tessera.mesh.parallel_dims import (
    MESH_ORDER,
    ParallelDims,
    data_parallel_rank_and_size,
    resolve_parallel_dims,
)

__all__ = [
    "MESH_ORDER",
    "MeshLayout",
    "Meshes",
    "ParallelDims",
    "WorldInfo",
    "backend_for",
    "build_meshes",
    "data_parallel_rank_and_size",
    "destroy_distributed",
    "device_type",
    "flattened_dims",
    "init_distributed",
    "mesh_dim_names",
    "mesh_layout",
    "mesh_shape",
    "resolve_parallel_dims",
    "world_dims",
    "world_info",
]
