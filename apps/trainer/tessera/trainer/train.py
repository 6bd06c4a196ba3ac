"""The training loop: build everything from a JobConfig, train, log, validate, profile."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tessera import fsdp, tp
from tessera.data import build_dataloader, load_dataset, load_tokenizer
from tessera.mesh import (
    build_meshes,
    data_parallel_rank_and_size,
    destroy_distributed,
    device_type,
    init_distributed,
    resolve_parallel_dims,
)
from tessera.models import get_model_spec
from tessera.trainer.checkpointing import Checkpointer
from tessera.trainer.config import ConfigError, JobConfig, to_dict
from tessera.trainer.lr_schedule import build_lr_scheduler
from tessera.trainer.metrics import MetricLogger, memory_gib, peak_tflops
from tessera.trainer.parallelize import DTYPES, check_layout, parallelize


def _model_args(config: JobConfig, spec, vocab_size: int):
    flavors = spec.flavors
    if config.model.flavor not in flavors:
        raise ConfigError(f"model.flavor {config.model.flavor!r} is not a flavor of {spec.name}; choose from {sorted(flavors)}")
    # The tokenizer decides the vocabulary; the run decides how many positions RoPE needs.
    return dataclasses.replace(flavors[config.model.flavor], vocab_size=vocab_size, max_seq_len=config.training.seq_len)


def build_model(spec, args, device: str) -> torch.nn.Module:
    """On CPU the full model is built and initialised before sharding, so every layout starts
    from the single-process weights (DTensor has no cross-rank RNG on CPU). On GPU it is built on
    the meta device and initialised after sharding, so no rank ever holds the whole model."""
    if device == "cpu":
        return spec.build(args)
    with torch.device("meta"):
        return spec.build(args)


def _materialise(model: torch.nn.Module, device: str, cpu_offload: bool) -> None:
    """Allocates and initialises a meta-built model; FSDP-offloaded parameters live on CPU."""
    if device != "cpu":
        model.to_empty(device="cpu" if cpu_offload else device)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device(device))


def dataset_source(section) -> str | None:
    if section.dataset_path:
        return section.dataset_path
    if section.dataset != "default":
        raise ConfigError(f"dataset {section.dataset!r} is not built in: use 'default' or set dataset_path to a file or folder")
    return None


def _accumulation_steps(config: JobConfig, dp: int) -> int:
    local, global_ = config.training.local_batch_size, config.training.global_batch_size
    if global_ <= 0:
        return 1
    if global_ % (local * dp):
        raise ConfigError(
            f"training.global_batch_size {global_} is not a multiple of local_batch_size * data-parallel degree = {local} * {dp}"
        )
    return global_ // (local * dp)


def _seed_everything(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    # fp32 matmuls on tensor cores (TF32), as the fp32 MFU peak assumes
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def _all_reduce_mean(value: torch.Tensor, mesh) -> float:
    if mesh is None:
        return value.item()
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.AVG, group=mesh.get_group())
    return value.item()


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor: under loss parallel the loss is a replicated DTensor."""
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss in fp32 (logits come in the parameter/compute dtype)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _profiler(config: JobConfig, dump: Path, rank: int, device: str):
    prof = config.profiling
    if prof.enable_memory_snapshot and device != "cuda":
        raise ConfigError("profiling.enable_memory_snapshot records the CUDA caching allocator and needs a GPU")
    if prof.enable_memory_snapshot:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    if not prof.enable_profiling:
        return contextlib.nullcontext(None)
    folder = dump / prof.save_traces_folder

    def export(p):
        out = folder / f"iteration_{p.step_num}"
        out.mkdir(parents=True, exist_ok=True)
        p.export_chrome_trace(str(out / f"rank{rank}_trace.json"))

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # One traced step every profile_freq steps, after one warm-up step.
    schedule = torch.profiler.schedule(wait=max(prof.profile_freq - 2, 0), warmup=1, active=1)
    return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=export)


def _save_memory_snapshot(config: JobConfig, dump: Path, rank: int, step: int) -> None:
    folder = dump / config.profiling.save_memory_snapshot_folder / f"iteration_{step}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(folder / f"rank{rank}_memory_snapshot.pickle"))


@torch.no_grad()
def validate(model, dataset, config: JobConfig, tokenizer, dp_rank: int, dp: int, loss_mesh, loss_parallel: bool,
             autocast, device: str) -> float:
    """Mean loss over validation.steps batches from the start of the validation set."""
    section = config.validation
    loader = build_dataloader(
        dataset, tokenizer, config.training.seq_len, config.training.local_batch_size, dp_rank, dp, infinite=False,
    )
    model.eval()
    total, count = torch.zeros(()), 0
    for inputs, labels in loader:
        with autocast(), tp.loss_parallel_context(loss_parallel):
            total += _plain(cross_entropy(model(inputs.to(device)), labels.to(device))).cpu()
        count += 1
        if count == section.steps:
            break
    model.train()
    if count == 0:
        raise ValueError(f"validation dataset {section.dataset_path or section.dataset} is too small for one batch")
    return _all_reduce_mean(total / count, loss_mesh)


def train(config: JobConfig) -> list[dict]:
    """Runs the job; returns the metrics of every logged step (loss, grad_norm, lr, ...)."""
    device = device_type()
    owns_process_group = not dist.is_initialized()  # a caller's group (tests, benchmarks) stays up
    info = init_distributed(device, timeout_s=config.comm.init_timeout_seconds)
    try:
        return _train(config, device, info)
    finally:
        if owns_process_group:
            destroy_distributed()


def _train(config: JobConfig, device: str, info) -> list[dict]:
    par, training = config.parallelism, config.training
    dims = resolve_parallel_dims(
        info.world_size, dp_replicate=par.data_parallel_replicate_degree,
        dp_shard=par.data_parallel_shard_degree, tp=par.tensor_parallel_degree,
    )
    check_layout(config, dims, device)
    meshes = build_meshes(dims, device) if dist.is_initialized() else {}
    dp_rank, dp = data_parallel_rank_and_size(dims, info.rank)
    accumulation = _accumulation_steps(config, dp)
    is_logging_rank = info.rank == 0 or not config.metrics.rank_0_only
    dump = Path(config.job.dump_folder)
    if info.rank == 0:
        dump.mkdir(parents=True, exist_ok=True)
        if config.job.print_args:
            print(json.dumps(to_dict(config), indent=2), flush=True)

    _seed_everything(config.debug.seed, config.debug.deterministic)
    tokenizer = load_tokenizer(config.model.tokenizer_path or None)
    spec = get_model_spec(config.model.name)
    args = _model_args(config, spec, tokenizer.vocab_size)
    dataset = load_dataset(dataset_source(training), text_field=training.dataset_text_field)
    val_dataset = (
        load_dataset(dataset_source(config.validation), text_field=training.dataset_text_field)
        if config.validation.enable else None
    )
    loader = build_dataloader(dataset, tokenizer, training.seq_len, training.local_batch_size, dp_rank, dp)

    model = parallelize(build_model(spec, args, device), spec, args, config, dims, meshes, device)
    _materialise(model, device, training.enable_cpu_offload)
    opt = config.optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay,
        foreach=opt.implementation == "foreach", fused=opt.implementation == "fused",
    )
    sched = config.lr_scheduler
    scheduler = build_lr_scheduler(
        optimizer, training.steps, warmup_steps=sched.warmup_steps, decay_ratio=sched.decay_ratio,
        decay_type=sched.decay_type, min_lr_factor=sched.min_lr_factor,
    )
    checkpointer = Checkpointer(config, spec, args, model, optimizer, scheduler, loader, dp_rank, info.rank, info.world_size)
    if config.checkpoint.create_seed_checkpoint:
        checkpointer.save_seed()
        return []
    start_step = checkpointer.restore()

    compute_dtype = DTYPES[training.mixed_precision_param]
    # FSDP casts parameters itself (MixedPrecisionPolicy); elsewhere autocast gives bf16 compute.
    use_autocast = compute_dtype != torch.float32 and not dims.fsdp_enabled

    def autocast():
        return torch.autocast(device, dtype=compute_dtype) if use_autocast else contextlib.nullcontext()

    loss_parallel = dims.tp_enabled and not par.disable_loss_parallel
    loss_fn = torch.compile(cross_entropy) if config.compile.enable and "loss" in config.compile.components else cross_entropy
    loss_mesh = meshes.get("dp_cp")
    flops_per_token = spec.flops_per_token(args, training.seq_len)
    peak = peak_tflops(device, compute_dtype) * 1e12
    # Per device, as torchtitan reports: the tp (and cp, pp) ranks of one dp rank share its tokens.
    tokens_per_step = training.local_batch_size * training.seq_len * accumulation / (dims.tp * dims.cp * dims.pp)
    logger = MetricLogger(
        training.steps,
        dump / config.metrics.save_tb_folder if config.metrics.enable_tensorboard else None,
        color=not config.metrics.disable_color_printing,
        enabled=is_logging_rank,
    )
    if info.rank == 0:
        print(
            f"tessera: {spec.name}/{config.model.flavor} {sum(p.numel() for p in model.parameters()):,} local params | "
            f"{device} x{info.world_size} {dict((k, v) for k, v in dims.degrees().items() if v > 1) or 'single'} | "
            f"global batch {training.local_batch_size * dp * accumulation} x {training.seq_len} tokens "
            f"({accumulation} micro-batches) | {training.steps} steps",
            flush=True,
        )

    history = []
    gc.disable()  # collected every gc_freq steps instead, at the same point on every rank
    window_start, window_steps = time.perf_counter(), 0
    try:
        with _profiler(config, dump, info.rank, device) as profiler:
            for step in range(start_step + 1, training.steps + 1):
                if step % training.gc_freq == 0:
                    gc.collect(1)
                loss_sum = torch.zeros((), device=device)
                for micro in range(accumulation):
                    if isinstance(model, FSDPModule):
                        # reduce-scatter gradients once, after the last micro-batch
                        model.set_requires_gradient_sync(micro == accumulation - 1)
                    inputs, labels = next(loader)
                    inputs, labels = inputs.to(device), labels.to(device)
                    with tp.loss_parallel_context(loss_parallel):
                        with autocast():
                            loss = loss_fn(model(inputs), labels) / accumulation
                        loss.backward()
                    loss_sum += _plain(loss)
                grad_norm = fsdp.clip_grad_norm_(model.parameters(), training.max_norm, error_if_nonfinite=False)
                lr = scheduler.get_last_lr()[0]
                if torch.isfinite(grad_norm):
                    optimizer.step()
                elif is_logging_rank:  # one bad batch must not poison the weights or end the run
                    print(f"step {step}: gradient norm {grad_norm.item()}, optimizer step skipped", flush=True)
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if profiler is not None:
                    profiler.step()
                window_steps += 1

                if step % config.metrics.log_freq == 0 or step == training.steps:
                    seconds = (time.perf_counter() - window_start) / window_steps
                    tps = tokens_per_step / seconds
                    mem, mem_peak = memory_gib(device)
                    values = {
                        "loss": _all_reduce_mean(loss_sum, loss_mesh),
                        "grad_norm": grad_norm.item(),
                        "lr": lr,
                        "tps": tps,
                        "tflops": flops_per_token * tps / 1e12,
                        "mfu_pct": 100 * flops_per_token * tps / peak,
                        "memory_gib": mem,
                        "memory_peak_gib": mem_peak,
                    }
                    logger.log(step, values, seconds)
                    history.append({"step": step, **values})
                    window_start, window_steps = time.perf_counter(), 0

                if config.validation.enable and step % config.validation.freq == 0:
                    val_loss = validate(model, val_dataset, config, tokenizer, dp_rank, dp, loss_mesh, loss_parallel,
                                        autocast, device)
                    if is_logging_rank:
                        print(f"validate step {step}: loss {val_loss:.4f}", flush=True)
                    logger.scalars(step, {"validation_loss": val_loss})
                    history.append({"step": step, "validation_loss": val_loss})
                    window_start, window_steps = time.perf_counter(), 0
                if config.profiling.enable_memory_snapshot and step % config.profiling.profile_freq == 0:
                    _save_memory_snapshot(config, dump, info.rank, step)
                checkpointer.after_step(step, last_step=step == training.steps)
    finally:
        gc.enable()
        logger.close()
        checkpointer.close()
    return history
