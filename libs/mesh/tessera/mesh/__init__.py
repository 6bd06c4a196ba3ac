"""tessera.mesh: parallel degrees, device/backend choice, process groups and device meshes."""

from tessera.mesh.device import (
    WorldInfo,
    backend_for,
    build_meshes,
    destroy_distributed,
    device_type,
    init_distributed,
    world_info,
)
from tessera.mesh.parallel_dims import (
    MESH_ORDER,
    ParallelDims,
    data_parallel_rank_and_size,
    flattened_dims,
    mesh_dim_names,
    mesh_shape,
    resolve_parallel_dims,
)

__all__ = [
    "MESH_ORDER",
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
    "mesh_shape",
    "resolve_parallel_dims",
    "world_info",
]
