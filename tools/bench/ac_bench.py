"""Activation checkpointing on CPU, side by side in one run: compile's memory budget (0, 0.5, 1;
activation_checkpoint.mode memory_budget) against the wrapper modes (none, selective, full),
eager and compiled. One forward + backward of the trainer's debug model (its plan and build, one
process), each case in a fresh process: seconds per step after the first, and the peak memory
one step adds over what was resident before it: RSS, since the wrapper modes keep tensors where
saved_tensors_hooks never see them. The child runs with glibc's mmap threshold fixed at 64 KiB,
so every large tensor is its own mapping, returned on free: RSS then follows the live bytes.

    bazel run //tools/bench:ac_bench -- [--seq_len 2048] [--batch 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from fresh_process import run_in_fresh_process

CASES = {  # name: trainer flags
    "none": [],
    "selective op": ["--activation_checkpoint.mode", "selective"],
    "full": ["--activation_checkpoint.mode", "full"],
    "none, compiled": ["--compile.enable", "true", "--compile.components", "model"],
    "full, compiled": ["--compile.enable", "true", "--compile.components", "model", "--activation_checkpoint.mode", "full"],
    **{f"budget {b}": ["--compile.enable", "true", "--compile.components", "model", "--activation_checkpoint.mode",
                       "memory_budget", "--activation_checkpoint.memory_budget", b] for b in ("0", "0.5", "1")},
}


def run_case(name: str, seq_len: int, batch: int, steps: int) -> dict:
    from tessera.trainer.config import load_config
    from tessera.trainer.parallelize import build_parallel_model
    from tessera.trainer.plan import make_plan
    from tessera.trainer.step import build_loss, plain_forward_backward

    argv = ["--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch), "--job.dump_folder",
            "/tmp/tessera_ac_bench", *CASES[name]]
    plan = make_plan(load_config(argv), 1, "cpu")
    torch.manual_seed(0)
    loss_fn = build_loss(plan)
    model = build_parallel_model(plan, None, loss_fn).parts[0]
    step = plain_forward_backward(model, loss_fn, plan)
    tokens = torch.randint(0, plan.model_args.vocab_size, (batch, seq_len + 1))
    times, growth = [], []
    for _ in range(steps):
        before = _reset_peak_rss()
        start = time.perf_counter()
        step(tokens[:, :-1], tokens[:, 1:])
        times.append(time.perf_counter() - start)
        growth.append(_peak_rss() - before)
        model.zero_grad(set_to_none=True)
    return {"name": name, "s_per_step": min(times[1:] or times), "growth_mib": max(growth[1:] or growth) / 2**20}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _reset_peak_rss() -> int:
    """Sets the peak RSS to the current one (Linux: clear_refs 5) and returns it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS:")


def _peak_rss() -> int:
    return _status("VmHWM:")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="forward+backward steps per case; the fastest after the first counts")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # a child process: a name of CASES
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case, args.seq_len, args.batch, args.steps)))
        return
    print(f"AC fwd+bwd, debug Llama 3, batch {args.batch} x seq {args.seq_len}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'case':>16} | {'step peak MiB':>13} {'vs none':>8} | {'s/step':>7} {'vs none':>8}")
    base = None
    for name in CASES:
        row = run_in_fresh_process(__file__, ["--case", name, "--seq_len", str(args.seq_len), "--batch", str(args.batch),
                                              "--steps", str(args.steps)], name,
                                   env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
        if row is None:
            continue
        base = base or row
        print(f"{name:>16} | {row['growth_mib']:>13.0f} {row['growth_mib'] / base['growth_mib']:>7.2f}x | "
              f"{row['s_per_step']:>7.3f} {row['s_per_step'] / base['s_per_step']:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
