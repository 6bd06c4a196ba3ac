"""The job plan: everything decided from the config and the world size before any process group,
model or tensor exists — parallel degrees and meshes, model args, batch arithmetic, dtypes,
converters, FLOPs — together with every check of the user's choices, so a mistake ends the run
once (under `--nproc`, before any worker starts) instead of on every rank half-way through set-up.

It reads the config and the tokenizer's size and nothing else; file paths are only looked at.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tessera import cp, ep, pp, tp
from tessera.data import load_tokenizer, parse_mixture
from tessera.fsdp import MIXED_PRECISION_DTYPES
from tessera.mesh import MeshLayout, ParallelDims, device_type, mesh_layout, resolve_parallel_dims
from tessera.models import ModelSpec, RunLayout, choose_kernel, force_recompute_shapes, get_model_spec, plain_causal
from tessera.trainer.chunked_loss import hidden_output_style
from tessera.trainer.config import (ActivationCheckpoint, ConfigError, JobConfig, Loss, Optimizer, idle_options,
                                    remarks, user_directory, user_input)
from tessera.trainer.converters import ModelConverter, build_converters
from tessera.trainer.errors import LayoutError
from tessera.trainer.ft_plan import FaultTolerancePlan, fault_tolerance_plan
from tessera.trainer.hf_assets import check_hf_weights, flavor_args, initial_load_folder
from tessera.trainer.param_groups import resolve_groups
from tessera.trainer.sub_plans import (AttentionPlan, BatchPlan, CheckpointingPlan, CompilePlan, ExpertPlan, FsdpPlan,
                                       LossPlan, MuonPlan, OptimizerPlan, PipelinePlan, Precision,
                                       TensorParallelPlan)


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """Every decision of the run. `config` stays for the settings handed whole to their owners
    (checkpoint folders and intervals, metrics, profiling, timeouts, data sources): nothing reads
    it to decide a layout, dtype, kernel or step rule."""

    config: JobConfig
    world_size: int
    device: str
    dims: ParallelDims
    meshes: MeshLayout
    spec: ModelSpec
    model_args: Any  # the flavor's args (its vocab, as torchtitan's) with the run's seq_len
    batch: BatchPlan
    precision: Precision
    converters: tuple[ModelConverter, ...]
    print_converted: bool  # model.print_after_conversion
    fsdp: FsdpPlan
    tensor_parallel: TensorParallelPlan
    pipeline: PipelinePlan | None  # None: no pipeline parallelism
    experts: ExpertPlan
    attention: AttentionPlan
    checkpointing: CheckpointingPlan
    compile: CompilePlan
    optimizer: OptimizerPlan
    loss: LossPlan
    fault_tolerance: FaultTolerancePlan  # torchft replica groups (enabled False: none)
    flops_per_token: float
    seed: int  # debug.seed: weights, data order, dropout
    dataset: str | None  # None: the embedded corpus
    validation_dataset: str | None
    notes: tuple[str, ...] = ()  # what a check-only plan could not verify on this host
    warnings: tuple[str, ...] = ()  # settings adjusted or matching nothing, said in the banner (torchtitan warns)

    @property
    def post_optimizer_hooks(self) -> tuple:
        return tuple(hook for converter in self.converters for hook in converter.post_optimizer_hooks)


# torchtitan's dataset names whose data is a folder of its checkout, read where the user stands.
LOCAL_DATASETS = {"c4_test": "tests/assets/c4_test", "c4_validation": "tests/assets/c4_validation"}
HUB_DATASETS = {"c4": "allenai/c4", "c4_validation": "allenai/c4 (validation split)"}


def dataset_source(section) -> str | None:
    """The path a [training] or [validation] section reads, or None for the embedded corpus:
    dataset_path, else the dataset's name ("default", a torchtitan name, or a path)."""
    if section.dataset_path:
        return section.dataset_path
    name = section.dataset
    if name == "default":
        return None
    local = user_directory() / LOCAL_DATASETS.get(name, name)
    if local.exists():
        return str(local)
    if name in HUB_DATASETS:
        raise ConfigError(f"dataset {name!r} is {HUB_DATASETS[name]} on the Hugging Face hub, which Tessera does not "
                          f"download: fetch it and set dataset_path to its JSON-lines files or folder")
    where = f" (looked for {local})" if name in LOCAL_DATASETS else ""
    raise ConfigError(f"dataset {name!r} not found{where}: use 'default', c4_test, or a file or folder path")


def _validation_source(config: JobConfig) -> str | None:
    """validation.dataset "default" (no dataset_path): documents held out of the training data —
    of the training dataset, or of a mixture's first one; else what the section names."""
    section, training = config.validation, config.training
    if section.dataset_path or section.dataset != "default":
        return dataset_source(section)
    if training.dataset_mixture:
        return parse_mixture(training.dataset_mixture)[0][0]
    return dataset_source(training)


def tokenizer_source(config: JobConfig) -> str | None:
    """What the run tokenises with: model.tokenizer_path, else the Hugging Face folder's
    tokenizer, else (None) the embedded BPE."""
    return config.model.tokenizer_path or config.model.hf_assets_path or None


def make_plan(config: JobConfig, world_size: int, device: str | None = None, *, check_only: bool = False,
              command_line: Sequence[str] = ()) -> JobPlan:
    """Resolves and checks `config` for `world_size` ranks on `device` (default: this host's).

    Raises ConfigError naming the culprit. With `check_only` (planning a run for another host),
    files the run would read are not required here: what cannot be verified becomes a note.
    `command_line`: the options the config was loaded with; one its switch leaves idle is a warning.
    """
    device = device or device_type()
    config = _with_param_dtype(config, device)
    par, training = config.parallelism, config.training
    notes: list[str] = []
    try:
        dims = resolve_parallel_dims(
            world_size, dp_replicate=par.data_parallel_replicate_degree,
            dp_shard=par.data_parallel_shard_degree, tp=par.tensor_parallel_degree,
            pp=par.pipeline_parallel_degree, cp=par.context_parallel_degree, ep=par.expert_parallel_degree,
            ep_spans_tp=par.expert_tensor_parallel_degree == 1,  # torchtitan: etp 1 puts the tp ranks in ep
        )
    except ValueError as e:
        raise LayoutError(str(e)) from None
    with user_input():
        spec = get_model_spec(config.model.name)
    args = _model_args(config, spec)
    _check_tokenizer_fits(config, spec, args.vocab_size, notes if check_only else None)
    converters = build_converters(config, dims, device)
    # expert_tensor_parallel_degree 1: the ep group holds the tp ranks and takes the experts whole
    experts = {"experts": lambda layouts: None} if dims.ep_spans_tp else {}
    # the chunked loss projects the hidden states itself: under TP they come out gathered
    chunked = {"vocab_output": hidden_output_style} if training.loss_chunk_size else {}
    styles = tp.styles_with({**experts, **chunked, **{role: f for c in converters for role, f in c.tp_styles.items()}})
    meta_model = functools.cache(lambda: _meta_model(spec, args))
    _check_tensor_parallel(config, spec, args, dims, styles)
    _check_family(config, spec, args, dims, device)
    _check_expert_parallel(config, spec, args, dims)
    attention = attention_plan(config, spec, args, dims, device)
    _check_layout(config, dims, device, attention)
    _check_checkpoint(config, spec, world_size)
    _check_paths(config, notes if check_only else None)
    hf_warnings = check_hf_weights(config, spec, args)
    dataset = _source_or_note(lambda: dataset_source(training), notes if check_only else None)
    validation = _source_or_note(lambda: _validation_source(config), notes if check_only else None) if config.validation.enable else None
    fault_tolerance = fault_tolerance_plan(config, dims, meta_model, device, notes if check_only else None)
    _check_fault(config, world_size * fault_tolerance.groups)
    batch, pipeline = _batch(config, dims, fault_tolerance.groups), _pipeline(config, spec, args, meta_model, dims, device)
    mtp_scale = _multi_token_prediction(config, spec, args)
    loss_parallel = dims.tp_enabled and not par.disable_loss_parallel
    optimizer, warnings = _optimizer(config, spec, meta_model)
    warnings += _check_converters(config, spec, converters, meta_model) + hf_warnings + remarks(config)
    warnings += idle_options(config, list(command_line))
    _check_chunked_loss(config, converters, meta_model)
    if config.activation_checkpoint.mode == "offload" and device == "cpu":
        warnings.append("activation_checkpoint.mode offload on a CPU copies the activations within host memory: "
                        "it saves nothing here")
    return JobPlan(
        config=config, world_size=world_size, device=device, dims=dims, meshes=mesh_layout(dims), spec=spec,
        model_args=args, batch=batch, precision=_precision(config, dims), converters=converters,
        print_converted=config.model.print_after_conversion,
        fsdp=FsdpPlan(pipeline.reshard_after_forward if pipeline else par.fsdp_reshard_after_forward,
                      training.enable_cpu_offload, par.fsdp_reduce_every_microbatch),
        tensor_parallel=TensorParallelPlan(styles, par.enable_async_tensor_parallel),
        pipeline=pipeline, experts=ExpertPlan(config.debug.moe_force_load_balance, par.expert_capacity_factor,
                                              par.expert_capacity_overflow),
        attention=attention, checkpointing=_checkpointing(config, meta_model),
        compile=_compile_plan(config), optimizer=optimizer,
        # a compiled cross-entropy of vocab-sharded logits bypasses loss parallel (torch 2.13: the
        # local shard's loss, 2.6 instead of 8.2 on the debug model), so it stays eager there
        loss=LossPlan(loss_parallel, _compiles(config, "loss") and not loss_parallel,
                      1 / batch.accumulation, training.loss_chunk_size, mtp_scale),
        fault_tolerance=fault_tolerance, flops_per_token=_flops_per_token(config, spec, args), seed=config.debug.seed,
        dataset=dataset, validation_dataset=validation, notes=tuple(notes), warnings=tuple(warnings),
    )


def _compile_plan(config: JobConfig) -> CompilePlan:
    """An unknown backend is refused here, once, rather than by dynamo at the first compiled call."""
    if config.compile.enable:
        from torch._dynamo.backends.registry import list_backends

        backends = list_backends(exclude_tags=())  # debug ones too (eager, aot_eager); entry points included
        if config.compile.backend not in backends:
            raise ConfigError(f"compile.backend {config.compile.backend!r} is not a torch.compile backend; these are: {backends}")
    return CompilePlan(_compiles(config, "model"), config.compile.backend)


def _compiles(config: JobConfig, component: str) -> bool:
    """Whether torch.compile applies to `component` ("model": each block, or "loss")."""
    return config.compile.enable and component in config.compile.components


def _with_param_dtype(config: JobConfig, device: str) -> JobConfig:
    """training.mixed_precision_param unset: bfloat16 on CUDA (torchtitan's default, which its
    shipped configs rely on), float32 elsewhere (CPUs without AVX-512 BF16 emulate bf16 matmuls)."""
    if config.training.mixed_precision_param is not None:
        return config
    dtype = "bfloat16" if device == "cuda" else "float32"
    return dataclasses.replace(config, training=dataclasses.replace(config.training, mixed_precision_param=dtype))


def _precision(config: JobConfig, dims: ParallelDims) -> Precision:
    training = config.training
    param = MIXED_PRECISION_DTYPES[training.mixed_precision_param]
    return Precision(MIXED_PRECISION_DTYPES[training.dtype], param, MIXED_PRECISION_DTYPES[training.mixed_precision_reduce],
                     autocast=param != torch.float32 and not dims.fsdp_enabled)


def _checkpointing(config: JobConfig, meta_model: Callable[[], torch.nn.Module]) -> CheckpointingPlan:
    """Mode memory_budget hands the choice to compile's min-cut partitioner (tessera.models.apply_compile):
    it needs the blocks compiled, and its two keys mean nothing under another mode."""
    ac = config.activation_checkpoint
    recompute = tuple(_force_recompute(config, meta_model))
    # torchtitan checkpoints every block at N = 0 (`not ac_freq or count % ac_freq == 0`)
    option = ac.selective_ac_option if ac.selective_ac_option == "op" else str(int(ac.selective_ac_option) or 1)
    if ac.mode == "selective" and option != "op" and int(option) > len(meta_model().layers):
        raise ConfigError(f"activation_checkpoint.selective_ac_option {option}: {config.model.name}/{config.model.flavor} "
                          f"has {len(meta_model().layers)} blocks, so no block would be checkpointed")
    if ac.mode != "memory_budget":
        for name in ("memory_budget", "visualize_memory_budget_pareto"):
            if getattr(ac, name) != getattr(ActivationCheckpoint(), name):
                raise ConfigError(f"activation_checkpoint.{name} applies only with activation_checkpoint.mode "
                                  f"memory_budget (this run: {ac.mode!r})")
        return CheckpointingPlan(ac.mode, option, ac.preserve_rng_state, ac.early_stop,
                                 ac.determinism_check, ac.debug, force_recompute_fqns=recompute)
    if not _compiles(config, "model"):
        raise ConfigError("activation_checkpoint.mode memory_budget lets compile's partitioner choose what to recompute: "
                          "set compile.enable true with 'model' in compile.components, or use mode selective or full")
    pareto = str(Path(config.job.dump_folder) / "memory_budget_pareto") if ac.visualize_memory_budget_pareto else None
    return CheckpointingPlan(ac.mode, option, ac.preserve_rng_state, ac.early_stop, ac.determinism_check,
                             ac.debug, ac.memory_budget, pareto, recompute)


def _force_recompute(config: JobConfig, meta_model: Callable[[], torch.nn.Module]) -> list[str]:
    """activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns: other than torchtitan's
    default (the MoE router, which a dense model lacks), it must act: under selective "op", each
    name on linears of this model."""
    ac, key = config.activation_checkpoint, "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns"
    fqns = ac.per_op_sac_force_recompute_mm_shapes_by_fqns
    if fqns == ActivationCheckpoint().per_op_sac_force_recompute_mm_shapes_by_fqns:
        return fqns
    if (ac.mode, ac.selective_ac_option) != ("selective", "op"):
        raise ConfigError(f"{key} applies only with activation_checkpoint.mode selective and selective_ac_option op "
                          f"(this run: {ac.mode!r}, {ac.selective_ac_option!r})")
    model = meta_model()
    try:
        unmatched = [fqn for fqn in fqns if not force_recompute_shapes(model, (fqn,))]
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
    if unmatched:
        raise ConfigError(f"{key}: {unmatched} matches no linear of {config.model.name}/{config.model.flavor}")
    return fqns


def _optimizer(config: JobConfig, spec: ModelSpec,
               meta_model: Callable[[], torch.nn.Module]) -> tuple[OptimizerPlan, list[str]]:
    """The optimizer, its parameter groups and its schedule, and what was adjusted: a warm-up
    longer than the schedule is shortened to it (torchtitan does the same, with a warning)."""
    opt, sched = config.optimizer, config.lr_scheduler
    muon = None
    if opt.name == "Muon":
        muon = MuonPlan(opt.muon_momentum, opt.muon_nesterov, opt.muon_ns_steps, opt.muon_adjust_lr,
                        getattr(torch, opt.muon_ns_dtype))
    else:
        defaults = Optimizer()
        for name in (f.name for f in dataclasses.fields(Optimizer) if f.name.startswith("muon_")):
            if getattr(opt, name) != getattr(defaults, name):
                raise ConfigError(f"optimizer.{name} applies only with optimizer.name = 'Muon' (this run: {opt.name!r})")
    if opt.state_dtype != "float32" and opt.name == "Adam":
        raise ConfigError(f"optimizer.state_dtype {opt.state_dtype!r} runs Tessera's AdamW, which decouples weight decay: "
                          "it has no Adam (optimizer.name 'Adam')")
    if opt.state_dtype != "float32" and opt.implementation != "for-loop":
        raise ConfigError(f"optimizer.state_dtype {opt.state_dtype!r} runs Tessera's for-loop AdamW (torch's kernels keep "
                          f"the moments in the parameters' dtype): set optimizer.implementation = 'for-loop', not "
                          f"{opt.implementation!r}")
    state_dtype = None if opt.state_dtype == "float32" else getattr(torch, opt.state_dtype)
    groups, adjusted = resolve_groups(opt, meta_model, spec, f"{spec.name}/{config.model.flavor}")
    total = sched.total_steps or config.training.steps
    warmup = sched.warmup_steps
    if warmup > total:
        warmup = total
        adjusted.append(f"lr_scheduler.warmup_steps {sched.warmup_steps} exceeds the schedule's {total} steps; "
                        f"warming up over {total}")
    return OptimizerPlan(opt.name, opt.lr, (opt.beta1, opt.beta2), opt.eps, opt.weight_decay, opt.implementation, state_dtype,
                         config.training.max_norm, total, warmup, sched.decay_ratio, sched.decay_type,
                         sched.min_lr_factor, groups, muon), adjusted


def _source_or_note(find: Callable[[], str | None], notes: list[str] | None) -> str | None:
    """The data find() resolves; a check-only plan notes data this host lacks (a hub dataset,
    a checkout's c4_test) and gives None."""
    try:
        return find()
    except ConfigError as e:
        if notes is None:
            raise
        notes.append(str(e))
        return None


def _check_tokenizer_fits(config: JobConfig, spec: ModelSpec, vocab_size: int, notes: list[str] | None) -> None:
    """The flavor sizes the vocabulary, as torchtitan's do (a tokenizer with fewer ids leaves rows
    that no token selects, which still take part in every softmax); a tokenizer with more ids
    than that is refused. Check-only plans on a host without the tokenizer note it unchecked; one
    that is here but unreadable is refused (a login node sees the cluster's file)."""
    source = tokenizer_source(config)
    try:
        with user_input():
            ids = load_tokenizer(source).vocab_size
    except (ConfigError, OSError) as e:
        if notes is None or (source and Path(source).exists()):
            raise ConfigError(str(e)) from e
        notes.append(f"tokenizer not read here ({e}); its ids not checked against vocab_size {vocab_size}")
        return
    if ids > vocab_size:
        raise ConfigError(f"tokenizer {source or '(embedded)'} has {ids} ids, more than {spec.name}/{config.model.flavor}'s "
                          f"vocab_size {vocab_size}")


def _model_args(config: JobConfig, spec: ModelSpec):
    # The run decides how many positions RoPE needs, up to the flavor's context length (its
    # RoPE scaling and training were made for that many).
    flavor = flavor_args(config, spec)
    for key, seq_len in (("training.seq_len", config.training.seq_len), ("validation.seq_len", validation_shape(config)[1])):
        if seq_len > flavor.max_seq_len:
            raise ConfigError(f"{key} {seq_len} exceeds the context length of {spec.name}/{config.model.flavor} ({flavor.max_seq_len})")
    longest = max(config.training.seq_len, validation_shape(config)[1])
    return dataclasses.replace(flavor, max_seq_len=longest)


def validation_shape(config: JobConfig) -> tuple[int, int]:
    """(local batch size, seq_len) of validation batches: validation's keys, else training's."""
    section, training = config.validation, config.training
    if not section.enable:
        return training.local_batch_size, training.seq_len
    return section.local_batch_size or training.local_batch_size, section.seq_len or training.seq_len


def _flops_per_token(config: JobConfig, spec: ModelSpec, args) -> float:
    """The spec's training FLOPs per token; with metrics.causal_attention_flops the part that
    grows with seq_len (attention's score matmuls) counts half, as a causal mask computes half."""
    seq_len = config.training.seq_len
    total = spec.flops_per_token(args, seq_len)
    if not config.metrics.causal_attention_flops:
        return total
    return total - (total - spec.flops_per_token(args, 0)) / 2


def _batch(config: JobConfig, dims: ParallelDims, replica_groups: int = 1) -> BatchPlan:
    """replica_groups: fault tolerance's groups, each dims.dp data-parallel ranks of its own."""
    local, global_, dp = config.training.local_batch_size, config.training.global_batch_size, dims.dp * replica_groups
    if global_ > 0 and global_ % (local * dp):
        raise ConfigError(
            f"training.global_batch_size {global_} is not a multiple of local_batch_size * data-parallel degree = "
            f"{local} * {dp}" + (f" ({dims.dp} per replica group x {replica_groups} groups)" if replica_groups > 1 else "")
        )
    accumulation = global_ // (local * dp) if global_ > 0 else 1
    return BatchPlan(local, dp, accumulation, config.training.seq_len, dims.tp * dims.cp * dims.pp)


def _meta_model(spec: ModelSpec, args) -> torch.nn.Module:
    """The model on the meta device: its module names and shapes, no memory. Plans only read it,
    so plans of the same model share one (tools/plan makes hundreds: building Llama 3 70B took
    0.12 s each, 78 % of a search); a family whose args cannot be hashed gets its own each time."""
    try:
        hash(args)
    except TypeError:
        with torch.device("meta"):
            return spec.build(args)
    return _shared_meta_model(spec.build, args)


@functools.lru_cache(maxsize=4)
def _shared_meta_model(build: Callable, args) -> torch.nn.Module:
    with torch.device("meta"):
        return build(args)


def _check_converters(config: JobConfig, spec: ModelSpec, converters, meta_model: Callable[[], torch.nn.Module]) -> list[str]:
    """Refuses a converter whose kind and name patterns leave no module of this model; returns a
    warning when its size filter leaves none, and one for each name pattern that matches no module
    (torchtitan accepts both silently)."""
    warnings = []
    for converter in converters:
        if converter.selects is None:
            continue
        model = meta_model()  # built once, for the first converter that asks
        key, patterns = converter.patterns
        flavor = f"{spec.name}/{config.model.flavor}"
        if not any((converter.selects_by_name or converter.selects)(fqn, module) for fqn, module in model.named_modules()):
            raise ConfigError(f"model.converters {converter.name} would convert no module of {flavor}"
                              + (f" ({key} {list(patterns)})" if patterns else ""))
        if not any(converter.selects(fqn, module) for fqn, module in model.named_modules()):
            warnings.append(f"model.converters {converter.name} converts no module of {flavor}: its size filter "
                            "leaves out every one it would take")
        warnings += [f"{key}: {pattern!r} matches no module of {flavor}" for pattern in patterns
                     if not any(pattern in fqn for fqn, _ in model.named_modules())]
    return warnings


def _check_chunked_loss(config: JobConfig, converters, meta_model: Callable[[], torch.nn.Module]) -> None:
    """The chunked loss runs the output projection itself, in high precision: a converter that
    would swap it (float8 with "output" left out of its filter) cannot serve it."""
    if not config.training.loss_chunk_size:
        return
    for converter in converters:
        if converter.selects is not None and converter.selects("output", meta_model().output):
            key, patterns = converter.patterns
            raise ConfigError(f"training.loss_chunk_size runs the output projection in high precision, but "
                              f"model.converters {converter.name} would convert 'output' ({key} {list(patterns)}); "
                              "keep it unconverted or set loss_chunk_size 0")


def _multi_token_prediction(config: JobConfig, spec: ModelSpec, args) -> float | None:
    """loss.mtp_scale where the model has multi-token-prediction modules (ModelSpec.mtp_layers),
    else None; the key means nothing without them."""
    model = f"{spec.name}/{config.model.flavor}"
    if not spec.mtp_layers(args):
        if config.loss.mtp_scale != Loss().mtp_scale:
            raise ConfigError(f"loss.mtp_scale weighs multi-token prediction, which {model} does not have "
                              "(DeepSeek-V3's: a *_mtp flavor, or num_nextn_predict_layers in config.json)")
        return None
    if config.training.loss_chunk_size:
        raise ConfigError(f"training.loss_chunk_size with multi-token prediction ({model}) is not supported yet: its "
                          "modules project their own whole logits; set loss_chunk_size 0")
    return config.loss.mtp_scale


def _pipeline(config: JobConfig, spec: ModelSpec, args, meta_model: Callable[[], torch.nn.Module], dims: ParallelDims,
              device: str) -> PipelinePlan | None:
    """The stages, micro-batches and FSDP resharding of a pipelined run, every choice checked."""
    par = config.parallelism
    if not dims.pp_enabled:
        return None
    model = meta_model()  # the module names to cut at, following tessera.pp's conventions
    inputs, n_layers, outputs = pp.model_parts_names(model)
    # a module the last stage also runs (shared_with_last_stage: a tied embedding) gets a copy there
    shared = getattr(model, "shared_with_last_stage", ())
    first = {id(p) for name in inputs if name not in shared for p in model.get_submodule(name).parameters()}
    if any(id(p) in first for name in outputs for p in model.get_submodule(name).parameters()):
        raise ConfigError(f"model.flavor {config.model.flavor} ties the output to the embedding, which pipeline stages "
                          "cannot share; use pipeline_parallel_degree 1 for it")
    names = dict(inputs=inputs, outputs=outputs)
    with user_input():
        schedule = pp.canonical_schedule(par.pipeline_parallel_schedule)
        parts = par.module_fqns_per_model_part or _split_points(config, n_layers, inputs, outputs)
        if parts is None:
            stages = pp.stage_count(
                dims.pp, schedule, n_layers, layers_per_stage=par.pipeline_parallel_layers_per_stage,
                first_stage_less_layers=par.pipeline_parallel_first_stage_less_layers,
                last_stage_less_layers=par.pipeline_parallel_last_stage_less_layers,
            )
            parts = pp.even_split(stages, n_layers, first_stage_less_layers=par.pipeline_parallel_first_stage_less_layers,
                                  last_stage_less_layers=par.pipeline_parallel_last_stage_less_layers, **names)
        else:
            pp.check_split(parts, n_layers, **names)
            pp.check_stage_count(len(parts), dims.pp, schedule, f"the stage split names {len(parts)} stages")
    # the multi-token-prediction modules (the last blocks) use the output projection, which the last stage holds
    stray = [f"layers.{i}" for i in range(n_layers - spec.mtp_layers(args), n_layers) if f"layers.{i}" not in parts[-1]]
    if stray:
        raise ConfigError(f"pipeline stages: multi-token prediction's {stray[0]} must be on the last stage, with the "
                          "output projection it uses: lower pipeline_parallel_last_stage_less_layers, or name it in "
                          "module_fqns_per_model_part's last stage")
    try:
        pp.check_backend(schedule, device)
    except ValueError as e:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule {e}") from None
    local, size = config.training.local_batch_size, par.pipeline_parallel_microbatch_size
    if local % size:
        raise ConfigError(f"parallelism.pipeline_parallel_microbatch_size {size} does not divide training.local_batch_size {local}")
    microbatches = local // size
    csv = par.pipeline_parallel_schedule_csv or None
    try:
        if not csv:  # a CSV's order replaces the named schedule's, and torch's runtime for it has no such rule
            pp.check_microbatches(schedule, dims.pp, len(parts), microbatches)
    except ValueError as e:
        raise ConfigError(f"training.local_batch_size {local} / parallelism.pipeline_parallel_microbatch_size {size}: "
                          f"{e}") from None
    if csv and not Path(csv).is_file():
        raise ConfigError(f"parallelism.pipeline_parallel_schedule_csv {csv} is not a file")
    try:
        if csv:
            pp.check_schedule_csv(csv, schedule, dims.pp, len(parts), microbatches)
        splits_backward = pp.splits_backward(schedule, csv)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule_csv {e}") from None
    reshard = par.fsdp_reshard_after_forward
    if reshard == "always" and splits_backward:
        # measured: FSDP resharding after forward under these schedules trains with wrong gradients
        raise ConfigError(f"parallelism.fsdp_reshard_after_forward 'always' with schedule {csv or schedule} trains with "
                          "wrong gradients in torch 2.13 (the weight-gradient pass runs on freed shards); use 'default' or 'never'")
    if par.fsdp_reduce_every_microbatch:
        raise ConfigError("parallelism.fsdp_reduce_every_microbatch with pipeline parallel: torch's pipeline stages "
                          "reduce their gradients once, after the last micro-batch; leave it false")
    if dims.dp_replicate > 1 and not dims.fsdp_enabled:
        raise ConfigError("pipeline parallel with DDP (data_parallel_replicate_degree > 1, shard degree 1) is not "
                          "supported; shard instead (data_parallel_shard_degree)")
    # as torchtitan: under pp, "default" keeps each stage's weights gathered from forward to
    # backward, since micro-batches re-run every stage many times per step
    return PipelinePlan(schedule, csv, tuple(tuple(p) for p in parts), microbatches,
                        "never" if reshard == "default" else reshard, splits_backward)


def _split_points(config: JobConfig, n_layers: int, inputs: list[str], outputs: list[str]) -> list[list[str]] | None:
    """[experimental] pipeline_parallel_split_points (the first block of every stage after the
    first) as module names per stage."""
    points = config.experimental.pipeline_parallel_split_points
    if not points:
        return None
    starts = []
    for point in points:
        index = point.removeprefix("layers.")
        if not index.isdigit() or not 0 < int(index) < n_layers:
            raise ConfigError(f"config key experimental.pipeline_parallel_split_points: {point!r} is not layers.N "
                              f"with 0 < N < {n_layers}")
        starts.append(int(index))
    bounds = [0, *starts, n_layers]
    parts = [[f"layers.{i}" for i in range(a, b)] for a, b in zip(bounds, bounds[1:])]
    return [[*inputs, *parts[0]], *parts[1:-1], [*parts[-1], *outputs]]


def _check_tensor_parallel(config: JobConfig, spec: ModelSpec, args, dims: ParallelDims, styles) -> None:
    unknown = sorted(set(spec.tp_plan.values()) - set(styles))
    if unknown and dims.tp_enabled:
        raise ConfigError(f"model {spec.name!r}: tp_plan roles {unknown} have no tensor-parallel style; known: {sorted(styles)}")
    if dims.tp_enabled and "replicated" in spec.tp_plan.values() and styles["colwise"] is not tp.DEFAULT_STYLES["colwise"]:
        # a replaced colwise style all-reduces the gradient of a replicated module's output, which
        # tessera.tp's leaves to the block input: the latent's gradient would count tp times
        raise ConfigError(f"model.converters {list(config.model.converters)} with tensor_parallel_degree {dims.tp}: "
                          f"{spec.name}'s replicated modules need tessera.tp's colwise style, which these replace; "
                          "use a rowwise float8 recipe or tp 1")
    if dims.tp_enabled:
        with user_input():  # sequence parallel splits every sequence across the tp ranks, too
            tp.check_tp_degree(dims.tp, {**spec.tp_divisible(args), "seq_len": config.training.seq_len,
                                         "validation.seq_len": validation_shape(config)[1]})


def _check_family(config: JobConfig, spec: ModelSpec, args, dims: ParallelDims, device: str) -> None:
    """The layouts the model family itself refuses (ModelSpec.refusals), the first in one line."""
    layout = RunLayout(tp=dims.tp, cp=dims.cp, ep=dims.ep, pp=dims.pp, dp=dims.dp, device=device,
                       compile=_compiles(config, "model"))
    for what, why in spec.refusals(args, layout):
        raise ConfigError(f"{what} is not supported yet for {spec.name}/{config.model.flavor}: {why}")


def _check_expert_parallel(config: JobConfig, spec: ModelSpec, args, dims: ParallelDims) -> None:
    if config.debug.moe_force_load_balance and not spec.n_experts(args):
        raise ConfigError(f"debug.moe_force_load_balance: {spec.name}/{config.model.flavor} has no experts")
    if config.parallelism.expert_capacity_factor is not None and not spec.n_experts(args):
        raise ConfigError(f"parallelism.expert_capacity_factor: {spec.name}/{config.model.flavor} has no experts")
    etp = config.parallelism.expert_tensor_parallel_degree
    if etp not in (1, dims.tp):  # torchtitan 0.2: etp = tp (experts split like the rest) or 1 (tp joins ep)
        raise ConfigError(f"parallelism.expert_tensor_parallel_degree {etp} must be 1 or tensor_parallel_degree {dims.tp}")
    if not dims.ep_enabled:
        return  # the routed experts follow tensor_parallel_degree, whatever etp says (torchtitan: no effect)
    experts = spec.n_experts(args)
    if not experts:
        raise ConfigError(f"parallelism.expert_parallel_degree {dims.ep}: {spec.name}/{config.model.flavor} has no experts")
    with user_input():
        ep.check_ep_degree(experts, dims.ep)


def attention_plan(config: JobConfig, spec: ModelSpec, args, dims: ParallelDims, device: str) -> AttentionPlan:
    """Kernels by device and mask (tessera.models.choose_kernel). Context parallel takes torch's
    ring on the flash kernel where every layer is plain causal without sinks and the flash kernel
    takes the dtype (CUDA has no fp32 flash); else all-gather-KV, under which each layer's own
    blocked kernel applies its mask to the whole sequence's keys."""
    documents = config.model.attn_mask_type == "block_causal"
    kinds = tuple(spec.attention_kinds(args))
    exchange = None
    if dims.cp_enabled:
        plain = all(plain_causal(mask, documents, sinks) for mask, sinks in kinds)
        fp32_attention = config.training.mixed_precision_param == "float32" and config.training.dtype == "float32"
        exchange = "ring" if plain and not (device == "cuda" and fp32_attention) else "gather"
    kernels = tuple((mask, sinks, "blocked" if exchange == "gather" else choose_kernel(device, mask, documents, sinks))
                    for mask, sinks in kinds)
    par = config.parallelism
    return AttentionPlan(documents, kernels, exchange, par.context_parallel_load_balancer is not None,
                         par.context_parallel_rotate_method)


def traced_on_cpu(plan: JobPlan) -> JobPlan:
    """The plan as the estimator traces it here: on CPU, with the CPU's attention kernels
    (FlexAttention, CUDA's choice for masked layers, has no CPU backward), compile-free."""
    return dataclasses.replace(
        plan, device="cpu", attention=attention_plan(plan.config, plan.spec, plan.model_args, plan.dims, "cpu"),
        compile=dataclasses.replace(plan.compile, blocks=False), loss=dataclasses.replace(plan.loss, compiled=False),
        tensor_parallel=dataclasses.replace(plan.tensor_parallel, async_tp=False))


def _check_layout(config: JobConfig, dims: ParallelDims, device: str, attention: AttentionPlan) -> None:
    """Combinations the trainer cannot run."""
    training = config.training
    if (dims.cp_enabled or dims.pp_enabled) and validation_shape(config) != (training.local_batch_size, training.seq_len):
        raise ConfigError("validation.local_batch_size / validation.seq_len other than training's are not supported with "
                          "context or pipeline parallel yet (their shards and micro-batches follow the training shape)")
    if dims.cp_enabled:
        with user_input():
            cp.check_seq_len(config.training.seq_len, dims.cp, config.parallelism.context_parallel_load_balancer is not None)
        if config.parallelism.context_parallel_rotate_method == "alltoall" and attention.cp_exchange == "gather":
            raise ConfigError("context_parallel_rotate_method alltoall runs torch's ring on the flash kernel, which takes no "
                              "document mask (model.attn_mask_type block_causal), no window, chunk or sink layers, and on "
                              "CUDA no fp32 (training.mixed_precision_param float32): use allgather")
    if config.parallelism.enable_async_tensor_parallel:
        # an inductor pass over symmetric memory, which only CUDA has; elsewhere it would do nothing
        missing = [what for what, ok in (("CUDA", device == "cuda"), ("tensor_parallel_degree > 1", dims.tp_enabled),
                                         ("compile.enable", _compiles(config, "model")))
                   if not ok]
        if missing:
            raise ConfigError("parallelism.enable_async_tensor_parallel needs CUDA and compile.enable with "
                              f"tensor_parallel_degree > 1; missing here: {', '.join(missing)}")
    if config.training.enable_cpu_offload and not dims.fsdp_enabled:
        raise ConfigError("training.enable_cpu_offload needs FSDP (data_parallel_shard_degree > 1)")
    if config.profiling.enable_memory_snapshot and device != "cuda":
        raise ConfigError("profiling.enable_memory_snapshot records the CUDA caching allocator and needs a GPU")


def _check_checkpoint(config: JobConfig, spec: ModelSpec, world_size: int) -> None:
    ckpt = config.checkpoint
    if ckpt.create_seed_checkpoint and world_size != 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint needs a single process, not {world_size}: seed weights are written before any sharding")
    if not ckpt.enable and ckpt.load_step != -1:
        raise ConfigError("checkpoint.load_step needs checkpoint.enable = true")
    semi_sync = config.fault_tolerance.enable and config.fault_tolerance.semi_sync_method
    if "replicas" in ckpt.exclude_from_loading and not semi_sync:
        raise ConfigError("checkpoint.exclude_from_loading 'replicas' names semi-sync fault tolerance's state, which "
                          "this run does not have (fault_tolerance.semi_sync_method)")
    if ckpt.exclude_from_loading and not ckpt.enable and (not ckpt.initial_load_path or ckpt.initial_load_model_only):
        raise ConfigError("checkpoint.exclude_from_loading leaves states out of a resume: it needs checkpoint.enable = "
                          "true (or an initial_load_path with initial_load_model_only = false)")
    if not ckpt.enable and ckpt.last_save_in_hf:
        raise ConfigError("checkpoint.last_save_in_hf needs checkpoint.enable = true")
    _check_checkpoint_switches(config)
    if ckpt.initial_load_in_hf and initial_load_folder(config) is None:
        raise ConfigError("checkpoint.initial_load_in_hf reads a Hugging Face folder: set model.hf_assets_path "
                          "(or checkpoint.initial_load_path)")
    if ckpt.initial_load_in_hf and not ckpt.initial_load_model_only:
        raise ConfigError("checkpoint.initial_load_in_hf loads model weights only: set initial_load_model_only = true")
    if (ckpt.initial_load_in_hf or ckpt.last_save_in_hf) and spec.hf_adapter is None:
        raise ConfigError(f"model {spec.name} has no Hugging Face adapter (checkpoint.initial_load_in_hf/last_save_in_hf)")


def _check_checkpoint_switches(config: JobConfig) -> None:
    """Switches that would change nothing: a run that neither resumes nor saves its checkpoints
    has nothing for load_only, enable_first_step_checkpoint or async_mode to act on; a seed
    checkpoint is a save, which load_only would not stop, of the weights as initialised, before
    any initial checkpoint is read. (export_dtype without an export is let be: torchtitan's Qwen3
    configs set float16 with none, and `--checkpoint.enable` must not refuse them.)"""
    ckpt = config.checkpoint
    if ckpt.load_only and ckpt.create_seed_checkpoint:
        raise ConfigError("checkpoint.load_only never saves, and checkpoint.create_seed_checkpoint only saves: "
                          "set one of them")
    initial = initial_load_folder(config)
    if ckpt.create_seed_checkpoint and initial is not None:
        raise ConfigError(f"checkpoint.create_seed_checkpoint saves the weights as initialised and never reads {initial[0]} "
                          f"{initial[1]}: drop one of them")
    idle = {"load_only": ckpt.load_only, "enable_first_step_checkpoint": ckpt.enable_first_step_checkpoint,
            "async_mode": ckpt.async_mode != "disabled" and not ckpt.create_seed_checkpoint}
    name = next((name for name, on in idle.items() if on), None)
    if not ckpt.enable and name is not None:
        raise ConfigError(f"checkpoint.{name} acts on the run's checkpoints: it needs checkpoint.enable = true")


def _check_fault(config: JobConfig, ranks: int) -> None:
    """An injected fault (debug.fault_at_step) that can fire: a rank of the job, a step it trains."""
    debug = config.debug
    if not debug.fault_at_step:
        return
    if debug.fault_rank >= ranks:
        raise ConfigError(f"debug.fault_rank {debug.fault_rank} is not a rank of this {ranks}-rank job: the fault would never fire")
    if debug.fault_at_step > config.training.steps:
        raise ConfigError(f"debug.fault_at_step {debug.fault_at_step} is after the last step, "
                          f"training.steps {config.training.steps}: the fault would never fire")


def _output_folders(config: JobConfig) -> list[tuple[str, str]]:
    """(key, folder under job.dump_folder) of each output this run writes there."""
    prof, metrics = config.profiling, config.metrics
    return [(key, folder) for key, folder, written in (
        ("checkpoint.folder", config.checkpoint.folder, config.checkpoint.enable or config.checkpoint.create_seed_checkpoint),
        ("profiling.save_traces_folder", prof.save_traces_folder, prof.enable_profiling),
        ("profiling.save_memory_snapshot_folder", prof.save_memory_snapshot_folder, prof.enable_memory_snapshot),
        ("metrics.save_tb_folder", metrics.save_tb_folder, metrics.enable_tensorboard or metrics.enable_wandb),
        ("comm.save_traces_folder", config.comm.save_traces_folder, config.comm.trace_buf_size > 0),
    ) if written]


def _file_in_the_way(folder: Path) -> Path | None:
    """The first of `folder` and its parents that exists and is not a folder: a write under it
    would fail only when the run first writes there, possibly hours in."""
    return next((path for path in (folder, *folder.parents) if path.exists() and not path.is_dir()), None)


def _check_paths(config: JobConfig, notes: list[str] | None) -> None:
    """Paths the run will read exist, the output folder can be one and the optional packages its
    settings need are installed; a check-only plan notes what is missing on this host instead."""
    problems = []
    for key, path in (("training.dataset_path", config.training.dataset_path),
                      ("validation.dataset_path", config.validation.dataset_path if config.validation.enable else "")):
        if path and not Path(path).exists():
            problems.append(f"{key} {path} does not exist")
    initial = initial_load_folder(config)
    if initial is not None and not initial[1].is_dir():
        problems.append(f"{initial[0]} {initial[1]} does not exist or is not a folder")
    dump = Path(config.job.dump_folder)
    if dump.exists() and not dump.is_dir():
        problems.append(f"job.dump_folder {dump} is not a folder")
    else:
        problems += [f"{key} {dump / folder}: {blocker} is a file, not a folder" for key, folder in _output_folders(config)
                     if (blocker := _file_in_the_way(dump / folder)) is not None]
    if config.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        problems.append("metrics.enable_wandb needs the wandb package, which is not installed: pip install wandb")
    if notes is None and problems:
        raise ConfigError(problems[0])
    if notes is not None:
        notes.extend(problems)
