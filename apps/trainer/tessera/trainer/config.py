"""Job configuration: TOML sections and keys named as torchtitan's TOML-era configs, plus
`--section.key value` command-line overrides. Every mistake becomes one ConfigError line.

Each key is declared once, beside its field (tessera.trainer.schema.key): its help line, allowed
values, bound, torchtitan origin and refusal. validate() checks those declarations, then the rules
that tie keys together. The converters' sections are declared with the converters."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import json
import math
import os
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import tomllib

from tessera.ckpt import ASYNC_MODES, EXPORT_DTYPES
from tessera.data import parse_mixture
from tessera.fsdp import MIXED_PRECISION_DTYPES, RESHARD_POLICIES
from tessera.models import AC_MODES, FORCE_RECOMPUTE_DEFAULT, list_model_specs
from tessera.models.moe import CAPACITY_OVERFLOW
from tessera.trainer.converters import converter_sections, registered_converters
from tessera.trainer.errors import ConfigError, user_input
from tessera.trainer.faults import FAULT_KINDS
from tessera.trainer.float8_converter import (  # importing it registers the float8 converters
    LINEAR_FLOAT8, Float8, Quantize, float8_reads_linear_table)
from tessera.trainer.lr_schedule import DECAY_TYPES
from tessera.trainer.schema import (NEWER_TORCHTITAN, OLDER_TORCHTITAN, TESSERA, check_declared, declared, get_key, key,
                                    table)

# What other modules import from here (ConfigError and user_input live in tessera.trainer.errors).
__all__ = ["CHOICES", "ConfigError", "JobConfig", "get_key", "load_config", "note", "parse_overrides", "to_dict",
           "user_directory", "user_input", "validate"]

# Why keys are refused, where several share a reason.
_FIXED_SCHEMA = "Tessera's config schema is fixed; register models and converters with experimental.custom_import"
_ESTIMATE = "the trainer trains; for a dry run use `bazel run //tools/estimate -- --job.config_file ...`"
# torchtitan 0.2.2's fault-tolerance extension (its llama3_ft config names it as job.custom_config_module):
# its keys are [fault_tolerance]'s here
_FT_CONFIG_MODULE = "torchtitan.components.ft.config"


@dataclasses.dataclass
class Job:
    config_file: str = key("", "TOML file read before the command-line overrides", path=True)
    dump_folder: str = key("./outputs", "folder of the run's outputs: checkpoints, TensorBoard events, traces", path=True)
    description: str = key("Tessera training job", "free text, printed in the start-up banner")
    print_config: bool = key(False, "print the merged config as JSON at start")
    print_args: bool = key(False, "torchtitan 0.1's name of print_config", origin=OLDER_TORCHTITAN)
    save_config_file: str | None = key(None, "write the merged config as JSON to this file under dump_folder")
    custom_config_module: str = key(
        "", f"a module extending the config schema; {_FT_CONFIG_MODULE}: built in", refused=_FIXED_SCHEMA)
    stop_grace_seconds: int = key(
        120, "after SIGTERM/SIGUSR1 the ranks finish the step and save; past this many seconds they exit anyway",
        bound=">= 1", origin=TESSERA)


@dataclasses.dataclass
class Model:
    name: str = key("llama3", "model family: a registered model spec (llama2, llama3, ...); torchtitan's llama3_ft reads as "
                    "llama3 (fault tolerance's fragments apply to every model)")
    flavor: str = key(
        "debugmodel", "size of the family, e.g. debugmodel, 8B, 70B, 405B; from_hf_config: model.hf_assets_path's config.json")
    tokenizer_path: str = key(
        "", "a tokenizer.model or tokenizer.json file, or a folder holding one; \"\": hf_assets_path's, else the embedded BPE",
        path=True)
    hf_assets_path: str = key(
        "", "a Hugging Face model folder: its tokenizer.json (+ tokenizer_config.json), config.json and weights", path=True)
    converters: list[str] = key(
        [], "module converters applied after building: float8, quantize.linear.float8, quantize.linear.mx")
    print_after_conversion: bool = key(False, "print the model after its converters ran")
    attn_mask_type: str = key(
        "causal", "causal, or block_causal: attention stays within each document packed into a window",
        choices=("causal", "block_causal"), origin=TESSERA)


@dataclasses.dataclass
class Optimizer:
    name: str = key("AdamW", "AdamW; Adam (torch's: weight decay added to the gradient, as torchtitan's); or Muon: "
                    "Muon for hidden matrices, AdamW for the rest (optimizer.muon_exclude)",
                    choices=("AdamW", "Adam", "Muon"))
    lr: float = key(8e-4, "peak learning rate", bound=">= 0")
    beta1: float = key(0.9, "AdamW beta1")
    beta2: float = key(0.95, "AdamW beta2")
    eps: float = key(1e-8, "AdamW epsilon", bound=">= 0")
    weight_decay: float = key(0.1, "AdamW decoupled weight decay", bound=">= 0")
    # fused (torchtitan's default too) is the fastest on CPU and CUDA and skips a non-finite step
    # on the device (tessera.trainer.step)
    implementation: str = key(
        "fused", "AdamW kernel: foreach, fused (one kernel per parameter group) or for-loop; Muon steps one matrix at "
        "a time (torch has no foreach or fused Muon)",
        choices=("foreach", "fused", "for-loop"))
    state_dtype: str = key(
        "float32", "dtype of AdamW's moments: float32 (torch's AdamW: the parameters' dtype), or bfloat16 (Tessera's "
        "for-loop AdamW, half the state; needs implementation = 'for-loop')", choices=("float32", "bfloat16"),
        origin=TESSERA)
    early_step_in_backward: bool = key(
        False, "step each parameter's optimizer as soon as its gradient is ready",
        refused="not supported: stepping inside backward would skip gradient clipping and the non-finite-step check")
    # Parameter groups and Muon: Tessera's keys (torchtitan 0.2.2 has one group and AdamW only)
    param_groups: list[list[str]] = key(
        [], "groups, first match wins: each selectors and settings, e.g. [\"norms\", \"biases\", \"weight_decay=0\"], "
        "[\"output\", \"lr_scale=0.5\"]; selectors: norms, biases, embeddings, output, experts, router, or name "
        "patterns ('*' wildcards)", origin=TESSERA)
    muon_exclude: list[str] = key(
        ["embeddings", "output"], "under Muon, matrices that AdamW steps instead (1-D parameters always are): selectors "
        "as in param_groups", origin=TESSERA)
    muon_momentum: float = key(0.95, "Muon momentum", bound=">= 0", origin=TESSERA)
    muon_nesterov: bool = key(True, "Muon with Nesterov momentum", origin=TESSERA)
    muon_ns_steps: int = key(5, "Newton-Schulz iterations of each Muon update", bound=">= 1", origin=TESSERA)
    # match_rms_adamw (Moonshot's rule) lets Muon share AdamW's lr and weight decay, as one [optimizer] lr implies
    muon_adjust_lr: str = key(
        "match_rms_adamw", "Muon's per-matrix lr: match_rms_adamw (0.2 sqrt(max(m, n)), AdamW's lr carries over) or "
        "original (sqrt(max(1, m / n)))", choices=("match_rms_adamw", "original"), origin=TESSERA)
    muon_ns_dtype: str = key("bfloat16", "dtype of Muon's Newton-Schulz iteration", choices=("bfloat16", "float32"),
                             origin=TESSERA)


@dataclasses.dataclass
class LRScheduler:
    warmup_steps: int = key(10, "steps of linear warm-up: step s of them uses lr * s / warmup_steps", bound=">= 0")
    total_steps: int | None = key(None, "length of the schedule; unset: training.steps", bound=">= 1")
    decay_ratio: float | None = key(
        None, "fraction of all steps that decays at the end; unset: every step after warm-up", bound="within [0, 1]")
    decay_type: str = key("linear", "shape of the decay: linear, sqrt or cosine", choices=DECAY_TYPES)
    min_lr_factor: float = key(0.0, "the decay ends at lr * min_lr_factor", bound="within [0, 1]")


@dataclasses.dataclass
class DataLoader:
    """[training.dataloader], torchtitan's keys. Batches are prepared by one background thread
    rather than worker processes (the loader is cheap; its state stays one global position):
    num_workers > 0 turns it on, num_workers * prefetch_factor batches ahead."""

    # torchtitan defaults to 0; prefetching keeps the step from waiting
    num_workers: int = key(1, "> 0: a background thread prepares batches ahead", bound=">= 0")
    prefetch_factor: int | None = key(None, "batches ahead per worker (default 2)", bound=">= 1")
    pin_memory: bool = key(False, "on CUDA, batches in pinned host memory for asynchronous copies")
    persistent_workers: bool = key(False, "keep workers between epochs",
                                   inert="Tessera's one prefetch thread lives for the whole run")


@dataclasses.dataclass
class Training:
    dataset: str = key("default", "default (the embedded corpus), c4_test / c4_validation (./tests/assets/<name>), or a path")
    dataset_path: str = key(
        "", "a text, JSON-lines (.jsonl/.json[.gz]) or Parquet file, a folder of them, a Hugging Face datasets folder "
        "(save_to_disk), or a folder of token shards (tools/pretokenize)", path=True)
    dataset_text_field: str = key("text", "the field of each JSON record, or the Parquet or Arrow column, holding its text",
                                  origin=TESSERA)
    # mixed in proportions seeded by debug.seed; the paths resolve as dataset_path
    dataset_mixture: list[str] = key(
        [], "[\"path=weight\", ...]: datasets mixed in these proportions, replacing dataset and dataset_path",
        origin=TESSERA)
    shuffle: bool = key(True, "documents in a seeded (debug.seed) order per epoch, not file order", origin=TESSERA)
    shuffle_buffer: int = key(
        8192, "token shards: documents are permuted within groups of this many", bound=">= 1", origin=TESSERA)
    dataloader: DataLoader = table(DataLoader)
    # Defaults train the debug model on CPU in minutes; the shipped TOMLs set real-run values.
    local_batch_size: int = key(
        8, "sequences per data-parallel rank per optimizer step (before accumulation splits it)", bound=">= 1")
    global_batch_size: int = key(
        -1, "sequences per optimizer step over all ranks; -1: local_batch_size * data-parallel degree")
    seq_len: int = key(256, "tokens per sequence", bound=">= 1")
    max_norm: float = key(1.0, "clip the global gradient norm to this", bound="> 0")
    loss_chunk_size: int = key(
        0, "tokens per chunk of a loss that projects to the vocabulary and takes the cross-entropy chunk by chunk, "
        "never holding a micro-batch's whole logits; 0: off", bound=">= 0", origin=TESSERA)
    steps: int = key(100, "optimizer steps to train", bound=">= 1")
    # unset: torchtitan's bfloat16 on CUDA; float32 on a CPU, where without AVX-512 BF16 (e.g.
    # AVX2-only CPUs) bf16 matmuls are emulated, measured 20x slower (the job plan resolves it)
    mixed_precision_param: str | None = key(
        None, "dtype of parameters in compute (FSDP all-gathers / autocast): float32 or bfloat16; unset: bfloat16 "
        "on CUDA, float32 on a CPU", choices=tuple(MIXED_PRECISION_DTYPES))
    mixed_precision_reduce: str = key(
        "float32", "dtype of the gradient reduction: float32 or bfloat16", choices=tuple(MIXED_PRECISION_DTYPES))
    dtype: str = key(
        "float32", "dtype the parameters are stored in: bfloat16 keeps weights, gradients and optimizer state in bf16",
        choices=("float32", "bfloat16"))
    enable_cpu_offload: bool = key(False, "FSDP keeps parameters, gradients and optimizer state in host memory")
    gc_freq: int = key(50, "run Python's garbage collector every this many steps, on every rank at once", bound=">= 1")
    gc_debug: bool = key(False, "collect every step and report what the collector found (reference cycles)")
    max_skipped_steps: int = key(
        3, "optimizer steps skipped for a non-finite gradient norm before the run stops", bound=">= 0", origin=TESSERA)


@dataclasses.dataclass
class Loss:
    """[loss], torchtitan main's (after 0.2.2): the weight of DeepSeek-V3's multi-token prediction."""

    mtp_scale: float = key(
        0.3, "weight of the multi-token-prediction loss (the mean over its depths) added to the next-token loss; "
        "models with MTP modules only", bound=">= 0", origin=NEWER_TORCHTITAN)


@dataclasses.dataclass
class Parallelism:
    data_parallel_replicate_degree: int = key(1, "DDP / HSDP replicas")
    data_parallel_shard_degree: int = key(-1, "FSDP shards; -1: the ranks left over by the other degrees")
    fsdp_reshard_after_forward: str = key(
        "default", "default, always or never: free gathered parameters after forward", choices=RESHARD_POLICIES)
    fsdp_reduce_every_microbatch: bool = key(
        False, "under accumulation, reduce-scatter every micro-batch (torchtitan's way: sharded gradients only) "
        "instead of once after the last (less traffic, whole gradients held)", origin=TESSERA)
    tensor_parallel_degree: int = key(1, "tensor + sequence parallel ranks")
    disable_loss_parallel: bool = key(False, "gather the vocabulary-sharded logits before the loss under tensor parallel")
    enable_async_tensor_parallel: bool = key(
        False, "overlap tensor-parallel communication with matmuls (CUDA + compile)")
    context_parallel_degree: int = key(1, "ranks sharing each sequence", bound=">= 1")
    context_parallel_rotate_method: str = key(
        "allgather", "how torch's ring attention moves keys and values: allgather (once per layer) or alltoall "
        "(rank to rank)", choices=("allgather", "alltoall"))
    context_parallel_load_balancer: str | None = key(
        "headtail", "headtail (each rank holds chunks i and 2cp-1-i) or none", choices=("headtail", None))
    pipeline_parallel_degree: int = key(1, "pipeline stages' ranks", bound=">= 1")
    pipeline_parallel_schedule: str = key(  # checked by tessera.pp, case-insensitive
        "1F1B", "1F1B, GPipe, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV")
    pipeline_parallel_schedule_csv: str = key(
        "", "a file of actions per rank, overriding the schedule's order", path=True)
    pipeline_parallel_microbatch_size: int = key(1, "sequences per pipeline micro-batch", bound=">= 1")
    pipeline_parallel_layers_per_stage: int | None = key(None, "blocks per stage; unset: even over the stages")
    pipeline_parallel_first_stage_less_layers: int = key(1, "the embedding weighs as this many blocks")
    pipeline_parallel_last_stage_less_layers: int = key(1, "the final norm and output weigh as this many blocks")
    module_fqns_per_model_part: list[list[str]] | None = key(None, "explicit stages: the module names of each")
    pipeline_parallel_expert_parallel_overlap: bool = key(
        True, "under DualPipeV, overlap the expert-parallel all-to-all with compute",
        inert="Tessera runs the all-to-all in line either way, with the same numbers")
    expert_parallel_degree: int = key(1, "ranks sharing the experts of each MoE layer")
    expert_tensor_parallel_degree: int = key(
        1, "tensor_parallel_degree: experts split over tp and ep; 1: the tp ranks join ep; no effect without ep")
    expert_parallel_comm_backend: str = key(
        "standard", "all-to-all implementation: standard",
        refused="only 'standard' (all_to_all_single): DeepEP is not part of Tessera")
    # GShard's / Megatron's drop-and-pad (Megatron: moe_expert_capacity_factor); torchtitan has no such key
    expert_capacity_factor: float | None = key(
        None, "unset: dropless MoE dispatch (exact; under expert parallel one host read per MoE layer); a number: "
        "each expert takes at most ceil(factor x slots / experts) of a layer's routed slots on each rank, static "
        "shapes with no host read (compiles whole), the rest per expert_capacity_overflow", bound="> 0", origin=TESSERA)
    expert_capacity_overflow: str = key(
        "drop", "slots over capacity: drop (lowest routing weights first) or reroute (once, to the token's next "
        "best expert with room)", choices=CAPACITY_OVERFLOW, origin=TESSERA)


@dataclasses.dataclass
class Checkpoint:
    enable: bool = key(False, "save and resume checkpoints")
    # folder, keep_latest_k and export_dtype act on a seed checkpoint too: no `needs`
    folder: str = key("checkpoint", "under job.dump_folder")
    interval: int = key(500, "save every this many steps", bound=">= 1", needs="checkpoint.enable")
    async_mode: str = key(
        "disabled", "disabled, async or async_with_pinned_mem: write in the background", choices=ASYNC_MODES)
    keep_latest_k: int = key(10, "keep this many newest checkpoints; 0: all", bound=">= 0")
    load_step: int = key(-1, "resume from this step; -1: the newest")
    exclude_from_loading: list[str] = key(
        [], "state left out when resuming: model, optimizer, lr_scheduler, dataloader, train_state, rng (per-rank "
        "random state), replicas (fault tolerance's semi-sync state)",
        choices=("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng", "replicas"))
    last_save_model_only: bool = key(True, "beside the final full checkpoint, also export the model alone",
                                     needs="checkpoint.enable")
    export_dtype: str = key(
        "float32", "dtype of model-only and HF exports: float32, bfloat16 or float16", choices=tuple(EXPORT_DTYPES))
    initial_load_path: str = key("", "a checkpoint to start from when the run has none of its own", path=True)
    initial_load_model_only: bool = key(True, "the initial checkpoint holds the model only")
    initial_load_in_hf: bool = key(
        False, "the initial checkpoint is a Hugging Face folder (initial_load_path, else hf_assets_path)")
    last_save_in_hf: bool = key(False, "export the final model as Hugging Face safetensors + config.json")
    create_seed_checkpoint: bool = key(False, "save the initial weights as step 0 and exit")
    enable_first_step_checkpoint: bool = key(False, "also save after step 1")
    load_only: bool = key(False, "resume from checkpoints but never save")
    initial_load_in_hf_quantized: bool = key(
        False, "the initial HF checkpoint holds quantized weights, dequantised on load (GPT-OSS's MXFP4 experts)")
    enable_ft_dataloader_checkpoints: bool = key(
        True, "with fault_tolerance.enable: each replica group records its data loader's position after every step "
        "(under folder/ft-replica-<id>), so a restarted group neither repeats nor skips its data",
        needs="fault_tolerance.enable")


@dataclasses.dataclass
class ActivationCheckpoint:
    mode: str = key(
        "none", "none, selective, full or memory_budget (compile's partitioner chooses, within memory_budget): "
        "recompute activations in backward instead of storing them; or offload (Tessera: keep them in host memory, "
        "copied back for backward)", choices=AC_MODES)
    selective_ac_option: str = key(  # checked in validate(): "op" or an int
        "op", "op (torchtitan's policy: keep attention's and every second matmul's outputs, recompute the rest) "
        "or N (checkpoint every N-th block; 0, as in torchtitan: every block)")
    preserve_rng_state: bool = key(True, "recompute with the forward's RNG state (dropout-exact)")
    early_stop: bool = key(False, "stop recomputing once the needed activations exist")
    determinism_check: str = key(
        "default", "default (compare recomputed tensor metadata) or none", choices=("default", "none"))
    debug: bool = key(False, "record the recomputed ops for debugging a mismatch")
    memory_budget: float = key(
        0.5, "with mode memory_budget: the compiled blocks' activation memory kept, from 0 (recompute all the "
        "partitioner may) to 1 (its default choice)", bound="within [0, 1]")
    visualize_memory_budget_pareto: bool = key(
        False, "with mode memory_budget: plot each graph's memory/recompute Pareto front (SVG) under "
        "dump_folder/memory_budget_pareto")
    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = key(
        list(FORCE_RECOMPUTE_DEFAULT), "selective AC op recomputes the matmuls of linears whose names contain these "
        "(their shapes: the MoE router's by default)")


@dataclasses.dataclass
class Compile:
    enable: bool = key(False, "torch.compile each block and the loss")
    components: list[str] = key(["model", "loss"], "what to compile: model, loss", choices=("model", "loss"),
                                needs="compile.enable")
    backend: str = key("inductor", "torch.compile backend", needs="compile.enable")


@dataclasses.dataclass
class Metrics:
    log_freq: int = key(10, "log loss, grad norm, throughput and memory every this many steps", bound=">= 1")
    enable_tensorboard: bool = key(
        False, "write TensorBoard events under dump_folder/save_tb_folder/<run start time> "
        "(/replica_<id> under fault tolerance)")
    save_tb_folder: str = key("tb", "under job.dump_folder; the W&B run's files too")
    disable_color_printing: bool = key(
        False, "no colour in the console log (colour is used only on a terminal, never with NO_COLOR)")
    rank_0_only: bool = key(True, "torchtitan 0.1's key: false = save_for_all_ranks", origin=OLDER_TORCHTITAN)
    save_for_all_ranks: bool = key(False, "every rank logs and writes its own TensorBoard events and W&B run, not rank 0 alone")
    enable_wandb: bool = key(
        False, "log the same scalars to Weights & Biases, offline unless WANDB_MODE or a W&B login says "
        "otherwise (pip install wandb)")
    # A causal mask leaves half the score matrix to compute (flash kernels skip it); false is PaLM's
    # and torchtitan's convention (mask ignored), so MFU figures compare with theirs.
    causal_attention_flops: bool = key(
        False, "MFU counts causal attention at half the full-sequence FLOPs (torchtitan: false)", origin=TESSERA)


@dataclasses.dataclass
class Profiling:
    enable_profiling: bool = key(False, "trace steps with torch.profiler")
    save_traces_folder: str = key("profile_traces", "under job.dump_folder: iteration_<step>/rank<r>_trace.json",
                                  needs="profiling.enable_profiling")
    profile_freq: int = key(10, "one trace every this many steps", bound=">= 1")
    enable_memory_snapshot: bool = key(
        False, "CUDA: record allocations and dump a snapshot every profile_freq steps and when a step runs out "
        "of memory")
    save_memory_snapshot_folder: str = key(
        "memory_snapshot", "under job.dump_folder: iteration_<step>[_exit]/rank<r>_memory_snapshot.pickle",
        needs="profiling.enable_memory_snapshot")
    profiler_active: int = key(1, "steps recorded in each trace", bound=">= 1", needs="profiling.enable_profiling")
    profiler_warmup: int = key(3, "steps run under the profiler, unrecorded, before each trace", bound=">= 0",
                               needs="profiling.enable_profiling")


@dataclasses.dataclass
class Comm:
    init_timeout_seconds: int = key(
        300, "timeout of process-group start-up and the first step's collectives", bound=">= 1")
    train_timeout_seconds: int = key(
        100, "timeout of every collective after the first step: a stuck rank becomes an error", bound=">= 1")
    trace_buf_size: int = key(
        20000, "NCCL flight-recorder entries per rank, dumped when a collective times out", bound=">= 0")
    save_traces_folder: str = key("comm_traces", "under job.dump_folder: where the flight recorder dumps")
    save_traces_file_prefix: str = key("rank_", "file name prefix of those dumps")
    mode: str = key(
        "default", "default; fake_backend / local_tensor: a dry run without real communication",
        choices=("default", "fake_backend", "local_tensor"), refused=_ESTIMATE)


@dataclasses.dataclass
class MemoryEstimation:
    enable: bool = key(False, "estimate memory instead of training", refused=_ESTIMATE)
    disable_fake_mode: bool = key(False, "estimate with real tensors", refused=_ESTIMATE)


@dataclasses.dataclass
class FaultTolerance:
    """torchft (torchtitan 0.2.2's [fault_tolerance], the semi-sync keys from its FT extension's
    config): replica groups that train on while one of them fails and restarts (see
    tessera.trainer.fault_tolerance)."""

    enable: bool = key(
        False, "torchft replica groups: each an FSDP/TP/PP job of its own, gradients averaged across the groups "
        "by torchft; a failed group restarts and recovers live from a healthy one (launch with --nproc, or a "
        "Lighthouse in TORCHFT_LIGHTHOUSE)")
    process_group: str = key("gloo", "backend of the replica groups' process group: gloo or nccl",
                             choices=("gloo", "nccl"))
    process_group_timeout_ms: int = key(
        10000, "the replica groups' collectives time out after this many ms (a lost group ends the step, which is retried)",
        bound=">= 1")
    replica_id: int = key(0, "this replica group's id, 0 to group_size - 1 (the launcher sets it)", bound=">= 0")
    group_size: int = key(0, "the number of replica groups (their data shares); --nproc N starts N / group_size ranks "
                             "per group", bound=">= 0")
    min_replica_size: int = key(1, "groups that must take part for a step (or sync) to count", bound=">= 1")
    semi_sync_method: str | None = key(
        None, "none (average gradients every step), local_sgd (average weights every sync_steps) or diloco "
        "(outer Nesterov SGD on the averaged weight deltas, per fragment)", choices=(None, "local_sgd", "diloco"))
    sync_steps: int = key(5, "semi-sync: inner steps between synchronisations", bound=">= 1")
    should_quantize: bool = key(False, "semi-sync: quantize the averaged tensors (torchft's triton kernels, CUDA)")
    fragment_sync_delay: int = key(
        0, "diloco: inner steps between starting a fragment's average and applying it (Streaming DiLoCo's tau)",
        bound=">= 0")
    fragment_update_alpha: float = key(
        0.0, "diloco: weights after a sync = lerp(global, local, alpha); 0 keeps the global ones", bound="within [0, 1]")
    module_fqns_per_model_fragment: list[list[str]] = key(
        [], "diloco: the module names of each fragment (on the command line: fragments split by ';', names by ',')")
    num_fragments: int = key(
        1, "diloco: fragments the model is cut into (like pipeline stages), synced in turn", bound=">= 1")


@dataclasses.dataclass
class ValidationDataLoader:
    num_workers: int = key(0, "> 0: a background thread prepares validation batches ahead", bound=">= 0")
    prefetch_factor: int | None = key(None, "batches ahead per worker (default 2)", bound=">= 1")
    pin_memory: bool = key(False, "on CUDA, batches in pinned host memory")
    persistent_workers: bool = key(False, "keep workers between validations",
                                   inert="one prefetch thread per validation, started and stopped with it")


@dataclasses.dataclass
class Validation:
    enable: bool = key(False, "evaluate the loss on held-out data every freq steps")
    dataset: str = key("default", "default: documents held out of the training data; c4_validation or a path")
    dataset_path: str = key("", "as training.dataset_path", path=True)
    freq: int = key(500, "validate every this many steps", bound=">= 1")
    steps: int = key(  # checked in validate()
        10, "batches per validation, a smaller set read again from its start; -1: the whole set once")
    local_batch_size: int | None = key(
        None, "sequences per rank per validation batch; unset: training.local_batch_size", bound=">= 1")
    seq_len: int | None = key(None, "tokens per validation sequence; unset: training.seq_len", bound=">= 1")
    dataloader: ValidationDataLoader = table(ValidationDataLoader)


@dataclasses.dataclass
class Experimental:
    """Where configs before torchtitan 0.1 put pipeline parallelism; read as the [parallelism]
    keys with a deprecation warning."""

    pipeline_parallel_degree: int = key(
        1, "pre-0.1 name of parallelism.pipeline_parallel_degree", origin=OLDER_TORCHTITAN)
    pipeline_parallel_schedule: str = key(
        "", "pre-0.1 name of parallelism.pipeline_parallel_schedule", origin=OLDER_TORCHTITAN)
    pipeline_parallel_schedule_csv: str = key(
        "", "pre-0.1 name of parallelism.pipeline_parallel_schedule_csv", path=True, origin=OLDER_TORCHTITAN)
    pipeline_parallel_microbatches: int | None = key(
        None, "pre-0.1: micro-batches per local batch", origin=OLDER_TORCHTITAN)
    pipeline_parallel_split_points: list[str] = key(
        [], "pre-0.1: the first module of stages 1..", origin=OLDER_TORCHTITAN)
    custom_import: str = key(
        "", "a Python module imported before anything is built: it may register model specs and converters")
    custom_args_module: str = key("", "a module adding config sections", refused=_FIXED_SCHEMA)


@dataclasses.dataclass
class Debug:
    seed: int = key(0, "seed of weights, data order and dropout")
    deterministic: bool = key(False, "deterministic kernels only, TF32 off")
    deterministic_warn_only: bool = key(
        False, "with deterministic: an op without a deterministic kernel warns instead of failing",
        needs="debug.deterministic")
    moe_force_load_balance: bool = key(False, "route MoE tokens round-robin, for load-balanced benchmarks")
    # The injected fault, to test recovery: rank fault_rank crashes (exits at once, as if killed)
    # or stalls (stops answering for twice comm.train_timeout_seconds); on a launcher's first
    # attempt only, so an elastic restart runs clean.
    fault_at_step: int = key(
        0, "inject a fault before this step (0: never), on the first attempt only: tests recovery", bound=">= 0",
        origin=TESSERA)
    fault_rank: int = key(
        0, "the rank that fails (with fault tolerance counted across the replica groups: group g's rank r is "
        "g x ranks per group + r)", bound=">= 0", origin=TESSERA)
    fault_kind: str = key(
        "crash", "crash (exit at once, as if killed) or stall (stop answering)", choices=FAULT_KINDS, origin=TESSERA)


@dataclasses.dataclass
class JobConfig:
    job: Job = table(Job)
    model: Model = table(Model)
    optimizer: Optimizer = table(Optimizer)
    lr_scheduler: LRScheduler = table(LRScheduler)
    training: Training = table(Training)
    loss: Loss = table(Loss)
    parallelism: Parallelism = table(Parallelism)
    checkpoint: Checkpoint = table(Checkpoint)
    activation_checkpoint: ActivationCheckpoint = table(ActivationCheckpoint)
    compile: Compile = table(Compile)
    # torchtitan 0.1's section: the keys of [quantize.linear.float8] under their older name
    float8: Float8 = table(Float8, help="torchtitan 0.1's section of quantize.linear.float8", origin=OLDER_TORCHTITAN)
    quantize: Quantize = table(Quantize)
    metrics: Metrics = table(Metrics)
    profiling: Profiling = table(Profiling)
    comm: Comm = table(Comm)
    memory_estimation: MemoryEstimation = table(MemoryEstimation)
    fault_tolerance: FaultTolerance = table(FaultTolerance)
    validation: Validation = table(Validation, needs="validation.enable")
    experimental: Experimental = table(Experimental)
    debug: Debug = table(Debug)


# (section, key) -> allowed values, as tests/test_plan.py reads them; the declarations above own them.
CHOICES = {tuple(name.split(".", 1)): facts.choices for name, facts in declared(JobConfig).items() if facts.choices}


def user_directory() -> Path:
    """Where the user stands: `bazel run` changes the cwd to the runfiles tree and says where in
    BUILD_WORKING_DIRECTORY."""
    return Path(os.environ.get("BUILD_WORKING_DIRECTORY") or os.getcwd())


def _closest(name: str, options: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def _section_fields(section: str) -> dict[str, dataclasses.Field]:
    sections = {f.name: f for f in dataclasses.fields(JobConfig)}
    if section not in sections:
        raise ConfigError(f"unknown config section [{section}]{_closest(section, sections)}")
    return {f.name: f for f in dataclasses.fields(sections[section].default_factory)}


@functools.lru_cache(maxsize=None)
def _field_type(section: str, key: str) -> typing.Any:
    """The declared type of section.key, where key may name a nested table's key
    ("dataloader.num_workers", "linear.float8.recipe_name"); remembered, since the planner
    loads hundreds of configs."""
    fields, owner, path = _section_fields(section), type(getattr(JobConfig(), section)), section
    *groups, leaf = key.split(".")
    for group in groups:
        if group not in fields or not dataclasses.is_dataclass(fields[group].default_factory):
            raise ConfigError(f"unknown config table [{path}.{group}]{_closest(group, fields)}")
        owner, path = fields[group].default_factory, f"{path}.{group}"
        fields = {f.name: f for f in dataclasses.fields(owner)}
    if leaf not in fields:
        raise ConfigError(f"unknown config key {path}.{leaf}{_closest(leaf, fields)}")
    return typing.get_type_hints(owner)[leaf]


def _is_optional(tp: typing.Any) -> bool:
    """`X | None` (PEP 604) or `typing.Optional[X]`."""
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _type_name(tp: typing.Any) -> str:
    if _is_optional(tp):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None)) + " or none"
    if tp == list[list[str]]:
        return "list of lists of strings"
    if typing.get_origin(tp) is list:
        return "list of strings"
    return {bool: "bool", int: "int", float: "float", str: "string"}[tp]


def _convert(section: str, key: str, value: typing.Any, from_cli: bool) -> typing.Any:
    """Checks (TOML) or parses (CLI string) `value` for the declared type of section.key."""
    tp = _field_type(section, key)
    if dataclasses.is_dataclass(tp):
        raise ConfigError(f"config key {section}.{key} is a table: set its keys, e.g. --{section}.{key}.<key>")
    name = _type_name(tp)
    bad = ConfigError(f"config key {section}.{key}: value {value!r} is not {'an' if name[0] in 'aeiou' else 'a'} {name}")
    if _is_optional(tp):
        if value is None or (from_cli and str(value).lower() in ("none", "null")):
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if tp == list[list[str]]:  # on the command line: lists split by ";", items by ","
        if from_cli:
            return [[item.strip() for item in part.split(",") if item.strip()] for part in value.split(";")]
        if isinstance(value, list) and all(isinstance(v, list) and all(isinstance(i, str) for i in v) for v in value):
            return value
        raise bad
    if typing.get_origin(tp) is list:
        if from_cli:
            return [item.strip() for item in value.split(",") if item.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise bad
    if from_cli:
        if tp is bool:
            lowered = value.lower()
            if lowered in ("true", "1", "yes"):
                return True
            if lowered in ("false", "0", "no"):
                return False
            raise bad
        try:
            value = tp(value)
        except ValueError:
            raise bad from None
    elif tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif type(value) is not tp:
        raise bad
    if tp is float and not math.isfinite(value):  # NaN passes every < / > check after this
        raise ConfigError(f"config key {section}.{key}: {value} is not a finite number")
    return value


def _split_key(dotted: str) -> tuple[str, str]:
    section, sep, key = dotted.partition(".")
    if not sep or not key:
        raise ConfigError(f"config override '--{dotted}' must look like --section.key")
    return section, key


def parse_overrides(argv: list[str]) -> list[tuple[str, str, str]]:
    """['--training.steps', '10', '--metrics.log_freq=1'] -> [(section, key, raw value), ...].

    torchtitan's command line (tyro) is read too: hyphens for underscores
    (--training.local-batch-size 4), a bool key without a value for true (--checkpoint.enable) and
    its ``no_`` form for false (--checkpoint.no_enable, --checkpoint.no-enable)."""
    overrides = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: options look like --section.key value")
        name, eq, value = arg[2:].partition("=")
        section, key = _split_key(name.replace("-", "_"))
        flag = _bool_flag(section, key)
        alone = i + 1 >= len(argv) or argv[i + 1].startswith("--")
        if flag is not None and flag[0] != key:  # the no_ form
            if eq:
                raise ConfigError(f"option --{name} takes no value: it sets {section}.{flag[0]} false")
            key, value = flag
        elif not eq and flag is not None and alone:
            value = "true"
        elif not eq:
            if alone:
                _field_type(section, key)  # an unknown key is named as such, not as one missing its value
                raise ConfigError(f"option --{name} needs a value" + (f", got the option {argv[i + 1].split('=')[0]}"
                                                                      if i + 1 < len(argv) else ""))
            value = argv[i + 1]
            i += 1
        overrides.append((section, key, value))
        i += 1
    return overrides


def _bool_flag(section: str, key: str) -> tuple[str, str] | None:
    """(key, "true") for a bool key, (the key it negates, "false") for tyro's no_<bool key>,
    else None (another key, or none: _apply names it)."""
    *tables, leaf = key.split(".")
    negated = ".".join([*tables, leaf[3:]]) if leaf.startswith("no_") else None
    for name, value in ((key, "true"), (negated, "false")):
        try:
            if name and _field_type(section, name) in (bool, bool | None):
                return name, value
        except ConfigError:
            pass
    return None


def _set_key(config: JobConfig, dotted: str, value: typing.Any) -> None:
    *tables, leaf = dotted.split(".")  # a key of a nested [section.table...] table
    setattr(get_key(config, ".".join(tables)), leaf, value)


def _apply(config: JobConfig, section: str, key: str, value: typing.Any, from_cli: bool) -> None:
    value = _convert(section, key, value, from_cli)  # validates section and key first
    _set_key(config, f"{section}.{key}", value)


def _keys(entries: dict, prefix: str = "") -> Iterator[tuple[str, typing.Any]]:
    """A TOML section's keys, nested tables flattened to dotted keys."""
    for name, value in entries.items():
        if isinstance(value, dict):
            yield from _keys(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file is a directory: {path}") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text (a binary file?)") from None


def load_config(argv: list[str], accepted: frozenset[str] = frozenset()) -> JobConfig:
    """Defaults, then the TOML file named by --job.config_file, then the other overrides.
    `accepted`: refused keys (schema.Key.refused) that the caller implements, e.g. the
    estimator's comm.mode = "fake_backend"."""
    overrides = parse_overrides(argv)
    config = JobConfig()
    base = user_directory()
    config_file = [v for s, k, v in overrides if (s, k) == ("job", "config_file")]
    if config_file:
        path = base / config_file[-1]
        sections = _read_toml(path)
        if not sections:  # an empty (or comment-only) file: surely not the config meant
            raise ConfigError(f"config file {path} holds no settings")
        try:
            for section, entries in sections.items():
                if not isinstance(entries, dict):
                    raise ConfigError(f"config file {path}: '{section}' must be a [section] table")
                _section_fields(section)
                for name, value in _keys(entries):
                    _apply(config, section, name, value, from_cli=False)
        except ConfigError:
            _refuse_a_model_of_another_stack(path, sections)
            raise
    for section, name, value in overrides:
        _apply(config, section, name, value, from_cli=True)
    for name, facts in declared(JobConfig).items():
        value = get_key(config, name)
        if facts.path and value:
            _set_key(config, name, str(base / os.path.expanduser(value)))
    try:  # checked as written: an entry named in an error is the user's, not its resolved path
        parse_mixture(config.training.dataset_mixture)
    except ValueError as e:
        raise ConfigError(f"config key training.dataset_mixture: {e}") from None
    config.training.dataset_mixture = [  # "path=weight": the paths resolve like dataset_path
        f"{base / os.path.expanduser(path.strip())}={weight}"  # parse_mixture refused an entry without a path
        for entry in config.training.dataset_mixture
        for path, _, weight in [entry.rpartition("=")]
    ]
    _read_experimental(config)
    if config.fault_tolerance.semi_sync_method:  # torchtitan's FT manager matches it case-insensitively
        config.fault_tolerance.semi_sync_method = config.fault_tolerance.semi_sync_method.lower()
    config.model.name = _TORCHTITAN_MODELS.get(config.model.name, config.model.name)
    _custom_import(config.experimental.custom_import)
    validate(config, accepted)
    return config


# torchtitan 0.2.2's model names that are a Tessera family under another name: its llama3_ft is
# llama3 with a fragment function for DiLoCo, which Tessera's fault tolerance applies to any model
_TORCHTITAN_MODELS = {"llama3_ft": "llama3"}


def _refuse_a_model_of_another_stack(path: Path, sections: dict) -> None:
    """A file whose keys do not read may be for a model no one registered here (torchtitan's flux
    and vlm configs carry their own keys): the model, not its first unknown key, is the culprit.
    A file importing its own registrations is left to its key's error."""
    model, experimental = sections.get("model"), sections.get("experimental")
    name = model.get("name") if isinstance(model, dict) else None
    if not isinstance(name, str) or (isinstance(experimental, dict) and experimental.get("custom_import")):
        return
    if _TORCHTITAN_MODELS.get(name, name) not in list_model_specs():
        raise ConfigError(f"config file {path}: unknown model {name!r}; registered: {list_model_specs()}")


def _custom_import(module: str) -> None:
    """experimental.custom_import: a module of the user's (found from where they stand, too)
    imported before anything is checked, so the model specs and converters it registers count."""
    if not module:
        return
    where = str(user_directory())
    if where not in sys.path:
        sys.path.append(where)
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"config key experimental.custom_import: cannot import {module!r} ({e})") from None


def _read_experimental(config: JobConfig) -> None:
    """Older configs' [experimental] pipeline keys become today's [parallelism] ones (split
    points need the model's depth and become stages in the job plan)."""
    old, new, defaults = config.experimental, config.parallelism, Experimental()
    for name in ("pipeline_parallel_degree", "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv"):
        if getattr(old, name) != getattr(defaults, name):
            setattr(new, name, getattr(old, name))
    microbatches = old.pipeline_parallel_microbatches
    if microbatches is not None:
        local = config.training.local_batch_size
        if microbatches < 1 or local % microbatches:
            raise ConfigError(f"config key experimental.pipeline_parallel_microbatches: {microbatches} does not divide "
                              f"training.local_batch_size {local}")
        new.pipeline_parallel_microbatch_size = local // microbatches


def validate(config: JobConfig, accepted: frozenset[str] = frozenset()) -> None:
    """What each key declares (schema.check_declared), then the rules between keys."""
    built_in = config.job.custom_config_module == _FT_CONFIG_MODULE
    check_declared(config, accepted | ({"job.custom_config_module"} if built_in else set()))
    if config.training.global_batch_size == 0:  # torchtitan asserts > 0 once negatives are resolved
        raise ConfigError("config key training.global_batch_size: 0 sequences per step; -1 is local_batch_size x "
                          "the data-parallel degree")
    option = config.activation_checkpoint.selective_ac_option
    if option != "op" and not option.isdigit():
        raise ConfigError(f"config key activation_checkpoint.selective_ac_option: {option!r} is not 'op' or a block count N "
                          "(every N-th block; 0: every block)")
    saved = config.job.save_config_file
    if saved and (Path(saved).is_absolute() or ".." in Path(saved).parts):
        raise ConfigError(f"config key job.save_config_file: {saved!r} must be a file name inside job.dump_folder")
    if config.training.dataset_mixture and (config.training.dataset_path or config.training.dataset != "default"):
        raise ConfigError("config key training.dataset_mixture replaces training.dataset and dataset_path; set one of them")
    for section in ("training", "validation"):
        loader = getattr(config, section).dataloader
        if loader.prefetch_factor is not None and loader.num_workers == 0:
            raise ConfigError(f"config key {section}.dataloader.prefetch_factor: needs num_workers > 0")
    prof = config.profiling
    if prof.enable_profiling and prof.profiler_warmup + prof.profiler_active > prof.profile_freq:
        raise ConfigError(f"config keys profiling.profiler_warmup {prof.profiler_warmup} + profiler_active "
                          f"{prof.profiler_active} exceed profile_freq {prof.profile_freq}: each trace's steps must fit in one period")
    if config.compile.enable and not config.compile.components:
        raise ConfigError("config key compile.components is empty: compile.enable would compile nothing")
    if config.validation.steps < 1 and config.validation.steps != -1:
        raise ConfigError(f"config key validation.steps: {config.validation.steps} must be >= 1 or -1 (the whole set)")
    unknown = [name for name in config.model.converters if name not in registered_converters()]
    if unknown:
        raise ConfigError(f"config key model.converters: {unknown} not registered; available: {registered_converters()}")


def remarks(config: JobConfig) -> list[str]:
    """What a valid config spells the old way or sets to no effect, for the plan's warnings: said once
    the whole plan stands, so that a later error stays the one line a user reads."""
    said = []
    old, defaults = config.experimental, Experimental()
    moved = [f.name for f in dataclasses.fields(old)
             if f.name.startswith("pipeline_parallel_") and getattr(old, f.name) != getattr(defaults, f.name)]
    if moved:
        said.append(f"config keys experimental.{{{', '.join(moved)}}} are deprecated; read as their "
                    "[parallelism] equivalents (microbatches -> pipeline_parallel_microbatch_size, split_points -> "
                    "module_fqns_per_model_part)")
    prof = config.profiling
    if prof.enable_profiling and prof.profile_freq > config.training.steps:  # a shipped config run short
        said.append(f"profiling.profile_freq {prof.profile_freq} exceeds training.steps {config.training.steps}: "
                    "no trace will be written")
    borrowed = "float8" in config.model.converters and float8_reads_linear_table(config)
    if borrowed:
        said.append(f"model.converters 'float8' reads [{LINEAR_FLOAT8}]: [float8] is unset (torchtitan 0.2's converter "
                    f"is {LINEAR_FLOAT8!r})")
    for name, section in converter_sections().items():
        entries = get_key(config, section)
        if entries != type(entries)() and name not in config.model.converters and not (borrowed and name == LINEAR_FLOAT8):
            # torchtitan's configs carry the section whether or not the converter runs
            said.append(f"config section [{section}] has no effect: model.converters does not list {name!r}")
    return said


def idle_options(config: JobConfig, argv: list[str]) -> list[str]:
    """The command line's options that do nothing as the config stands: keys whose switch (schema
    `Key.needs`) is off. A config file may carry such keys (torchtitan's do); typed, a key is an
    intent the run would drop in silence, so the plan warns of it."""
    facts = declared(JobConfig)
    said = {}
    for section, name, _ in parse_overrides(argv):
        switch = facts[f"{section}.{name}"].needs
        if switch and not get_key(config, switch):
            said[f"--{section}.{name} has no effect: {switch} is false"] = None
    return list(said)


def to_dict(config: JobConfig) -> dict:
    return dataclasses.asdict(config)


def show_config(config: JobConfig) -> None:
    """job.print_config prints the resolved config; job.save_config_file writes it into the dump
    folder, whole or not at all (written beside, then renamed)."""
    shown = config.job.print_config or config.job.print_args
    if not (shown or config.job.save_config_file):
        return
    text = json.dumps(to_dict(config), indent=2)
    if shown:
        print(text, flush=True)
    if config.job.save_config_file:
        saved = Path(config.job.dump_folder) / config.job.save_config_file
        saved.parent.mkdir(parents=True, exist_ok=True)
        # one per process: fault tolerance's replica groups (a rank 0 each) write it at once
        partial = saved.with_name(f".{saved.name}.{os.getpid()}.partial")
        partial.write_text(text)
        os.replace(partial, saved)
