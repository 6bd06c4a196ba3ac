"""Job configuration: TOML sections and keys named as torchtitan's TOML-era configs, plus
`--section.key value` command-line overrides. Every mistake becomes one ConfigError line."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import math
import os
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import tomli

from tessera.ckpt import ASYNC_MODES, EXPORT_DTYPES
from tessera.data import parse_mixture
from tessera.fsdp import MIXED_PRECISION_DTYPES, RESHARD_POLICIES
from tessera.models import AC_MODES
from tessera.trainer import float8_converter  # registers the float8 and MX converters
from tessera.trainer.config_keys import REFUSED
from tessera.trainer.converters import registered_converters
from tessera.trainer.faults import FAULT_KINDS
from tessera.trainer.lr_schedule import DECAY_TYPES


class ConfigError(ValueError):
    """Bad user input — a config file, key or value, or a file it names — that the trainer cannot
    use; the message names it. The command line prints it as one line and exits 2."""


@contextlib.contextmanager
def user_input() -> Iterator[None]:
    """Around reading what the user named (data, checkpoints): the libraries' ValueErrors there
    describe that input, so they become ConfigErrors. Elsewhere a ValueError is a bug and keeps
    its traceback."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from e


@dataclasses.dataclass
class Job:
    config_file: str = ""
    dump_folder: str = "./outputs"
    description: str = "Tessera training job"
    print_config: bool = False
    print_args: bool = False  # torchtitan 0.1's name of print_config
    save_config_file: str | None = None  # under dump_folder: the merged config as JSON
    custom_config_module: str = ""
    # After SIGTERM/SIGUSR1 the ranks finish the step and save; past this many seconds they exit anyway.
    stop_grace_seconds: int = 120


@dataclasses.dataclass
class Model:
    name: str = "llama3"
    flavor: str = "debugmodel"
    tokenizer_path: str = ""  # "" = model.hf_assets_path's tokenizer, else the offline default BPE of tessera.data
    hf_assets_path: str = ""  # a Hugging Face model folder: tokenizer.json (+ tokenizer_config.json), config.json, weights
    converters: list[str] = dataclasses.field(default_factory=list)
    print_after_conversion: bool = False
    attn_mask_type: str = "causal"  # "block_causal": attention stays within each packed document


@dataclasses.dataclass
class Optimizer:
    name: str = "AdamW"
    lr: float = 8e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # fused | foreach | for-loop; fused (torchtitan's default too) is the fastest on CPU and CUDA and
    # skips a non-finite step on the device (tessera.trainer.step)
    implementation: str = "fused"
    early_step_in_backward: bool = False


@dataclasses.dataclass
class LRScheduler:
    warmup_steps: int = 10
    total_steps: int | None = None  # the schedule's length; None: training.steps
    decay_ratio: float | None = None  # the last this fraction of all steps decays; None: every step after warmup
    decay_type: str = "linear"  # linear | sqrt | cosine
    min_lr_factor: float = 0.0


@dataclasses.dataclass
class DataLoader:
    """[training.dataloader], torchtitan's keys. Batches are prepared by one background thread
    rather than worker processes (the loader is cheap; its state stays one global position):
    num_workers > 0 turns it on, num_workers * prefetch_factor batches ahead."""

    num_workers: int = 1  # torchtitan defaults to 0; prefetching keeps the step from waiting
    prefetch_factor: int | None = None  # None: 2 when num_workers > 0
    pin_memory: bool = False
    persistent_workers: bool = False  # the thread lives for the whole run either way


@dataclasses.dataclass
class Training:
    dataset: str = "default"  # "default" = the embedded corpus; else a path (see dataset_path)
    dataset_path: str = ""  # a text source, or a folder of token shards from tools/pretokenize
    dataset_text_field: str = "text"
    # ["path=weight", ...]: datasets mixed in these proportions (seeded by debug.seed); replaces
    # dataset / dataset_path. Paths as dataset_path.
    dataset_mixture: list[str] = dataclasses.field(default_factory=list)
    shuffle: bool = True  # documents in a seeded (debug.seed) order per epoch, not file order
    shuffle_buffer: int = 8192  # token shards: documents are permuted within groups of this many
    dataloader: DataLoader = dataclasses.field(default_factory=DataLoader)
    # Defaults train the debug model on CPU in minutes; the shipped TOMLs set real-run values.
    local_batch_size: int = 8
    global_batch_size: int = -1  # -1: local_batch_size * data-parallel degree (no accumulation)
    seq_len: int = 256
    max_norm: float = 1.0
    steps: int = 100
    # float32 by default: without AVX-512 BF16 (e.g. AVX2-only CPUs) CPU bf16 matmuls are
    # emulated, measured 20x slower here. GPU configs set "bfloat16".
    mixed_precision_param: str = "float32"
    mixed_precision_reduce: str = "float32"
    dtype: str = "float32"  # the parameters' own dtype: "bfloat16" keeps weights, grads and optimizer state in bf16
    enable_cpu_offload: bool = False
    gc_freq: int = 50
    gc_debug: bool = False  # collect every step, reporting what the collector found
    # Optimizer steps skipped for a non-finite gradient norm before the run stops (exit 1).
    max_skipped_steps: int = 3


@dataclasses.dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1
    fsdp_reshard_after_forward: str = "default"  # default | always | never
    # False: accumulation reduce-scatters once, after the last micro-batch (less traffic; FSDP holds
    # the whole gradients in the reduce dtype until then). True: every micro-batch, as torchtitan 0.2
    fsdp_reduce_every_microbatch: bool = False
    tensor_parallel_degree: int = 1
    disable_loss_parallel: bool = False
    enable_async_tensor_parallel: bool = False
    context_parallel_degree: int = 1
    context_parallel_rotate_method: str = "allgather"  # torch's ring: K/V gathered once per layer; alltoall: passed on
    context_parallel_load_balancer: str | None = "headtail"  # None: contiguous shards
    pipeline_parallel_degree: int = 1
    pipeline_parallel_schedule: str = "1F1B"  # one of tessera.pp.SCHEDULES, case-insensitive
    pipeline_parallel_schedule_csv: str = ""  # a file of actions per rank; overrides the schedule's order
    pipeline_parallel_microbatch_size: int = 1  # sequences per pipeline micro-batch
    pipeline_parallel_layers_per_stage: int | None = None  # None: pp stages (2 per rank when looped)
    pipeline_parallel_first_stage_less_layers: int = 1  # the embedding weighs as this many blocks
    pipeline_parallel_last_stage_less_layers: int = 1  # norm + output weigh as this many blocks
    module_fqns_per_model_part: list[list[str]] | None = None  # explicit stages: module names each
    pipeline_parallel_expert_parallel_overlap: bool = True
    expert_parallel_degree: int = 1
    expert_tensor_parallel_degree: int = 1
    expert_parallel_comm_backend: str = "standard"


@dataclasses.dataclass
class Checkpoint:
    enable: bool = False
    folder: str = "checkpoint"  # under job.dump_folder
    interval: int = 500
    async_mode: str = "disabled"  # disabled | async | async_with_pinned_mem
    keep_latest_k: int = 10
    load_step: int = -1
    exclude_from_loading: list[str] = dataclasses.field(default_factory=list)
    last_save_model_only: bool = True
    export_dtype: str = "float32"
    initial_load_path: str = ""
    initial_load_model_only: bool = True
    initial_load_in_hf: bool = False
    last_save_in_hf: bool = False
    create_seed_checkpoint: bool = False
    enable_first_step_checkpoint: bool = False
    load_only: bool = False  # load at start, never save
    initial_load_in_hf_quantized: bool = False
    enable_ft_dataloader_checkpoints: bool = True


@dataclasses.dataclass
class ActivationCheckpoint:
    mode: str = "none"  # none | full | selective
    selective_ac_option: str = "op"  # "op" (save matmuls) or an int N (checkpoint every N-th block)
    preserve_rng_state: bool = True
    early_stop: bool = False
    determinism_check: str = "default"
    debug: bool = False
    memory_budget: float = 0.5
    visualize_memory_budget_pareto: bool = False
    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = dataclasses.field(default_factory=lambda: ["moe.router.gate"])


@dataclasses.dataclass
class Compile:
    enable: bool = False
    components: list[str] = dataclasses.field(default_factory=lambda: ["model", "loss"])
    backend: str = "inductor"


@dataclasses.dataclass
class Float8:
    enable_fsdp_float8_all_gather: bool = False
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    recipe_name: str | None = None  # None = tensorwise; rowwise | rowwise_with_gw_hp
    # linears left in high precision (name contains one); "auto_filter_small_kn": also small ones
    filter_fqns: list[str] = dataclasses.field(default_factory=list)
    emulate: bool = False


@dataclasses.dataclass
class MX:
    """[quantize.linear.mx]: MXFP8 linears through torchao (tessera.float8.MX_RECIPES)."""

    recipe_name: str = "mxfp8_rceil"
    filter_fqns: list[str] = dataclasses.field(default_factory=lambda: ["output"])
    mxfp8_dim1_cast_kernel_choice: str = "triton"


@dataclasses.dataclass
class QuantizedLinear:
    float8: Float8 = dataclasses.field(default_factory=Float8)  # torchtitan 0.2's home of the [float8] keys
    mx: MX = dataclasses.field(default_factory=MX)


@dataclasses.dataclass
class GroupedMMFloat8:
    fqns: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class GroupedMMMX:
    recipe_name: str = "mxfp8"
    fqns: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class QuantizedGroupedMM:
    """[quantize.grouped_mm.*]: low-precision expert GEMMs of MoE models."""

    float8: GroupedMMFloat8 = dataclasses.field(default_factory=GroupedMMFloat8)
    mx: GroupedMMMX = dataclasses.field(default_factory=GroupedMMMX)


@dataclasses.dataclass
class Quantize:
    linear: QuantizedLinear = dataclasses.field(default_factory=QuantizedLinear)
    grouped_mm: QuantizedGroupedMM = dataclasses.field(default_factory=QuantizedGroupedMM)


@dataclasses.dataclass
class Metrics:
    log_freq: int = 10
    enable_tensorboard: bool = False
    save_tb_folder: str = "tb"
    disable_color_printing: bool = False
    rank_0_only: bool = True  # torchtitan 0.1's key; false = save_for_all_ranks
    save_for_all_ranks: bool = False  # every rank logs and writes its own TensorBoard events
    enable_wandb: bool = False
    # MFU: count attention's QK^T and scores @ V at half the full-sequence FLOPs, as a causal mask
    # leaves half the score matrix to compute (flash kernels skip it); false is PaLM's and
    # torchtitan's convention (mask ignored), so MFU figures compare with theirs
    causal_attention_flops: bool = False


@dataclasses.dataclass
class Profiling:
    enable_profiling: bool = False
    save_traces_folder: str = "profile_traces"
    profile_freq: int = 10
    enable_memory_snapshot: bool = False
    save_memory_snapshot_folder: str = "memory_snapshot"
    profiler_active: int = 1  # steps traced each cycle
    profiler_warmup: int = 3  # steps before them, run under the profiler but not recorded


@dataclasses.dataclass
class Comm:
    init_timeout_seconds: int = 300
    train_timeout_seconds: int = 100  # the training's collectives after the first step (torchtitan's key)
    trace_buf_size: int = 20000  # NCCL flight recorder entries per rank, dumped when a collective times out
    save_traces_folder: str = "comm_traces"  # under job.dump_folder
    save_traces_file_prefix: str = "rank_"
    mode: str = "default"


@dataclasses.dataclass
class MemoryEstimation:
    enable: bool = False
    disable_fake_mode: bool = False


@dataclasses.dataclass
class FaultTolerance:
    enable: bool = False
    process_group: str = "gloo"
    process_group_timeout_ms: int = 10000
    replica_id: int = 0
    group_size: int = 0
    min_replica_size: int = 1
    semi_sync_method: str | None = None


@dataclasses.dataclass
class ValidationDataLoader:
    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    persistent_workers: bool = False


@dataclasses.dataclass
class Validation:
    enable: bool = False
    dataset: str = "default"
    dataset_path: str = ""
    freq: int = 500
    steps: int = 10  # batches per validation; -1 = the whole dataset once
    local_batch_size: int | None = None  # None: training.local_batch_size
    seq_len: int | None = None  # None: training.seq_len
    dataloader: ValidationDataLoader = dataclasses.field(default_factory=ValidationDataLoader)


@dataclasses.dataclass
class Experimental:
    """Where configs before torchtitan 0.1 put pipeline parallelism; read as the [parallelism]
    keys with a deprecation note."""

    pipeline_parallel_degree: int = 1
    pipeline_parallel_schedule: str = ""
    pipeline_parallel_schedule_csv: str = ""
    pipeline_parallel_microbatches: int | None = None  # micro-batches per local batch
    pipeline_parallel_split_points: list[str] = dataclasses.field(default_factory=list)  # first module of stages 1..
    custom_import: str = ""  # a module imported first: it may register model specs and converters
    custom_args_module: str = ""


@dataclasses.dataclass
class Debug:
    seed: int = 0
    deterministic: bool = False
    deterministic_warn_only: bool = False  # with deterministic: a nondeterministic op warns instead of failing
    moe_force_load_balance: bool = False
    # An injected fault, to test recovery (Tessera's keys; 0 = off): before step fault_at_step,
    # rank fault_rank crashes (exits at once, as if killed) or stalls (stops answering for twice
    # comm.train_timeout_seconds); on a launcher's first attempt only, so an elastic restart runs clean.
    fault_at_step: int = 0
    fault_rank: int = 0
    fault_kind: str = "crash"  # crash | stall


@dataclasses.dataclass
class JobConfig:
    job: Job = dataclasses.field(default_factory=Job)
    model: Model = dataclasses.field(default_factory=Model)
    optimizer: Optimizer = dataclasses.field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = dataclasses.field(default_factory=LRScheduler)
    training: Training = dataclasses.field(default_factory=Training)
    parallelism: Parallelism = dataclasses.field(default_factory=Parallelism)
    checkpoint: Checkpoint = dataclasses.field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = dataclasses.field(default_factory=ActivationCheckpoint)
    compile: Compile = dataclasses.field(default_factory=Compile)
    float8: Float8 = dataclasses.field(default_factory=Float8)  # torchtitan 0.1's section
    quantize: Quantize = dataclasses.field(default_factory=Quantize)
    metrics: Metrics = dataclasses.field(default_factory=Metrics)
    profiling: Profiling = dataclasses.field(default_factory=Profiling)
    comm: Comm = dataclasses.field(default_factory=Comm)
    memory_estimation: MemoryEstimation = dataclasses.field(default_factory=MemoryEstimation)
    fault_tolerance: FaultTolerance = dataclasses.field(default_factory=FaultTolerance)
    validation: Validation = dataclasses.field(default_factory=Validation)
    experimental: Experimental = dataclasses.field(default_factory=Experimental)
    debug: Debug = dataclasses.field(default_factory=Debug)


# Allowed values of string keys, each owned by the code that implements them; checked after
# parsing so a typo is caught before any work.
CHOICES = {
    ("optimizer", "name"): ("AdamW",),
    ("debug", "fault_kind"): FAULT_KINDS,
    ("optimizer", "implementation"): ("foreach", "fused", "for-loop"),
    ("lr_scheduler", "decay_type"): DECAY_TYPES,
    ("training", "mixed_precision_param"): tuple(MIXED_PRECISION_DTYPES),
    ("training", "mixed_precision_reduce"): tuple(MIXED_PRECISION_DTYPES),
    ("parallelism", "fsdp_reshard_after_forward"): RESHARD_POLICIES,
    ("checkpoint", "async_mode"): ASYNC_MODES,
    ("checkpoint", "export_dtype"): tuple(EXPORT_DTYPES),
    ("activation_checkpoint", "mode"): AC_MODES,
    ("model", "attn_mask_type"): ("causal", "block_causal"),
    ("parallelism", "context_parallel_rotate_method"): ("allgather", "alltoall"),
    ("parallelism", "context_parallel_load_balancer"): ("headtail", None),
    ("training", "dtype"): ("float32", "bfloat16"),
    ("comm", "mode"): ("default", "fake_backend", "local_tensor"),
    ("activation_checkpoint", "determinism_check"): ("default", "none"),
    ("quantize", "linear.mx.mxfp8_dim1_cast_kernel_choice"): ("triton", "cuda", "torch"),
}

# Keys holding paths a user types: relative ones resolve against the user's directory.
PATH_KEYS = (
    ("job", "config_file"),
    ("job", "dump_folder"),
    ("model", "tokenizer_path"),
    ("model", "hf_assets_path"),
    ("training", "dataset_path"),
    ("validation", "dataset_path"),
    ("checkpoint", "initial_load_path"),
    ("parallelism", "pipeline_parallel_schedule_csv"),
    ("experimental", "pipeline_parallel_schedule_csv"),
)


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


def _field_type(section: str, key: str) -> typing.Any:
    """The declared type of section.key, where key may name a nested table's key
    ("dataloader.num_workers", "linear.float8.recipe_name")."""
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
        if value is None or (from_cli and str(value).lower() in ("none", "null", "")):
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
    """['--training.steps', '10', '--metrics.log_freq=1'] -> [(section, key, raw value), ...]."""
    overrides = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: options look like --section.key value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"option --{name} needs a value")
            value = argv[i + 1]
            if value.startswith("--"):
                raise ConfigError(f"option --{name} needs a value, got the option {value.split('=')[0]}")
            i += 1
        section, key = _split_key(name)
        overrides.append((section, key, value))
        i += 1
    return overrides


def _apply(config: JobConfig, section: str, key: str, value: typing.Any, from_cli: bool) -> None:
    value = _convert(section, key, value, from_cli)  # validates section and key first
    owner = getattr(config, section)
    *groups, leaf = key.split(".")
    for group in groups:  # a key of a nested [section.group...] table
        owner = getattr(owner, group)
    setattr(owner, leaf, value)


def _keys(table: dict, prefix: str = "") -> Iterator[tuple[str, typing.Any]]:
    """A TOML section's keys, nested tables flattened to dotted keys."""
    for key, value in table.items():
        if isinstance(value, dict):
            yield from _keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomli.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file is a directory: {path}") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text (a binary file?)") from None


def load_config(argv: list[str], accepted: frozenset[str] = frozenset()) -> JobConfig:
    """Defaults, then the TOML file named by --job.config_file, then the other overrides.
    `accepted`: refused keys (config_keys.REFUSED) that the caller implements, e.g. the
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
        for section, table in sections.items():
            if not isinstance(table, dict):
                raise ConfigError(f"config file {path}: '{section}' must be a [section] table")
            _section_fields(section)
            for key, value in _keys(table):
                _apply(config, section, key, value, from_cli=False)
    for section, key, value in overrides:
        _apply(config, section, key, value, from_cli=True)
    for section, key in PATH_KEYS:
        value = getattr(getattr(config, section), key)
        if value:
            setattr(getattr(config, section), key, str(base / os.path.expanduser(value)))
    config.training.dataset_mixture = [  # "path=weight": the paths resolve like dataset_path
        f"{base / os.path.expanduser(path.strip())}={weight}" if path.strip() else entry
        for entry in config.training.dataset_mixture
        for path, _, weight in [entry.rpartition("=")]
    ]
    _read_experimental(config)
    _custom_import(config.experimental.custom_import)
    validate(config, accepted)
    return config


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
    moved = [key for key in ("pipeline_parallel_degree", "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv")
             if getattr(old, key) != getattr(defaults, key)]
    for key in moved:
        setattr(new, key, getattr(old, key))
    microbatches = old.pipeline_parallel_microbatches
    if microbatches is not None:
        local = config.training.local_batch_size
        if microbatches < 1 or local % microbatches:
            raise ConfigError(f"config key experimental.pipeline_parallel_microbatches: {microbatches} does not divide "
                              f"training.local_batch_size {local}")
        new.pipeline_parallel_microbatch_size = local // microbatches
        moved.append("pipeline_parallel_microbatches")
    if old.pipeline_parallel_split_points:
        moved.append("pipeline_parallel_split_points")
    if moved:
        note(f"config keys experimental.{{{', '.join(moved)}}} are deprecated; read as their [parallelism] "
             "equivalents (microbatches -> pipeline_parallel_microbatch_size, split_points -> module_fqns_per_model_part)")


def note(message: str) -> None:
    """A remark on the config, once per job: by the process that reads it first — `--nproc`'s
    launcher (its ranks then stay quiet), else rank 0."""
    if os.environ.get("RANK", "0") == "0" and "TESSERA_LAUNCHER_PID" not in os.environ:
        print(f"note: {message}", file=sys.stderr, flush=True)


def validate(config: JobConfig, accepted: frozenset[str] = frozenset()) -> None:
    """Value checks that types alone do not catch."""
    for dotted, reason in REFUSED.items():
        if dotted not in accepted and get_key(config, dotted) != get_key(JobConfig(), dotted):
            raise ConfigError(f"config key {dotted} = {get_key(config, dotted)!r}: {reason}")
    if config.activation_checkpoint.mode == "memory_budget":
        raise ConfigError(f"config key activation_checkpoint.mode = 'memory_budget': {REFUSED['activation_checkpoint.memory_budget']}")
    for (section, key), allowed in CHOICES.items():
        value = get_key(config, f"{section}.{key}")
        if value not in allowed:
            raise ConfigError(f"config key {section}.{key}: {value!r} is not one of {list(allowed)}")
    positive = [
        ("training", "local_batch_size"), ("training", "seq_len"), ("training", "steps"),
        ("metrics", "log_freq"), ("checkpoint", "interval"), ("validation", "freq"),
        ("profiling", "profile_freq"), ("training", "gc_freq"), ("comm", "init_timeout_seconds"),
        ("job", "stop_grace_seconds"), ("comm", "train_timeout_seconds"),
        ("parallelism", "pipeline_parallel_degree"), ("parallelism", "pipeline_parallel_microbatch_size"),
        ("parallelism", "context_parallel_degree"), ("profiling", "profiler_active"),
        ("lr_scheduler", "total_steps"), ("validation", "local_batch_size"), ("validation", "seq_len"),
    ]
    for section, key in positive:
        value = getattr(getattr(config, section), key)
        if value is not None and value < 1:
            raise ConfigError(f"config key {section}.{key}: {value} must be >= 1")
    non_negative = [("lr_scheduler", "warmup_steps"), ("optimizer", "lr"), ("optimizer", "eps"),
                    ("optimizer", "weight_decay"), ("checkpoint", "keep_latest_k"), ("training", "max_skipped_steps"),
                    ("debug", "fault_at_step"), ("debug", "fault_rank"), ("profiling", "profiler_warmup"),
                    ("comm", "trace_buf_size")]
    for section, key in non_negative:
        if getattr(getattr(config, section), key) < 0:
            raise ConfigError(f"config key {section}.{key}: must be >= 0")
    ratio = config.lr_scheduler.decay_ratio
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"config key lr_scheduler.decay_ratio: {ratio} must be within [0, 1]")
    if not 0.0 <= config.lr_scheduler.min_lr_factor <= 1.0:
        raise ConfigError("config key lr_scheduler.min_lr_factor: must be within [0, 1]")
    option = config.activation_checkpoint.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError(f"config key activation_checkpoint.selective_ac_option: {option!r} is not 'op' or a positive int")
    try:
        parse_mixture(config.training.dataset_mixture)
    except ValueError as e:
        raise ConfigError(f"config key training.dataset_mixture: {e}") from None
    if config.training.dataset_mixture and (config.training.dataset_path or config.training.dataset != "default"):
        raise ConfigError("config key training.dataset_mixture replaces training.dataset and dataset_path; set one of them")
    if config.training.shuffle_buffer < 1:
        raise ConfigError(f"config key training.shuffle_buffer: {config.training.shuffle_buffer} must be >= 1")
    for section in ("training", "validation"):
        loader = getattr(config, section).dataloader
        if loader.num_workers < 0:
            raise ConfigError(f"config key {section}.dataloader.num_workers: {loader.num_workers} must be >= 0")
        if loader.prefetch_factor is not None and (loader.prefetch_factor < 1 or loader.num_workers == 0):
            raise ConfigError(f"config key {section}.dataloader.prefetch_factor: must be >= 1, and needs num_workers > 0")
    prof = config.profiling
    if prof.enable_profiling and prof.profiler_warmup + prof.profiler_active > prof.profile_freq:
        raise ConfigError(f"config keys profiling.profiler_warmup {prof.profiler_warmup} + profiler_active "
                          f"{prof.profiler_active} exceed profile_freq {prof.profile_freq}: each trace's steps must fit in one period")
    if config.training.max_norm <= 0:
        raise ConfigError(f"config key training.max_norm: {config.training.max_norm} must be > 0")
    if config.validation.steps < 1 and config.validation.steps != -1:
        raise ConfigError(f"config key validation.steps: {config.validation.steps} must be >= 1 or -1 (the whole set)")
    unknown = sorted(set(config.compile.components) - {"model", "loss"})
    if unknown:
        raise ConfigError(f"config key compile.components: {unknown} not in ['model', 'loss']")
    unknown = [name for name in config.model.converters if name not in registered_converters()]
    if unknown:
        raise ConfigError(f"config key model.converters: {unknown} not registered; available: {registered_converters()}")
    for name, path in [*float8_converter.SECTIONS.items(), (float8_converter.MX_NAME, float8_converter.MX_SECTION),
                       *float8_converter.GROUPED_SECTIONS.items()]:
        section = float8_converter.section_of(config, path)
        if section != type(section)() and name not in config.model.converters:
            # torchtitan's configs carry the section whether or not the converter runs
            note(f"config section [{'.'.join(path)}] has no effect: model.converters does not list {name!r}")


def get_key(config: JobConfig, dotted: str) -> typing.Any:
    """The value of "section.key" or "section.table.key"."""
    value = config
    for name in dotted.split("."):
        value = getattr(value, name)
    return value


def to_dict(config: JobConfig) -> dict:
    return dataclasses.asdict(config)
