"""The frozen parts of a job plan: each one everything its stage of the build or the step needs,
decided once in `make_plan`, so nothing downstream reads the config to decide (tools such as
the estimator and planner read the same values the trainer acts on)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from tessera import tp
from tessera.models import FORCE_RECOMPUTE_DEFAULT, AttentionMask


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    local: int  # sequences per micro-batch on each data-parallel rank
    dp: int  # data-parallel degree: how many different micro-batches run at once
    accumulation: int  # micro-batches per optimizer step
    seq_len: int
    devices_per_batch: int  # tp * cp * pp ranks share one data-parallel rank's tokens

    @property
    def global_size(self) -> int:
        """Sequences per optimizer step, all ranks together."""
        return self.local * self.dp * self.accumulation

    @property
    def global_tokens(self) -> int:
        """Tokens per optimizer step, all ranks together."""
        return self.global_size * self.seq_len

    @property
    def tokens_per_device(self) -> float:
        """Tokens per optimizer step per device, as torchtitan reports throughput."""
        return self.local * self.seq_len * self.accumulation / self.devices_per_batch


@dataclasses.dataclass(frozen=True)
class Precision:
    storage: torch.dtype  # the parameters' own dtype (training.dtype)
    param: torch.dtype  # compute: FSDP's all-gathers, else autocast
    reduce: torch.dtype  # gradient reductions
    autocast: bool  # low-precision compute through autocast; under FSDP its MixedPrecisionPolicy casts instead

    def describe(self) -> str:
        name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
        return f"parameters {name(self.storage)}, compute {name(self.param)}, reduce {name(self.reduce)}"


@dataclasses.dataclass(frozen=True)
class FsdpPlan:
    """FSDP/HSDP's settings (used only where dims.fsdp_enabled)."""

    reshard_after_forward: str  # the policy every part gets: a pipeline's "default" keeps stages gathered
    cpu_offload: bool
    reduce_every_microbatch: bool  # False: accumulation reduce-scatters once, after the last micro-batch


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    styles: Mapping[str, tp.StyleFactory]  # tessera.tp's role styles, with the converters' and experts' overrides
    async_tp: bool  # torch's async TP (CUDA, compiled blocks)


@dataclasses.dataclass(frozen=True)
class ExpertPlan:
    force_load_balance: bool  # route tokens round-robin (benchmarks)
    capacity_factor: float | None = None  # None: dropless; else each expert's capacity, in even shares of the slots
    capacity_overflow: str = "drop"  # what becomes of the slots over capacity: drop or reroute


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """How the model is cut into pipeline stages and how each local batch flows through them."""

    schedule: str  # a tessera.pp schedule name, as spelled there
    schedule_csv: str | None
    parts: tuple[tuple[str, ...], ...]  # module names of each stage, in stage order
    microbatches: int  # pipeline micro-batches per local batch
    reshard_after_forward: str  # the FSDP policy each stage gets
    splits_backward: bool  # input and weight gradients run as separate passes (the schedule's, or the CSV's I/W actions)

    def describe(self) -> str:
        blocks = [sum(name.startswith("layers.") for name in part) for part in self.parts]
        source = f", actions from {self.schedule_csv}" if self.schedule_csv else ""
        return (f"{self.schedule}{source}: {len(self.parts)} stages holding {blocks} blocks, "
                f"{self.microbatches} micro-batches per local batch")


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """The kernel of each kind of layer attention the model declares (``ModelSpec.attention_kinds``)
    and how context parallel reaches the other ranks' keys."""

    documents: bool  # block-causal: attention stays within each packed document
    kernels: tuple[tuple[AttentionMask, bool, str], ...]  # (mask, has sinks, tessera.models kernel)
    cp_exchange: str | None  # "ring" (torch's, plain causal), "gather" (all-gather-KV, any mask), None: no CP
    cp_load_balance: bool = True  # head-tail shards (parallelism.context_parallel_load_balancer)
    cp_rotate_method: str = "allgather"  # how torch's ring moves K/V

    def kernel(self, mask: AttentionMask, sinks: bool) -> str:
        for known, has_sinks, kernel in self.kernels:
            if (known, has_sinks) == (mask, sinks):
                return kernel
        raise ValueError(f"a layer's attention ({mask.describe()}{', sinks' if sinks else ''}) is not among the "
                         f"model spec's attention_kinds {[(m.describe(), s) for m, s, _ in self.kernels]}")

    def describe(self) -> str:
        kinds = "; ".join(f"{mask.describe(self.documents)}{' + sinks' if sinks else ''} -> {kernel}"
                          for mask, sinks, kernel in self.kernels)
        exchange = {None: "", "ring": " | context parallel: torch's ring",
                    "gather": " | context parallel: all-gather-KV"}[self.cp_exchange]
        return kinds + exchange


@dataclasses.dataclass(frozen=True)
class CheckpointingPlan:
    """Activation checkpointing, as tessera.models.apply_activation_checkpointing takes it."""

    mode: str  # none | selective | full | memory_budget | offload
    selective_option: str  # "op" or every N-th block
    preserve_rng_state: bool
    early_stop: bool
    determinism_check: str
    debug: bool
    memory_budget: float | None = None  # mode memory_budget: what compile's partitioner keeps (0-1)
    pareto_dir: str | None = None  # where the partitioner plots its memory/recompute Pareto fronts
    force_recompute_fqns: tuple[str, ...] = FORCE_RECOMPUTE_DEFAULT  # selective "op": linears always recomputed


@dataclasses.dataclass(frozen=True)
class CompilePlan:
    blocks: bool  # torch.compile each block
    backend: str


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """Parameters one optimizer steps with one weight decay and lr (tessera.trainer.param_groups)."""
    label: str  # the optimizer.param_groups entry that chose them, or "default"
    algorithm: str  # adamw | muon
    weight_decay: float
    lr_scale: float  # of the scheduled lr
    # parameter names in the whole model, as its state dict has them; None: every parameter (the
    # one group of a run without optimizer.param_groups or Muon, decided without building the model)
    names: tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class MuonPlan:
    momentum: float
    nesterov: bool
    ns_steps: int
    adjust_lr: str  # tessera.optim.adjusted_lr's rule
    ns_dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class OptimizerPlan:
    name: str
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    implementation: str  # fused | foreach | for-loop
    state_dtype: torch.dtype | None  # AdamW's moments, when not the parameters' (tessera.optim.AdamW)
    max_norm: float  # the global gradient norm is clipped to this before each step
    # the lr schedule (tessera.trainer.lr_schedule.lr_factor's keywords) over total_steps
    total_steps: int
    warmup_steps: int
    decay_ratio: float | None
    decay_type: str
    min_lr_factor: float
    groups: tuple[ParamGroup, ...]  # every parameter in exactly one
    muon: MuonPlan | None  # set when name is Muon

    def describe_groups(self) -> str:
        """The parameter groups, e.g. "norms,weight_decay=0: 17 adamw wd 0 | default: 19 muon, 3 adamw"."""
        if len(self.groups) == 1 and self.groups[0].names is None:
            return f"one group, weight decay {self.weight_decay:g}"
        by_label: dict[str, list[ParamGroup]] = {}
        for group in self.groups:
            by_label.setdefault(group.label, []).append(group)
        return " | ".join(
            f"{label}: " + ", ".join(f"{len(g.names)} {g.algorithm}" for g in groups)
            + f" wd {groups[0].weight_decay:g}" + (f" lr x{groups[0].lr_scale:g}" if groups[0].lr_scale != 1 else "")
            for label, groups in by_label.items())


@dataclasses.dataclass(frozen=True)
class LossPlan:
    parallel: bool  # logits stay split on vocab over the tp ranks (tensor parallel's loss parallel)
    compiled: bool  # never under loss parallel: a compiled loss would see only its vocabulary shard
    scale: float  # each micro-batch's share of the step's mean loss: 1 / accumulation
    chunk_size: int = 0  # tokens per chunk of the chunked loss (tessera.trainer.chunked_loss); 0: whole logits
    # loss.mtp_scale of a model with multi-token prediction, whose forward then takes the labels; None: none
    mtp_scale: float | None = None
