"""The training run: plan, set up, then the loop — steps, logs, validation, profiling, checkpoints."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tessera.data import (
    HELD_OUT_FRACTION, Prefetcher, build_dataloader, distributed_peers, load_dataset, load_tokenizer, parse_mixture,
    split_held_out,
)
from tessera.mesh import (
    Meshes,
    build_meshes,
    data_parallel_rank_and_size,
    destroy_distributed,
    device_type,
    init_distributed,
)
from tessera.trainer.checkpointing import Checkpointer
from tessera.trainer.config import JobConfig, to_dict, user_input
from tessera.trainer.family_hooks import FamilyHooks
from tessera.trainer.faults import (
    StopSignals, any_rank, inject_fault, stalled_collective, tighten_timeouts,
)
from tessera.trainer.lr_schedule import LockstepSchedulers, build_lr_scheduler
from tessera.trainer.metrics import MetricLogger, StepTimer, all_reduce_mean, memory_gib, peak_tflops
from tessera.trainer.parallelize import ParallelModel, build_parallel_model
from tessera.trainer.plan import JobPlan, make_plan, tokenizer_source, validation_shape
from tessera.trainer.step import SkippedSteps, StepResult, build_loss, make_train_step, step_functions


def _seed_everything(seed: int, deterministic: bool, warn_only: bool = False) -> None:
    torch.manual_seed(seed)
    # fp32 matmuls on tensor cores (TF32, a 10-bit mantissa) unless the run must be
    # deterministic: then fp32 means fp32, comparable with a CPU or another GPU's run
    torch.backends.cuda.matmul.allow_tf32 = not deterministic
    torch.backends.cudnn.allow_tf32 = not deterministic
    # set both ways: a second run in one process (benchmarks, tools/gpu_check) gets its own setting
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def _profiler(config: JobConfig, dump: Path, rank: int, device: str, start_step: int):
    """torch.profiler over the loop, its cycles counted in training steps (a resumed run's too)."""
    prof = config.profiling
    if prof.enable_memory_snapshot:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    if not prof.enable_profiling:
        return contextlib.nullcontext(None)
    folder = dump / prof.save_traces_folder
    # Kineto prints a line at every trace start and stop unless told otherwise; keep the log clean
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    # each cycle's trace is written by export() before the next starts: clearing is what we want
    warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")
    warnings.filterwarnings("ignore", message="Profiler won't be using warmup")  # profiler_warmup 0 asks for that

    def export(p):
        if p.step_num % prof.profile_freq:  # the run ended inside a cycle: no partial trace
            return
        out = folder / f"iteration_{p.step_num}"
        out.mkdir(parents=True, exist_ok=True)
        p.export_chrome_trace(str(out / f"rank{rank}_trace.json"))

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities, schedule=profile_schedule(prof), on_trace_ready=export)
    profiler.step_num = start_step
    return profiler


def profile_schedule(prof) -> torch.profiler.schedule:
    """Traces of profiler_active steps ending at every multiple of profile_freq, each after
    profiler_warmup unrecorded steps, as torchtitan: with freq 10, warm-up 3 and active 1, steps
    10, 20, ... are traced. Only complete cycles: none cut short at the end of the run. The
    warm-up and active steps must fit in one period."""
    freq, warmup, active = prof.profile_freq, prof.profiler_warmup, prof.profiler_active
    return torch.profiler.schedule(wait=freq - warmup - active, warmup=warmup, active=active)


def _save_memory_snapshot(config: JobConfig, dump: Path, rank: int, step: int) -> None:
    folder = dump / config.profiling.save_memory_snapshot_folder / f"iteration_{step}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(folder / f"rank{rank}_memory_snapshot.pickle"))


@torch.no_grad()
def validate(model: ParallelModel, loss, dataset, plan: JobPlan, tokenizer, dp_rank: int, loss_mesh, peers) -> float:
    """Mean loss over validation.steps batches from the start of the validation set; `loss`:
    (inputs, labels) -> a batch's mean loss (step.evaluation_loss)."""
    config, section = plan.config, plan.config.validation
    batch_size, seq_len = validation_shape(config)
    loader = build_dataloader(dataset, tokenizer, seq_len, batch_size, dp_rank, plan.dims.dp, infinite=False, peers=peers)
    workers = section.dataloader.num_workers
    if workers:
        loader = Prefetcher(loader, workers * (section.dataloader.prefetch_factor or 2),
                            pin_memory=section.dataloader.pin_memory and plan.device == "cuda")
    for part in model.parts:
        part.eval()
    total, count = torch.zeros(()), 0
    for inputs, labels in loader:
        total += loss(inputs.to(plan.device), labels.to(plan.device)).cpu()
        count += 1
        if count == section.steps:
            break
    for part in model.parts:
        part.train()
    if isinstance(loader, Prefetcher):
        loader.close()
    if count == 0:
        raise ValueError(f"validation dataset {dataset.source} is too small for one batch")
    return all_reduce_mean(total / count, loss_mesh)


def _flight_recorder(config: JobConfig) -> None:
    """NCCL keeps its last trace_buf_size collectives per rank and dumps them when one times
    out, into job.dump_folder/comm.save_traces_folder/<prefix><rank>: which rank stalled where.
    Set before the process group exists; the user's own environment wins."""
    comm = config.comm
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(comm.trace_buf_size))
    if comm.trace_buf_size > 0:
        folder = Path(config.job.dump_folder) / comm.save_traces_folder
        folder.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(folder / comm.save_traces_file_prefix))


def train(config: JobConfig) -> list[dict]:
    """Runs the job; returns the metrics of every logged step (loss, grad_norm, lr, ...)."""
    device = device_type()
    if device == "cuda":
        _flight_recorder(config)
    owns_process_group = not dist.is_initialized()  # a caller's group (tests, benchmarks) stays up
    info = init_distributed(device, timeout_s=config.comm.init_timeout_seconds)
    try:
        history = _train(make_plan(config, info.world_size, device), info)
    except BaseException:
        if owns_process_group and dist.is_initialized():
            dist.destroy_process_group()  # no barrier: a failed or stalled peer would turn it into a second error
        raise
    if owns_process_group:
        destroy_distributed()
    return history


def _tensorboard_folder(config: JobConfig, dump: Path, rank: int) -> Path:
    """Each run's events in a folder of its own, named by rank 0's start time, so a rerun's
    curves do not mix with the last one's; with save_for_all_ranks, one sub-folder per rank."""
    stamp = [time.strftime("%Y%m%d-%H%M%S")]
    if dist.is_initialized():
        dist.broadcast_object_list(stamp, src=0)
    folder = dump / config.metrics.save_tb_folder / stamp[0]
    all_ranks = config.metrics.save_for_all_ranks or not config.metrics.rank_0_only
    return folder / f"rank_{rank}" if all_ranks else folder


def _tokenising_peers():
    """Every rank walks the same token stream: each tokenises a share of the documents and they
    swap the tokens, over gloo (CPU memory) even when training runs on NCCL."""
    return distributed_peers(None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo"))


def _same_source(a: str | None, b: str | None) -> bool:
    """Two dataset sources (None: the embedded corpus) name the same data."""
    return a == b or (a is not None and b is not None and Path(a).resolve() == Path(b).resolve())


def _datasets(plan: JobPlan, say: bool) -> tuple[list, tuple[float, ...] | None, object]:
    """The training datasets, their mixture weights (None: one dataset) and the validation set
    (None: validation off). Validating on a training dataset holds its last documents out of
    training (tessera.data.split_held_out); another validation dataset is used whole."""
    config, field = plan.config, plan.config.training.dataset_text_field
    sources, weights = [plan.dataset], None
    if config.training.dataset_mixture:
        sources, weights = zip(*parse_mixture(config.training.dataset_mixture))
    datasets = [load_dataset(source, text_field=field) for source in sources]
    if not config.validation.enable:
        return datasets, weights, None
    shared = [i for i, source in enumerate(sources) if _same_source(source, plan.validation_dataset)]
    if shared:
        note = f"held-out {HELD_OUT_FRACTION:.0%} of {datasets[shared[0]].source}"
        for i in shared:
            datasets[i], validation = split_held_out(datasets[i])
        note += f" ({len(validation)} documents), excluded from training"
    else:
        validation = load_dataset(plan.validation_dataset, text_field=field)
        note = f"{validation.source} ({len(validation)} documents), apart from the training data"
    if say:
        print(f"validation: {note}", flush=True)
    return datasets, weights, validation


def _training_loader(plan: JobPlan, datasets: list, weights, tokenizer, dp_rank: int, dp: int, peers):
    """The training batches: one dataset or a mixture, shuffled unless training.shuffle is off,
    prepared ahead by a background thread when training.dataloader.num_workers > 0. That
    thread's exchanges run on a gloo group of their own, apart from the main thread's."""
    training = plan.config.training
    dataset = datasets[0] if weights is None else datasets
    workers = training.dataloader.num_workers
    if workers and peers is not None:
        peers = distributed_peers(dist.new_group(backend="gloo"))
    loader = build_dataloader(
        dataset, tokenizer, training.seq_len, training.local_batch_size, dp_rank, dp, peers=peers, weights=weights,
        seed=plan.config.debug.seed, shuffle=training.shuffle, shuffle_buffer=training.shuffle_buffer,
    )
    if not workers:
        return loader
    depth = workers * (training.dataloader.prefetch_factor or 2)
    return Prefetcher(loader, depth, pin_memory=training.dataloader.pin_memory and plan.device == "cuda")


def _user_batches(loader):
    """The loader's batches; a fault of the data found only while reading it (a text shorter
    than one sequence) is the user's input and reported as such."""
    while True:
        with user_input():
            batch = next(loader)
        yield batch


def _optimizer(part: torch.nn.Module, config: JobConfig) -> torch.optim.Optimizer:
    opt = config.optimizer
    return torch.optim.AdamW(
        part.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay,
        foreach=opt.implementation == "foreach", fused=opt.implementation == "fused",
    )


def _data_source(plan: JobPlan) -> str:
    training = plan.config.training
    if training.dataset_mixture:
        return "mixture " + ", ".join(training.dataset_mixture)
    return plan.dataset or "the embedded corpus"


def _banner(plan: JobPlan, model: ParallelModel, peak: float, tokenizer, data_source: str) -> str:
    """What the run is, in a few lines: enough to tell two runs' logs apart."""
    from tessera.trainer.cli_info import version_text

    config, batch, training, sched = plan.config, plan.batch, plan.config.training, plan.config.lr_scheduler
    layout = {k: v for k, v in plan.dims.degrees().items() if v > 1} or "single"
    # this rank's share: a sharded parameter (DTensor) counts its local shard
    local_params = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for part in model.parts for p in part.parameters())
    ac = config.activation_checkpoint
    decay = "every step after warm-up" if sched.decay_ratio is None else f"the last {sched.decay_ratio:.0%} of the steps"
    return "\n".join([
        f"tessera: {plan.spec.name}/{config.model.flavor} | {local_params:,} parameters on this rank | "
        f"{plan.device} x{plan.world_size} {layout} | {config.training.steps} steps",
        f"  data: {data_source} | tokenizer {tokenizer.name} ({tokenizer.vocab_size:,} ids) | global batch "
        f"{batch.global_size} x {batch.seq_len} tokens ({batch.accumulation} micro-batches)",
        f"  dtype: parameters {training.dtype}, compute {training.mixed_precision_param}, reduce "
        f"{training.mixed_precision_reduce} | AC {ac.mode}{f' ({ac.selective_ac_option})' if ac.mode == 'selective' else ''} | "
        f"compile {'on' if config.compile.enable else 'off'}",
        f"  attention: {plan.attention.describe()}",
        f"  lr: {config.optimizer.name} {config.optimizer.lr:g}, {sched.warmup_steps} warm-up steps, {sched.decay_type} decay "
        f"over {decay} to {sched.min_lr_factor:g}x",
        f"  MFU against {peak:,.1f} TFLOP/s, attention FLOPs "
        f"{'halved (causal)' if config.metrics.causal_attention_flops else 'full (mask ignored)'} | output {config.job.dump_folder}",
        f"  {version_text()}",
    ])


def _train(plan: JobPlan, info) -> list[dict]:
    config, training, device = plan.config, plan.config.training, plan.device
    meshes = build_meshes(plan.dims, device) if dist.is_initialized() else Meshes.single()
    peers = _tokenising_peers() if dist.is_initialized() else None
    dp_rank, dp = data_parallel_rank_and_size(plan.dims, info.rank)
    is_logging_rank = info.rank == 0 or config.metrics.save_for_all_ranks or not config.metrics.rank_0_only
    dump = Path(config.job.dump_folder)
    if info.rank == 0:
        dump.mkdir(parents=True, exist_ok=True)
        if config.job.print_config or config.job.print_args:
            print(json.dumps(to_dict(config), indent=2), flush=True)
        if config.job.save_config_file:
            saved = dump / config.job.save_config_file
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps(to_dict(config), indent=2))

    _seed_everything(config.debug.seed, config.debug.deterministic, config.debug.deterministic_warn_only)
    tokenizer = load_tokenizer(tokenizer_source(config))
    with user_input():
        datasets, weights, val_dataset = _datasets(plan, say=info.rank == 0)
        loader = _training_loader(plan, datasets, weights, tokenizer, dp_rank, dp, peers)

    loss_fn = build_loss(plan)
    model = build_parallel_model(plan, meshes, loss_fn)
    optimizers = [_optimizer(part, config) for part in model.parts]  # one per part, as tessera.ckpt saves them
    sched = config.lr_scheduler
    scheduler = LockstepSchedulers([build_lr_scheduler(
        optimizer, sched.total_steps or training.steps, warmup_steps=sched.warmup_steps, decay_ratio=sched.decay_ratio,
        decay_type=sched.decay_type, min_lr_factor=sched.min_lr_factor,
    ) for optimizer in optimizers])
    checkpointer = Checkpointer(config, plan.spec, plan.model_args, model.parts, optimizers, scheduler, loader, info.rank,
                                pp_group=meshes.pp.get_group() if meshes.pp is not None else None, tokenizer=tokenizer)
    with user_input():
        if config.checkpoint.create_seed_checkpoint:
            checkpointer.save_seed()
            return []
        start_step = checkpointer.restore()

    forward_backward, evaluate = step_functions(model.parts, model.pipeline, loss_fn, plan, meshes, tokenizer.bos_id)
    family = FamilyHooks(plan, model.parts, meshes)
    train_step = make_train_step(
        model.parts, optimizers, scheduler, forward_backward, plan, (*plan.post_optimizer_hooks, family), pp_mesh=meshes.pp,
    )
    logger = MetricLogger(
        training.steps, _tensorboard_folder(config, dump, info.rank) if config.metrics.enable_tensorboard else None,
        color=not config.metrics.disable_color_printing and sys.stdout.isatty() and not os.environ.get("NO_COLOR"),
        enabled=is_logging_rank,
    )
    peak = peak_tflops(device, plan.param_dtype)
    timer = StepTimer(plan.batch.tokens_per_device, plan.flops_per_token, peak, warmup=config.compile.enable)
    if info.rank == 0:
        print(_banner(plan, model, peak, tokenizer, _data_source(plan)), flush=True)

    def log(step: int, result: StepResult) -> dict:
        memory, memory_peak = memory_gib(device)
        values = {"loss": all_reduce_mean(result.loss, meshes.loss), "grad_norm": result.grad_norm.item(),
                  "lr": result.lr, **timer.rates(), "memory_gib": memory, "memory_peak_gib": memory_peak}
        values.update(family.metrics())
        warmup = timer.take_warmup()
        if warmup is not None:
            values["compile_warmup_s"] = warmup
            if is_logging_rank:
                print(f"compile warm-up: the first step took {warmup:.1f} s, left out of tokens/s and MFU", flush=True)
        logger.log(step, values, timer.seconds_per_step)
        return {"step": step, **values}

    val_peers = peers  # a prefetching validation loader exchanges tokens on a group of its own
    if config.validation.enable and config.validation.dataloader.num_workers and peers is not None:
        val_peers = distributed_peers(dist.new_group(backend="gloo"))

    def run_validation(step: int) -> dict:
        with user_input():
            val_loss = validate(model, evaluate, val_dataset, plan, tokenizer, dp_rank, meshes.loss, val_peers)
        if is_logging_rank:
            print(f"validate step {step}: loss {val_loss:.4f}", flush=True)
        logger.scalars(step, {"validation_loss": val_loss})
        return {"step": step, "validation_loss": val_loss}

    history, step = [], start_step
    # the per-step flags travel over gloo in host memory: no wait for the device's queued work
    host_group = (None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")) if dist.is_initialized() else None
    skips = SkippedSteps(training.max_skipped_steps, device)
    batches = _user_batches(loader)
    stop = StopSignals(config.job.stop_grace_seconds)
    gc.disable()  # collected every gc_freq steps instead, at the same point on every rank
    try:
        with _profiler(config, dump, info.rank, device, start_step) as profiler:
            timer.restart()
            for step in range(start_step + 1, training.steps + 1):
                if training.gc_debug:  # every step, in full: a cycle shows up at the step that made it
                    found = gc.collect()
                    if found and is_logging_rank:
                        print(f"gc: step {step}: {found} objects were only reachable through reference cycles", flush=True)
                elif step % training.gc_freq == 0:
                    gc.collect(1)
                inject_fault(config.debug, info.rank, step, config.comm.train_timeout_seconds)
                result = train_step(batches)
                skips.add(result)  # ordinary steps read nothing back from the device: only log steps do
                if profiler is not None:
                    profiler.step()
                timer.step_done()
                # as torchtitan: step 1 logs and validates too, and a checkpoint comes before validation
                if step == 1 or step % config.metrics.log_freq == 0 or step == training.steps:
                    skipped = skips.check(step)
                    if skipped and is_logging_rank:
                        print(skipped, flush=True)
                    history.append(log(step, result))
                    timer.restart()
                if config.profiling.enable_memory_snapshot and step % config.profiling.profile_freq == 0:
                    _save_memory_snapshot(config, dump, info.rank, step)
                checkpointer.after_step(step, last_step=step == training.steps)
                if config.validation.enable and (step == 1 or step % config.validation.freq == 0):
                    history.append(run_validation(step))
                    timer.restart()
                stopping, save_failed = any_rank(host_group, stop.received is not None, checkpointer.save_failed())
                if save_failed:
                    checkpointer.close()  # every rank raises the background save's error now, not a save later
                if step < training.steps and stopping:
                    saved = checkpointer.save_now(step)
                    if info.rank == 0:
                        print(f"stopped by {stop.received or 'a stop signal'} after step {step}: "
                              f"{'checkpoint saved' if saved else 'checkpointing is off, nothing saved'}", flush=True)
                    break
                if step == start_step + 1 and dist.is_initialized():
                    tighten_timeouts(config.comm.train_timeout_seconds, meshes)
            if training.dataset_mixture and is_logging_rank:
                shares = ", ".join(f"{name} {share:.3f}" for name, share in loader.realised_proportions().items())
                print(f"data: realised mixture {shares} (weights {training.dataset_mixture})", flush=True)
            if isinstance(loader, Prefetcher):
                loader.close()  # before the process group goes; collective-safe, see tessera.data.prefetch
    except RuntimeError as e:
        stall = stalled_collective(e, info.rank, step, config.comm.train_timeout_seconds) if step > start_step + 1 else None
        if stall is None:
            raise
        raise stall from None
    finally:
        gc.enable()
        stop.close()
        logger.close()
        checkpointer.close()
    return history
