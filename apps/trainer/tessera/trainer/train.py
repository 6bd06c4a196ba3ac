"""The training run: plan, set up, then the loop — steps, logs, validation, profiling, checkpoints."""

from __future__ import annotations

import contextlib
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from tessera.data import Prefetcher, build_dataloader, distributed_peers, load_dataset, load_tokenizer, parse_mixture
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
from tessera.trainer.faults import StopSignals, TrainingError, stalled_collective, tighten_timeouts
from tessera.trainer.lr_schedule import LockstepSchedulers, build_lr_scheduler
from tessera.trainer.metrics import MetricLogger, StepTimer, all_reduce_mean, memory_gib, peak_tflops
from tessera.trainer.parallelize import ParallelModel, build_parallel_model
from tessera.trainer.plan import JobPlan, make_plan
from tessera.trainer.step import StepResult, build_loss, make_train_step, step_functions


def _seed_everything(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    # fp32 matmuls on tensor cores (TF32, a 10-bit mantissa) unless the run must be
    # deterministic: then fp32 means fp32, comparable with a CPU or another GPU's run
    torch.backends.cuda.matmul.allow_tf32 = not deterministic
    torch.backends.cudnn.allow_tf32 = not deterministic
    # set both ways: a second run in one process (benchmarks, tools/gpu_check) gets its own setting
    torch.use_deterministic_algorithms(deterministic)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def _profiler(config: JobConfig, dump: Path, rank: int, device: str):
    prof = config.profiling
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
def validate(model: ParallelModel, loss, dataset, plan: JobPlan, tokenizer, dp_rank: int, loss_mesh, peers) -> float:
    """Mean loss over validation.steps batches from the start of the validation set; `loss`:
    (inputs, labels) -> a batch's mean loss (step.evaluation_loss)."""
    config, section = plan.config, plan.config.validation
    loader = build_dataloader(
        dataset, tokenizer, config.training.seq_len, config.training.local_batch_size, dp_rank, plan.dims.dp,
        infinite=False, peers=peers,
    )
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
    if count == 0:
        raise ValueError(f"validation dataset {section.dataset_path or section.dataset} is too small for one batch")
    return all_reduce_mean(total / count, loss_mesh)


def train(config: JobConfig) -> list[dict]:
    """Runs the job; returns the metrics of every logged step (loss, grad_norm, lr, ...)."""
    device = device_type()
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


def _tokenising_peers():
    """Every rank walks the same token stream: each tokenises a share of the documents and they
    swap the tokens, over gloo (CPU memory) even when training runs on NCCL."""
    return distributed_peers(None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo"))


def _training_loader(plan: JobPlan, tokenizer, dp_rank: int, dp: int, peers):
    """The training batches: one dataset or a mixture, shuffled unless training.shuffle is off,
    prepared ahead by a background thread when training.dataloader.num_workers > 0. That
    thread's exchanges run on a gloo group of their own, apart from the main thread's."""
    training = plan.config.training
    if training.dataset_mixture:
        paths, weights = zip(*parse_mixture(training.dataset_mixture))
        dataset = [load_dataset(path, text_field=training.dataset_text_field) for path in paths]
    else:
        dataset, weights = load_dataset(plan.dataset, text_field=training.dataset_text_field), None
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


def _banner(plan: JobPlan, model: ParallelModel, peak: float) -> str:
    config, batch = plan.config, plan.batch
    layout = {k: v for k, v in plan.dims.degrees().items() if v > 1} or "single"
    local_params = sum(p.numel() for part in model.parts for p in part.parameters())
    return (
        f"tessera: {plan.spec.name}/{config.model.flavor} {local_params:,} local params | "
        f"{plan.device} x{plan.world_size} {layout} | global batch {batch.global_size} x {batch.seq_len} tokens "
        f"({batch.accumulation} micro-batches) | {config.training.steps} steps | MFU against {peak:,.1f} TFLOP/s, "
        f"attention FLOPs {'halved (causal)' if config.metrics.causal_attention_flops else 'full (mask ignored)'}"
    )


def _train(plan: JobPlan, info) -> list[dict]:
    config, training, device = plan.config, plan.config.training, plan.device
    meshes = build_meshes(plan.dims, device) if dist.is_initialized() else Meshes.single()
    peers = _tokenising_peers() if dist.is_initialized() else None
    dp_rank, dp = data_parallel_rank_and_size(plan.dims, info.rank)
    is_logging_rank = info.rank == 0 or not config.metrics.rank_0_only
    dump = Path(config.job.dump_folder)
    if info.rank == 0:
        dump.mkdir(parents=True, exist_ok=True)
        if config.job.print_args:
            print(json.dumps(to_dict(config), indent=2), flush=True)

    _seed_everything(config.debug.seed, config.debug.deterministic)
    tokenizer = load_tokenizer(config.model.tokenizer_path or None)
    with user_input():
        loader = _training_loader(plan, tokenizer, dp_rank, dp, peers)
        val_dataset = load_dataset(plan.validation_dataset, text_field=training.dataset_text_field) if config.validation.enable else None

    loss_fn = build_loss(plan)
    model = build_parallel_model(plan, meshes, loss_fn)
    optimizers = [_optimizer(part, config) for part in model.parts]  # one per part, as tessera.ckpt saves them
    sched = config.lr_scheduler
    scheduler = LockstepSchedulers([build_lr_scheduler(
        optimizer, training.steps, warmup_steps=sched.warmup_steps, decay_ratio=sched.decay_ratio,
        decay_type=sched.decay_type, min_lr_factor=sched.min_lr_factor,
    ) for optimizer in optimizers])
    checkpointer = Checkpointer(config, plan.spec, plan.model_args, model.parts, optimizers, scheduler, loader, info.rank,
                                pp_group=meshes.pp.get_group() if meshes.pp is not None else None)
    with user_input():
        if config.checkpoint.create_seed_checkpoint:
            checkpointer.save_seed()
            return []
        start_step = checkpointer.restore()

    forward_backward, evaluate = step_functions(model.parts, model.pipeline, loss_fn, plan, meshes, tokenizer.bos_id)
    train_step = make_train_step(
        model.parts, optimizers, scheduler, forward_backward, plan, plan.post_optimizer_hooks, pp_mesh=meshes.pp,
    )
    logger = MetricLogger(
        training.steps, dump / config.metrics.save_tb_folder if config.metrics.enable_tensorboard else None,
        color=not config.metrics.disable_color_printing, enabled=is_logging_rank,
    )
    peak = peak_tflops(device, plan.param_dtype)
    timer = StepTimer(plan.batch.tokens_per_device, plan.flops_per_token, peak, warmup=config.compile.enable)
    if info.rank == 0:
        print(_banner(plan, model, peak), flush=True)

    def log(step: int, result: StepResult) -> dict:
        memory, memory_peak = memory_gib(device)
        values = {"loss": all_reduce_mean(result.loss, meshes.loss), "grad_norm": result.grad_norm.item(),
                  "lr": result.lr, **timer.rates(), "memory_gib": memory, "memory_peak_gib": memory_peak}
        warmup = timer.take_warmup()
        if warmup is not None:
            values["compile_warmup_s"] = warmup
            if is_logging_rank:
                print(f"compile warm-up: the first step took {warmup:.1f} s, left out of tokens/s and MFU", flush=True)
        logger.log(step, values, timer.seconds_per_step)
        return {"step": step, **values}

    def run_validation(step: int) -> dict:
        with user_input():
            val_loss = validate(model, evaluate, val_dataset, plan, tokenizer, dp_rank, meshes.loss, peers)
        if is_logging_rank:
            print(f"validate step {step}: loss {val_loss:.4f}", flush=True)
        logger.scalars(step, {"validation_loss": val_loss})
        return {"step": step, "validation_loss": val_loss}

    history, skipped, step = [], 0, start_step
    batches = _user_batches(loader)
    stop = StopSignals(config.job.stop_grace_seconds, device)
    gc.disable()  # collected every gc_freq steps instead, at the same point on every rank
    try:
        with _profiler(config, dump, info.rank, device) as profiler:
            timer.restart()
            for step in range(start_step + 1, training.steps + 1):
                if step % training.gc_freq == 0:
                    gc.collect(1)
                result = train_step(batches)
                if result.skipped:
                    skipped += 1
                    if skipped > training.max_skipped_steps:
                        raise TrainingError(f"step {step}: gradient norm {result.grad_norm.item()}; {skipped} optimizer steps "
                                            f"skipped, more than training.max_skipped_steps = {training.max_skipped_steps}")
                    if is_logging_rank:
                        print(f"step {step}: gradient norm {result.grad_norm.item()}, optimizer step skipped", flush=True)
                if profiler is not None:
                    profiler.step()
                timer.step_done()
                if step % config.metrics.log_freq == 0 or step == training.steps:
                    history.append(log(step, result))
                    timer.restart()
                if config.validation.enable and step % config.validation.freq == 0:
                    history.append(run_validation(step))
                    timer.restart()
                if config.profiling.enable_memory_snapshot and step % config.profiling.profile_freq == 0:
                    _save_memory_snapshot(config, dump, info.rank, step)
                checkpointer.after_step(step, last_step=step == training.steps)
                if step < training.steps and stop.requested():
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
