"""torch.profiler traces and CUDA memory snapshots over the training loop, their cycles
counted in training steps (a resumed run's too), as torchtitan's [profiling] keys say. Both
advance at the end of each loop iteration, so step N's trace and snapshot hold all of step N:
its training step, log, checkpoint and validation. Under fault tolerance each replica group's go
to iteration_<N>/replica_<id>/ (its ranks' names are the other groups'), as torchtitan's
fault-tolerant trainer writes them."""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import torch

from tessera.trainer.config import JobConfig
from tessera.trainer.ft_plan import replica_subfolder


def profiler(config: JobConfig, dump: Path, rank: int, device: str, start_step: int):
    """torch.profiler over the loop, its cycles counted in training steps (a resumed run's too);
    with the ops' input shapes, as torchtitan records them."""
    prof = config.profiling
    if not prof.enable_profiling:
        return contextlib.nullcontext(None)
    folder, group = dump / prof.save_traces_folder, replica_subfolder(config)
    # Kineto prints a line at every trace start and stop unless told otherwise; keep the log clean
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    # each cycle's trace is written by export() before the next starts: clearing is what we want
    warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")
    warnings.filterwarnings("ignore", message="Profiler won't be using warmup")  # profiler_warmup 0 asks for that

    def export(p):
        if p.step_num % prof.profile_freq:  # the run ended inside a cycle: no partial trace
            return
        out = folder / f"iteration_{p.step_num}" / group
        out.mkdir(parents=True, exist_ok=True)
        p.export_chrome_trace(str(out / f"rank{rank}_trace.json"))

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities, schedule=profile_schedule(prof), on_trace_ready=export,
                                      record_shapes=True)
    profiler.step_num = start_step
    return profiler


def profile_schedule(prof) -> torch.profiler.schedule:
    """Traces of profiler_active steps ending at every multiple of profile_freq, each after
    profiler_warmup unrecorded steps, as torchtitan: with freq 10, warm-up 3 and active 1, steps
    10, 20, ... are traced. Only complete cycles: none cut short at the end of the run. The
    warm-up and active steps must fit in one period."""
    freq, warmup, active = prof.profile_freq, prof.profiler_warmup, prof.profiler_active
    return torch.profiler.schedule(wait=freq - warmup - active, warmup=warmup, active=active)


class MemorySnapshots:
    """The CUDA allocator's history, recorded from the loop's start and dumped to
    save_memory_snapshot_folder/iteration_<step>/[replica_<id>/]rank<r>_memory_snapshot.pickle."""

    def __init__(self, config: JobConfig, dump: Path, rank: int, start_step: int):
        self.folder, self.group = dump / config.profiling.save_memory_snapshot_folder, replica_subfolder(config)
        self.rank, self.freq, self.last_step = rank, config.profiling.profile_freq, start_step
        torch.cuda.memory._record_memory_history(max_entries=100_000)

    def step_done(self, step: int) -> None:
        """At the end of each loop iteration: a snapshot after every profile_freq-th step."""
        self.last_step = step
        if step % self.freq == 0:
            self.dump(f"iteration_{step}")

    def dump(self, name: str) -> None:
        folder = self.folder / name / self.group
        folder.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(folder / f"rank{self.rank}_memory_snapshot.pickle"))


@contextlib.contextmanager
def memory_snapshots(config: JobConfig, dump: Path, rank: int, start_step: int):
    """MemorySnapshots over the loop (None unless profiling.enable_memory_snapshot). A step that
    runs out of memory leaves one more, iteration_<last completed step>_exit, as torchtitan's: the
    snapshot an OOM is debugged from."""
    if not config.profiling.enable_memory_snapshot:
        yield None
        return
    snapshots = MemorySnapshots(config, dump, rank, start_step)
    try:
        yield snapshots
    except torch.OutOfMemoryError:
        snapshots.dump(f"iteration_{snapshots.last_step}_exit")
        raise
