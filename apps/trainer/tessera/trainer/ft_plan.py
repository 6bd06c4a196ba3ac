"""The job plan's fault tolerance ([fault_tolerance], torchft): how many replica groups, which one
this is, how the groups synchronise (every step, or semi-sync: LocalSGD / DiLoCo with its
fragments) and every check of those keys, raised once before any worker starts.

A replica group is a whole job of its own (FSDP x TP x PP ...) over its share of the ranks; the
data-parallel dimension across the groups is torchft's, so the data and the batch arithmetic
count `groups` times the group's own data-parallel degree.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable

import torch

from tessera import pp
from tessera.mesh import ParallelDims
from tessera.trainer.config import ConfigError, FaultTolerance, JobConfig

TORCHFT_PIN = "torchft==0.2.0"  # the locked version (requirements_lock.txt)


@dataclasses.dataclass(frozen=True)
class FaultTolerancePlan:
    enabled: bool
    groups: int = 1  # replica groups (fault_tolerance.group_size); 1 without fault tolerance
    replica_id: int = 0
    min_replicas: int = 1
    backend: str = "gloo"
    timeout_s: float = 10.0
    semi_sync: str | None = None  # None (gradients averaged every step), "local_sgd" or "diloco"
    sync_steps: int = 1
    fragments: tuple[tuple[str, ...], ...] = ()  # diloco: module names per fragment; () the whole model
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    should_quantize: bool = False
    dataloader_checkpoints: bool = True  # checkpoint.enable_ft_dataloader_checkpoints

    def data_shard(self, dp_rank: int, dp: int) -> tuple[int, int]:
        """(rank, size) of this rank's data share: group g's dp ranks follow group g-1's."""
        return self.replica_id * dp + dp_rank, dp * self.groups

    def job_rank(self, rank: int, group_world_size: int) -> int:
        """A rank counted across the replica groups (what debug.fault_rank names)."""
        return self.replica_id * group_world_size + rank

    def describe(self) -> str:
        if not self.semi_sync:
            sync = "gradients and loss averaged over the groups every step"
        elif self.semi_sync == "local_sgd":
            sync = f"LocalSGD: weights averaged every {self.sync_steps} steps"
        else:
            fragments = f"{len(self.fragments)} fragments synced in turn" if self.fragments else "one fragment"
            sync = (f"DiLoCo: outer Nesterov SGD on the averaged weight deltas every {self.sync_steps} steps, {fragments}"
                    f"{f', delay {self.fragment_sync_delay}' if self.fragment_sync_delay else ''}"
                    f"{f', alpha {self.fragment_update_alpha:g}' if self.fragment_update_alpha else ''}")
        data = "its data position recorded every step" if self.dataloader_checkpoints else "no per-group data positions"
        return (f"replica group {self.replica_id} of {self.groups} (torchft over {self.backend}, collectives time out after "
                f"{self.timeout_s:g} s); {sync}; a {'sync' if self.semi_sync else 'step'} counts with >= {self.min_replicas} "
                f"group(s); {data}")


OFF = FaultTolerancePlan(enabled=False)


def torchft_missing() -> str | None:
    """The one line saying what to install, or None when torchft is importable."""
    if importlib.util.find_spec("torchft") is None:
        return f"fault_tolerance.enable needs torchft, which is not installed: pip install {TORCHFT_PIN}"
    return None


def replica_subfolder(config: JobConfig) -> str:
    """Where a replica group's own outputs go below their folder (metrics, profiler traces, memory
    snapshots): each group is a job with a rank 0 of its own, whose files would take the other
    groups' names. replica_<id> under fault tolerance, as torchtitan's fault-tolerant trainer."""
    return f"replica_{config.fault_tolerance.replica_id}" if config.fault_tolerance.enable else ""


def group_world_size(world_size: int, config: JobConfig) -> int:
    """The ranks of one replica group when `world_size` ranks (--nproc, all nodes) start the job."""
    groups = config.fault_tolerance.group_size
    if not config.fault_tolerance.enable:
        return world_size
    _check_group_size(groups)
    if world_size % groups:
        raise ConfigError(f"{world_size} ranks do not split into fault_tolerance.group_size {groups} replica groups")
    return world_size // groups


def _check_group_size(groups: int) -> None:
    if groups < 1:
        raise ConfigError("fault_tolerance.group_size must be >= 1 with fault_tolerance.enable: the number of replica "
                          "groups")


def fault_tolerance_plan(config: JobConfig, dims: ParallelDims, meta_model: Callable[[], torch.nn.Module], device: str,
                         notes: list[str] | None) -> FaultTolerancePlan:
    """The replica groups' plan; ConfigError names the key at fault. `notes`: a check-only plan
    notes a missing torchft instead of stopping."""
    ft = config.fault_tolerance
    if not ft.enable:
        _only_with_enable(ft)
        return OFF
    missing = torchft_missing()
    if missing and notes is None:
        raise ConfigError(missing)
    if missing:
        notes.append(missing)
    _check_group_size(ft.group_size)
    if not ft.replica_id < ft.group_size:
        raise ConfigError(f"fault_tolerance.replica_id {ft.replica_id} must be below fault_tolerance.group_size {ft.group_size}")
    if ft.min_replica_size > ft.group_size:
        raise ConfigError(f"fault_tolerance.min_replica_size {ft.min_replica_size} exceeds fault_tolerance.group_size "
                          f"{ft.group_size}: no step could ever count")
    if dims.dp_replicate > 1:
        raise ConfigError("parallelism.data_parallel_replicate_degree must be 1 with fault_tolerance.enable: the replica "
                          "groups are the replicated dimension (torchft's); shard within a group instead")
    if ft.process_group == "nccl" and device != "cuda":
        raise ConfigError("fault_tolerance.process_group nccl needs CUDA; use gloo")
    if config.checkpoint.create_seed_checkpoint:
        raise ConfigError("checkpoint.create_seed_checkpoint writes seed weights from one process: run it without "
                          "fault_tolerance.enable")
    fragments = _semi_sync(config, dims, meta_model, device)
    return FaultTolerancePlan(
        enabled=True, groups=ft.group_size, replica_id=ft.replica_id, min_replicas=ft.min_replica_size,
        backend=ft.process_group, timeout_s=ft.process_group_timeout_ms / 1000, semi_sync=ft.semi_sync_method,
        sync_steps=ft.sync_steps if ft.semi_sync_method else 1, fragments=fragments,
        fragment_sync_delay=ft.fragment_sync_delay, fragment_update_alpha=ft.fragment_update_alpha,
        should_quantize=ft.should_quantize, dataloader_checkpoints=config.checkpoint.enable_ft_dataloader_checkpoints,
    )


_SEMI_SYNC_KEYS = ("sync_steps", "should_quantize")
_DILOCO_KEYS = ("fragment_sync_delay", "fragment_update_alpha", "module_fqns_per_model_fragment", "num_fragments")


def _non_default(ft: FaultTolerance, names) -> list[str]:
    defaults = FaultTolerance()
    return [name for name in names if getattr(ft, name) != getattr(defaults, name)]


def _only_with_enable(ft: FaultTolerance) -> None:
    names = [f.name for f in dataclasses.fields(FaultTolerance) if f.name != "enable"]
    for name in _non_default(ft, names):
        raise ConfigError(f"fault_tolerance.{name} applies only with fault_tolerance.enable = true")


def _semi_sync(config: JobConfig, dims: ParallelDims, meta_model: Callable[[], torch.nn.Module],
               device: str) -> tuple[tuple[str, ...], ...]:
    """Checks the semi-sync keys; DiLoCo's fragments as module names (() for the whole model)."""
    ft, method = config.fault_tolerance, config.fault_tolerance.semi_sync_method
    if method is None:
        for name in _non_default(ft, _SEMI_SYNC_KEYS + _DILOCO_KEYS):
            raise ConfigError(f"fault_tolerance.{name} applies only with fault_tolerance.semi_sync_method local_sgd or diloco")
        return ()
    if method == "local_sgd":
        for name in _non_default(ft, _DILOCO_KEYS):
            raise ConfigError(f"fault_tolerance.{name} applies only with fault_tolerance.semi_sync_method diloco")
    if dims.pp_enabled:
        raise ConfigError(f"fault_tolerance.semi_sync_method {method} with pipeline_parallel_degree > 1 is not supported: "
                          "torchft's LocalSGD and DiLoCo step one model and one optimizer")
    if ft.should_quantize and device != "cuda":
        raise ConfigError("fault_tolerance.should_quantize uses torchft's triton kernels and needs CUDA")
    if method == "local_sgd":
        return ()
    fragments = _fragments(config, meta_model)
    count = max(len(fragments), 1)
    if ft.sync_steps % count:
        raise ConfigError(f"fault_tolerance.sync_steps {ft.sync_steps} must be a multiple of the {count} DiLoCo "
                          "fragments: they sync in turn, one every sync_steps / fragments steps")
    if ft.fragment_sync_delay >= ft.sync_steps // count:
        raise ConfigError(f"fault_tolerance.fragment_sync_delay {ft.fragment_sync_delay} must be below sync_steps / "
                          f"fragments = {ft.sync_steps // count}: a fragment's average must land before its next one")
    return fragments


def _fragments(config: JobConfig, meta_model: Callable[[], torch.nn.Module]) -> tuple[tuple[str, ...], ...]:
    """module_fqns_per_model_fragment, else num_fragments cut as pipeline stages are (the
    embedding and the output weigh a block each, torchtitan's fragment_llm)."""
    ft = config.fault_tolerance
    explicit = ft.module_fqns_per_model_fragment
    if explicit and ft.num_fragments not in (1, len(explicit)):
        raise ConfigError(f"fault_tolerance.num_fragments {ft.num_fragments} differs from the "
                          f"{len(explicit)} fragments module_fqns_per_model_fragment names")
    if not explicit and ft.num_fragments == 1:
        return ()
    model = meta_model()
    inputs, n_layers, outputs = pp.model_parts_names(model)
    names = dict(inputs=inputs, outputs=outputs)
    try:
        if explicit:
            pp.check_split(explicit, n_layers, **names)
            parts = explicit
        else:
            parts = pp.even_split(ft.num_fragments, n_layers, **names)
    except ValueError as e:
        message = str(e).replace("module_fqns_per_model_part", "fault_tolerance.module_fqns_per_model_fragment")
        raise ConfigError(message.replace("pipeline stages", "DiLoCo fragments")) from None
    seen: dict[int, str] = {}
    for part in parts:
        for name in part:
            for param in model.get_submodule(name).parameters():
                if id(param) in seen and seen[id(param)] not in part:
                    raise ConfigError(f"DiLoCo fragments: {name} shares its weight with {seen[id(param)]} (tied "
                                      "embeddings); put both in one fragment")
                seen[id(param)] = name
    return tuple(tuple(part) for part in parts)
