"""GPU types as data: memory, dense peak TFLOPs per dtype, and per-GPU bandwidth inside a node
(NVLink, one direction) and between nodes (the GPU's NIC). Vendor datasheet figures (SXM parts)."""

from __future__ import annotations

import dataclasses

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    tflops: dict[str, float]  # dense, by dtype name
    intra_node_gbps: float  # GB/s per GPU, one direction
    inter_node_gbps: float  # GB/s per GPU
    gpus_per_node: int = 8


GPUS = {
    "a100": GPU("A100 80GB SXM", 80, {"bfloat16": 312, "float32": 156, "float8": 312}, 300, 25),
    "h100": GPU("H100 SXM", 80, {"bfloat16": 989, "float32": 495, "float8": 1979}, 450, 50),
    "h200": GPU("H200 SXM", 141, {"bfloat16": 989, "float32": 495, "float8": 1979}, 450, 50),
    "b200": GPU("B200", 180, {"bfloat16": 2250, "float32": 1100, "float8": 4500}, 900, 100),
}
