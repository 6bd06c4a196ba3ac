"""The training run: plan, set up, then the loop — steps, logs, validation, profiling, checkpoints.
Each concern lives in a module of its own (data_wiring, optimizer, validation, profiling, banner);
this one wires them in the fixed order and runs the loop."""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from tessera.data import load_tokenizer
from tessera.mesh import (
    Meshes,
    build_meshes,
    data_parallel_rank_and_size,
    destroy_distributed,
    device_type,
    init_distributed,
)
from tessera.trainer import profiling
from tessera.trainer.banner import banner
from tessera.trainer.checkpointing import Checkpointer
from tessera.trainer.config import JobConfig, show_config, user_input
from tessera.trainer.data_wiring import (
    data_source, datasets, finish_loader, tokenising_peers, training_loader, user_batches,
)
from tessera.trainer.family_hooks import FamilyHooks
from tessera.trainer.fault_tolerance import replica_group
from tessera.trainer.ft_plan import replica_subfolder
from tessera.trainer.faults import (
    StopSignals, any_rank, inject_fault, stalled_collective, tighten_timeouts,
)
from tessera.trainer.metrics import (
    MetricLogger, StepTimer, all_reduce_scalar, cuda_memory_stats, memory_gib, metric_sinks, peak_tflops,
)
from tessera.trainer.optimizer import build_optimizers
from tessera.trainer.parallelize import build_parallel_model
from tessera.trainer.plan import JobPlan, make_plan, tokenizer_source
from tessera.trainer.run_summary import run_summary
from tessera.trainer.step import SkippedSteps, StepResult, build_loss, make_train_step, step_functions
from tessera.trainer.validation import validation_runner


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


def _flight_recorder(config: JobConfig) -> None:
    """NCCL keeps its last trace_buf_size collectives per rank and dumps them when one times
    out, into job.dump_folder/comm.save_traces_folder/<prefix><rank>: which rank stalled where
    (a replica group's in replica_<id>/: its ranks' numbers are the other groups'). Set before
    the process group exists; the user's own environment wins."""
    comm = config.comm
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(comm.trace_buf_size))
    if comm.trace_buf_size > 0:
        folder = Path(config.job.dump_folder) / comm.save_traces_folder / replica_subfolder(config)
        folder.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(folder / comm.save_traces_file_prefix))


def train(config: JobConfig, command_line: Sequence[str] = ()) -> list[dict]:
    """Runs the job; returns the metrics of every logged step (loss, grad_norm, lr, ...).
    `command_line`: the options `config` was loaded with, for the plan's warnings."""
    device = device_type()
    if device == "cuda":
        _flight_recorder(config)
    owns_process_group = not dist.is_initialized()  # a caller's group (tests, benchmarks) stays up
    info = init_distributed(device, timeout_s=config.comm.init_timeout_seconds)
    try:
        history = _train(make_plan(config, info.world_size, device, command_line=command_line), info)
    except BaseException:
        if owns_process_group and dist.is_initialized():
            dist.destroy_process_group()  # no barrier: a failed or stalled peer would turn it into a second error
        raise
    if owns_process_group:
        destroy_distributed()
    return history


def collect_garbage(step: int, training, say: bool) -> None:
    """With gc_debug every step in full (a cycle shows up at the step that made it), else the
    young generations every gc_freq steps, at the same point on every rank."""
    if training.gc_debug:
        found = gc.collect()
        if found and say:
            print(f"gc: step {step}: {found} objects were only reachable through reference cycles", flush=True)
    elif step % training.gc_freq == 0:
        gc.collect(1)


def _train(plan: JobPlan, info) -> list[dict]:
    config, training, device = plan.config, plan.config.training, plan.device
    meshes = build_meshes(plan.dims, device) if dist.is_initialized() else Meshes.single()
    peers = tokenising_peers() if dist.is_initialized() else None
    dp_rank, dp = data_parallel_rank_and_size(plan.dims, info.rank)
    is_logging_rank = info.rank == 0 or config.metrics.save_for_all_ranks or not config.metrics.rank_0_only
    dump = Path(config.job.dump_folder)
    if info.rank == 0:
        dump.mkdir(parents=True, exist_ok=True)
        show_config(config)

    _seed_everything(plan.seed, config.debug.deterministic, config.debug.deterministic_warn_only)
    tokenizer = load_tokenizer(tokenizer_source(config))
    with user_input():
        train_sets, weights, val_dataset = datasets(plan, say=info.rank == 0)
        # with fault tolerance each replica group reads its own share
        loader = training_loader(plan, train_sets, weights, tokenizer, *plan.fault_tolerance.data_shard(dp_rank, dp), peers)

    loss_fn = build_loss(plan)
    model = build_parallel_model(plan, meshes, loss_fn)
    optimizers = build_optimizers(model.parts, plan.optimizer)
    scheduler = optimizers.scheduler
    replicas = replica_group(plan, info.rank, info.world_size, model.parts, loader)  # fault tolerance: torchft
    checkpointer = Checkpointer(replicas.checkpoint_config(config), plan, model.parts, optimizers.per_part, scheduler,
                                loader, info.rank, pp_group=meshes.pp.get_group() if meshes.pp is not None else None,
                                tokenizer=tokenizer, extra_states=replicas.checkpoint_states(),
                                writes=replicas.writes_checkpoints, shared=replicas.shares_checkpoint_folder())
    try:
        with user_input():
            if config.checkpoint.create_seed_checkpoint:
                checkpointer.save_seed()
                checkpointer.close()
                return []
            start_step = checkpointer.restore()
    except BaseException:
        checkpointer.close()  # gives the folder up (a refused resume): another run may take it now
        raise

    forward_backward, evaluate = step_functions(model.parts, model.pipeline, loss_fn, plan, meshes, tokenizer.bos_id)
    family = FamilyHooks(plan, model.parts, meshes)
    train_step = replicas.steps(make_train_step(
        model.parts, optimizers.all, scheduler, forward_backward, plan, (*plan.post_optimizer_hooks, family), pp_mesh=meshes.pp,
        shared_copies=model.pipeline.shared_copies() if model.pipeline is not None else (), replicas=replicas.sync,
    ))
    logger = MetricLogger(
        training.steps, metric_sinks(config, dump, info.rank, is_logging_rank),
        color=not config.metrics.disable_color_printing and sys.stdout.isatty() and not os.environ.get("NO_COLOR"),
        enabled=is_logging_rank,
    )
    peak = peak_tflops(device, plan.precision.param)
    timer = StepTimer(plan.batch.tokens_per_device, plan.flops_per_token, peak, warmup=plan.compile.blocks or plan.loss.compiled)
    if info.rank == 0:
        print(banner(plan, model, peak, tokenizer, data_source(plan)), flush=True)

    def log(step: int, result: StepResult) -> dict:
        memory, memory_peak = memory_gib(device)
        values = {"loss": all_reduce_scalar(result.loss, meshes.loss),
                  "loss_max": all_reduce_scalar(result.loss, meshes.loss, dist.ReduceOp.MAX),
                  "grad_norm": result.grad_norm.item(), "lr": result.lr,
                  "tokens_seen": step * plan.batch.global_tokens, **timer.rates(),
                  "seconds_per_step": timer.seconds_per_step, "memory_gib": memory, "memory_peak_gib": memory_peak,
                  **(cuda_memory_stats() if device == "cuda" else {})}
        values.update(family.metrics())
        warmup = timer.take_warmup()
        if warmup is not None:
            values["compile_warmup_s"] = warmup
            if is_logging_rank:
                print(f"compile warm-up: the first step took {warmup:.1f} s, left out of tokens/s and MFU", flush=True)
        logger.log(step, values, timer.seconds_per_step)
        return {"step": step, **values}

    run_validation = validation_runner(model, evaluate, val_dataset, plan, tokenizer, dp_rank, meshes.loss, peers, logger,
                                       is_logging_rank) if config.validation.enable else None

    start_step = replicas.join(checkpointer, start_step)  # a replica group behind its peers recovers from them
    history, step = [], start_step
    # the per-step flags travel over gloo in host memory: no wait for the device's queued work
    host_group = (None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")) if dist.is_initialized() else None
    skips = SkippedSteps(training.max_skipped_steps, device)
    batches = user_batches(loader)
    stop = StopSignals(config.job.stop_grace_seconds)
    gc.disable()  # collected every gc_freq steps instead, at the same point on every rank
    started, ended = time.perf_counter(), False
    try:
        with (profiling.profiler(config, dump, info.rank, device, start_step) as profiler,
              profiling.memory_snapshots(config, dump, info.rank, start_step) as snapshots):
            timer.restart()
            for step in range(start_step + 1, training.steps + 1):
                collect_garbage(step, training, is_logging_rank)
                inject_fault(config.debug, plan.fault_tolerance.job_rank(info.rank, info.world_size), step,
                             config.comm.train_timeout_seconds)
                result = train_step(batches)
                skips.add(result)  # ordinary steps read nothing back from the device: only log steps do
                timer.step_done()
                # as torchtitan: step 1 logs and validates too, and a checkpoint comes before validation
                if step == 1 or step % config.metrics.log_freq == 0 or step == training.steps:
                    skipped = skips.check(step)
                    if skipped and is_logging_rank:
                        print(skipped, flush=True)
                    history.append(log(step, result))
                    timer.restart()
                checkpointer.after_step(step, last_step=step == training.steps)
                if config.validation.enable and (step == 1 or step % config.validation.freq == 0):
                    history.append(run_validation(step))
                    timer.restart()
                if profiler is not None:  # step N's trace and snapshot hold its log, checkpoint and validation
                    profiler.step()
                if snapshots is not None:
                    snapshots.step_done(step)
                stopping, save_failed = any_rank(host_group, stop.requested(), checkpointer.save_failed())
                if save_failed:
                    checkpointer.close()  # every rank raises the background save's error now, not a save later
                if step < training.steps and stopping:
                    saved = checkpointer.save_now(step)
                    if info.rank == 0:
                        print(f"stopped by {stop.received or 'a stop signal'} after step {step}: "
                              f"{'checkpoint saved' if saved else 'checkpointing is off, nothing saved'}", flush=True)
                    replicas.stopped()
                    break
                if step == start_step + 1 and dist.is_initialized():
                    tighten_timeouts(config.comm.train_timeout_seconds, meshes)
            finish_loader(loader, training, say=is_logging_rank)
        ended = True
    except RuntimeError as e:
        stall = stalled_collective(e, info.rank, step, config.comm.train_timeout_seconds) if step > start_step + 1 else None
        if stall is None:
            raise
        raise stall from None
    finally:
        gc.enable()
        stop.close()
        logger.close()
        checkpointer.close(after_failure=not ended)
        replicas.close()
    if info.rank == 0:
        print(run_summary(history, step - start_step, plan.batch.global_tokens, time.perf_counter() - started,
                          checkpointer.last_saved), flush=True)
    return history
