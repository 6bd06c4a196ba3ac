"""Device and backend choice and process-group start-up."""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


@dataclasses.dataclass(frozen=True)
class WorldInfo:
    """Where this process stands, as torchrun (or srun + torchrun) describes it in the environment."""

    rank: int
    local_rank: int
    world_size: int

    @property
    def launched(self) -> bool:
        """True when a launcher set up a process group rendezvous (torchrun sets MASTER_ADDR)."""
        return "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ


def world_info() -> WorldInfo:
    env = os.environ
    return WorldInfo(
        rank=int(env.get("RANK", "0")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=int(env.get("WORLD_SIZE", "1")),
    )


def device_type(requested: str | None = None) -> str:
    """'cuda' when a GPU is visible, else 'cpu'; an explicit request is checked, not trusted."""
    if requested in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested not in _BACKENDS:
        raise ValueError(f"device type {requested!r} is not supported; choose one of {sorted(_BACKENDS)} or 'auto'")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device type 'cuda' was requested but no CUDA device is available")
    return requested


def backend_for(device: str) -> str:
    """The collective backend for a device type: NCCL on GPUs, gloo on CPUs."""
    return _BACKENDS[device_type(device)]


def init_distributed(device: str, timeout_s: float = 300.0) -> WorldInfo:
    """Starts the default process group when launched by torchrun; a no-op for a plain process.

    Returns the WorldInfo; a single process started without a launcher runs without any process
    group, so every library must accept mesh=None.
    """
    info = world_info()
    if not info.launched or dist.is_initialized():
        return info
    if device == "cuda":
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(backend=backend_for(device), timeout=datetime.timedelta(seconds=timeout_s))
    return info


def destroy_distributed() -> None:
    """Tears the process group down; the barrier first keeps gloo from aborting at exit."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
