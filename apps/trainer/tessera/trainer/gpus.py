"""GPU data sheets, one table for the trainer's MFU and the planner's model: dense tensor-core
peaks by dtype ("float32" is TF32, the with-sparsity figures halved), memory, HBM bandwidth and
per-GPU bandwidth inside a node (NVLink, one direction), between nodes (the GPU's NIC) and to
host memory (PCIe), and the node's host memory per GPU, for
the SXM/HGX parts the planner models (tools/plan/README.md cites each of their figures); the
other parts carry their bf16 data-sheet peak only, for MFU."""

from __future__ import annotations

import dataclasses

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    marker: str  # the part of torch.cuda.get_device_name() that names this part
    tflops: dict[str, float]  # dense tensor-core peak by dtype name
    memory_gib: float | None = None  # None (and the fields below): a part the planner does not model
    hbm_tbps: float | None = None  # memory bandwidth, TB/s: float8 casts are memory-bound
    intra_node_gbps: float | None = None  # GB/s per GPU, one direction
    inter_node_gbps: float | None = None  # GB/s per GPU
    host_gbps: float | None = None  # GB/s per GPU to host memory, one direction (its PCIe x16 link): activation offload
    host_gib: float | None = None  # the node's host memory per GPU
    gpus_per_node: int = 8

    @property
    def has_float8(self) -> bool:
        return "float8" in self.tflops


HOPPER = {"bfloat16": 989.4, "float32": 494.7, "float8": 1978.9}
DATASHEETS = (
    # A100: no float8 tensor cores (torchao's float8 needs compute capability 8.9)
    GPU("A100 80GB SXM", "A100", {"bfloat16": 312, "float32": 156}, 80, 2.039, 300, 25, 32, 256),
    GPU("H100 SXM", "H100", HOPPER, 80, 3.35, 450, 50, 64, 256),
    GPU("H100 NVL", "H100 NVL", {"bfloat16": 835}),
    GPU("H100 PCIe", "H100 PCIe", {"bfloat16": 756}),
    GPU("GH200", "GH200", HOPPER),  # H100-class, not an H200
    GPU("H200 SXM", "H200", HOPPER, 141, 4.8, 450, 50, 64, 256),
    GPU("H200 NVL", "H200 NVL", {"bfloat16": 835}),
    GPU("B200 (HGX)", "B200", {"bfloat16": 2250, "float32": 1100, "float8": 4500}, 180, 7.7, 900, 50, 64, 512),
    GPU("GB200", "GB200", {"bfloat16": 2500}),
)
# the parts the planner models, by the names its --gpu takes
PLANNED = {gpu.marker.lower(): gpu for gpu in DATASHEETS if gpu.memory_gib is not None}


def datasheet(device_name: str) -> GPU | None:
    """The part whose marker is the longest one in ``device_name`` ("H200 NVL" before "H200",
    "GB200" before "B200", "GH200" before "H200"), or None for a part the table lacks."""
    found = [gpu for gpu in DATASHEETS if gpu.marker.upper() in device_name.upper()]
    return max(found, key=lambda gpu: len(gpu.marker)) if found else None
