"""GPU types as data: memory, dense peak TFLOPs per dtype, HBM bandwidth, and per-GPU bandwidth
inside a node (NVLink, one direction) and between nodes (the GPU's NIC). Vendor datasheet figures
of the SXM parts, dense (the datasheets' "with sparsity" figures halved); README.md cites each."""

from __future__ import annotations

import dataclasses

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    tflops: dict[str, float]  # dense tensor-core peak by dtype name: "float32" is TF32 (the trainer enables it)
    hbm_tbps: float  # memory bandwidth, TB/s: float8 casts are memory-bound
    intra_node_gbps: float  # GB/s per GPU, one direction
    inter_node_gbps: float  # GB/s per GPU
    gpus_per_node: int = 8

    @property
    def has_float8(self) -> bool:
        return "float8" in self.tflops


GPUS = {
    # A100: no float8 tensor cores (torchao's float8 needs compute capability 8.9)
    "a100": GPU("A100 80GB SXM", 80, {"bfloat16": 312, "float32": 156}, 2.039, 300, 25),
    "h100": GPU("H100 SXM", 80, {"bfloat16": 989.4, "float32": 494.7, "float8": 1978.9}, 3.35, 450, 50),
    "h200": GPU("H200 SXM", 141, {"bfloat16": 989.4, "float32": 494.7, "float8": 1978.9}, 4.8, 450, 50),
    "b200": GPU("B200 (HGX)", 180, {"bfloat16": 2250, "float32": 1100, "float8": 4500}, 7.7, 900, 50),
}
