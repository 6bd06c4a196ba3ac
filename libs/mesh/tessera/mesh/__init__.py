"""tessera.mesh: parallel degrees, device/backend choice, process groups and device meshes, and
the DTensor helpers the parallelism libraries share (tessera.mesh.dtensor)."""

from tessera.mesh.device import (
    WorldInfo,
    backend_for,
    destroy_distributed,
    device_type,
    init_distributed,
    world_info,
)
from tessera.mesh.dtensor import fold_kv_heads, local_parameters, repeat_kv_heads, swapped_class
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
    "fold_kv_heads",
    "init_distributed",
    "local_parameters",
    "mesh_dim_names",
    "mesh_layout",
    "mesh_shape",
    "repeat_kv_heads",
    "resolve_parallel_dims",
    "swapped_class",
    "world_dims",
    "world_info",
]
