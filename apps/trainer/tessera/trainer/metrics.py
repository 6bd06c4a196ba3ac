"""Throughput, MFU, memory and the log sinks (console line, TensorBoard, Weights & Biases)."""

from __future__ import annotations

import dataclasses
import functools
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tessera.trainer.config import JobConfig
from tessera.trainer.ft_plan import replica_subfolder
from tessera.trainer.gpus import datasheet

def datasheet_peak_tflops(gpu_name: str) -> float | None:
    """The dense bf16 peak of the most specific data-sheet entry in `gpu_name` (tessera.trainer.gpus),
    or None if unknown."""
    gpu = datasheet(gpu_name)
    return gpu.tflops["bfloat16"] if gpu is not None else None


@functools.lru_cache(maxsize=None)
def measured_peak_tflops(device: str, dtype: torch.dtype, repeats: int = 5, long_s: float = 0.01) -> float:
    """Best matmul rate reached here: the MFU denominator where no data sheet applies (CPU,
    where AVX-512 BF16 makes bf16 several times faster than fp32; an unknown GPU; fp32 with
    TF32 off). It honours the current TF32 setting and thread count. The matrices grow from 256
    until one product takes `long_s` (or reaches 2048 on CPU, 8192 on CUDA): a CPU without
    native bf16 multiplies bf16 some 50x slower than fp32, where a fixed 2048 costs minutes. Every
    trainer process measures once, so it must be quick: 10 ms products (one core: 1024, 0.15 s in
    all) reach the rate of 2048's 170 ms ones within a few per cent."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def seconds(a, b):
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        return time.perf_counter() - start

    size, largest = 256, 8192 if device == "cuda" else 2048
    while True:
        a = torch.randn(size, size, dtype=dtype, device=device)
        b = torch.randn(size, size, dtype=dtype, device=device)
        seconds(a, b)  # warm-up: thread pool, kernel selection
        best = seconds(a, b)
        if best >= long_s or size >= largest:
            break
        size *= 2
    best = min([best, *(seconds(a, b) for _ in range(repeats - 1))])
    return 2 * size**3 / best / 1e12


def peak_tflops(device: str, dtype: torch.dtype) -> float:
    """MFU's denominator. A known GPU: its data-sheet peak for bf16 and fp16 (one tensor-core
    rate), half of it for fp32 on TF32 tensor cores; fp32 with TF32 off, CPUs and unknown GPUs
    (with a one-line warning, never a guessed table entry): a measured matmul peak."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
        peak = datasheet_peak_tflops(name)
        if peak is None:
            measured = measured_peak_tflops(device, dtype)
            print(f"warning: no data-sheet peak for GPU {name!r}; MFU uses a measured {dtype} matmul peak of "
                  f"{measured:.0f} TFLOP/s", file=sys.stderr, flush=True)
            return measured
        if dtype in (torch.bfloat16, torch.float16):
            return peak
        if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
            return peak / 2
    return measured_peak_tflops(device, dtype)


def memory_gib(device: str) -> tuple[float, float]:
    """(current, peak) memory in GiB: CUDA allocator on GPU, resident set size on CPU."""
    if device == "cuda":
        return torch.cuda.memory_allocated() / 2**30, torch.cuda.max_memory_allocated() / 2**30
    rss_kib = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kib / 2**20, peak_kib / 2**20


def cuda_memory_stats() -> dict[str, float]:
    """What torchtitan's dashboards chart beside the allocated peak (CUDA only): the caching
    allocator's reserved peak, both peaks as % of the device, its retries and OOMs."""
    stats, total = torch.cuda.memory_stats(), torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    active, reserved = stats.get("active_bytes.all.peak", 0), stats.get("reserved_bytes.all.peak", 0)
    return {"memory_active_peak_gib": active / 2**30, "memory_active_peak_pct": 100 * active / total,
            "memory_reserved_peak_gib": reserved / 2**30, "memory_reserved_peak_pct": 100 * reserved / total,
            "memory_alloc_retries": stats.get("num_alloc_retries", 0), "memory_ooms": stats.get("num_ooms", 0)}


def all_reduce_scalar(value: torch.Tensor, mesh: DeviceMesh | None, op=dist.ReduceOp.AVG) -> float:
    """A per-rank scalar reduced over `mesh` by `op` (None: this rank's value)."""
    if mesh is None:
        return value.item()
    value = value.detach().clone()
    dist.all_reduce(value, op=op, group=mesh.get_group())
    return value.item()


# Each scalar also under torchtitan 0.2.2's TensorBoard tag, so its dashboards read Tessera's runs
# (the README's metric table). torchtitan's data-loading times have no counterpart: batches are
# prefetched off the step.
TORCHTITAN_TAGS = {
    "loss": "loss_metrics/global_avg_loss",
    "loss_max": "loss_metrics/global_max_loss",
    "tokens_seen": "n_tokens_seen",
    "tps": "throughput(tps)",
    "mfu_pct": "mfu(%)",
    "seconds_per_step": "time_metrics/end_to_end(s)",
    "memory_active_peak_gib": "memory/max_active(GiB)",
    "memory_active_peak_pct": "memory/max_active(%)",
    "memory_reserved_peak_gib": "memory/max_reserved(GiB)",
    "memory_reserved_peak_pct": "memory/max_reserved(%)",
    "memory_alloc_retries": "memory/num_alloc_retries",
    "memory_ooms": "memory/num_ooms",
    "validation_loss": "validation_metrics/loss",
}  # grad_norm, tflops and lr have the same names in both


class StepTimer:
    """Throughput over the steps since the last restart: a window that logging and validation
    restart, so neither counts as training time. With `warmup` the first step (where
    torch.compile compiles) is timed on its own and left out of every window."""

    def __init__(self, tokens_per_step: float, flops_per_token: float, peak_tflops: float, warmup: bool = False):
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak_tflops * 1e12
        self.warmup_pending, self.warmup_seconds, self._unreported = warmup, None, False
        self.restart()

    def restart(self) -> None:
        self.start, self.steps = time.perf_counter(), 0

    def step_done(self) -> None:
        if self.warmup_pending:
            self.warmup_pending, self._unreported = False, True
            self.warmup_seconds = time.perf_counter() - self.start
            self.restart()
            return
        self.steps += 1

    def take_warmup(self) -> float | None:
        """The warm-up step's seconds, once, the first time it is asked after that step."""
        if not self._unreported:
            return None
        self._unreported = False
        return self.warmup_seconds

    @property
    def seconds_per_step(self) -> float:
        if self.steps == 0 and self.warmup_seconds is not None:  # only the warm-up step so far
            return self.warmup_seconds
        return (time.perf_counter() - self.start) / max(self.steps, 1)

    def rates(self) -> dict[str, float]:
        """Tokens/s per device, achieved TFLOP/s and MFU (%) of the window."""
        tps = self.tokens_per_step / self.seconds_per_step
        return {"tps": tps, "tflops": self.flops_per_token * tps / 1e12, "mfu_pct": 100 * self.flops_per_token * tps / self.peak}


class _Colors:
    def __init__(self, enabled: bool):
        codes = dict(red="\033[31m", green="\033[32m", yellow="\033[33m", blue="\033[34m", cyan="\033[36m", reset="\033[39m")
        for name, code in codes.items():
            setattr(self, name, code if enabled else "")


def format_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


@dataclasses.dataclass(frozen=True)
class Sink:
    """Where the logged scalars go besides the console: `write(step, {tag: value})` at each log and
    validation step, `close()` once when the run ends, well or not."""

    write: Callable[[int, dict[str, float]], None]
    close: Callable[[], None]


def tensorboard_sink(folder: Path) -> Sink:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(folder))

    def write(step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)

    return Sink(write, writer.close)


def metrics_folder(config: JobConfig, dump: Path, rank: int) -> Path:
    """Each run's TensorBoard events and W&B files in a folder of its own, named by rank 0's start
    time, so a rerun's curves do not mix with the last one's; under fault tolerance one
    sub-folder per replica group (each a job with a rank 0 of its own), as torchtitan's; with
    save_for_all_ranks, one sub-folder per rank. Every rank calls it (a broadcast)."""
    stamp = [time.strftime("%Y%m%d-%H%M%S")]
    if dist.is_initialized():
        dist.broadcast_object_list(stamp, src=0)
    folder = dump / config.metrics.save_tb_folder / stamp[0] / replica_subfolder(config)
    all_ranks = config.metrics.save_for_all_ranks or not config.metrics.rank_0_only
    return folder / f"rank_{rank}" if all_ranks else folder


def metric_sinks(config: JobConfig, dump: Path, rank: int, logging_rank: bool) -> list[Sink]:
    """The sinks the metrics section enables (TensorBoard, W&B, both or none) on the logging ranks,
    in the run's metrics folder. Every rank calls it."""
    metrics = config.metrics
    if not (metrics.enable_tensorboard or metrics.enable_wandb):
        return []
    folder = metrics_folder(config, dump, rank)
    if not logging_rank:
        return []
    sinks = [tensorboard_sink(folder)] if metrics.enable_tensorboard else []
    if metrics.enable_wandb:
        from tessera.trainer.wandb_logger import wandb_sink  # which builds on this module's Sink

        sinks.append(wandb_sink(folder, config))
    return sinks


class MetricLogger:
    """Prints one line per log step and hands the scalars to the run's sinks."""

    def __init__(self, total_steps: int, sinks: list[Sink], color: bool, enabled: bool):
        self.total_steps = total_steps
        self.enabled = enabled
        self.c = _Colors(color)
        self.sinks = sinks

    def log(self, step: int, values: dict[str, float], seconds_per_step: float) -> None:
        if not self.enabled:
            return
        c = self.c
        eta = format_eta(seconds_per_step * (self.total_steps - step))
        print(
            f"{c.red}step {step:>{len(str(self.total_steps))}}/{self.total_steps}  "
            f"{c.green}loss {values['loss']:8.4f}  grad_norm {values['grad_norm']:7.4f}  {c.reset}"
            f"lr {values['lr']:.2e}  {c.blue}tps {values['tps']:,.0f}  tflops {values['tflops']:.3f}  "
            f"mfu {values['mfu_pct']:.2f}%  {c.cyan}mem {values['memory_gib']:.2f}GiB "
            f"(peak {values['memory_peak_gib']:.2f})  {c.yellow}eta {eta}{c.reset}",
            flush=True,
        )
        self.scalars(step, values)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Each value under its own name and, where torchtitan names it otherwise, under that too."""
        tagged = {**values, **{TORCHTITAN_TAGS[name]: value for name, value in values.items() if name in TORCHTITAN_TAGS}}
        for sink in self.sinks:
            sink.write(step, tagged)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
