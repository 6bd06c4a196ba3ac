"""GPU throughput check (one GPU): a Llama-3-shaped ~1B model (the 1B flavor: dim 2048, 16 layers,
GQA 32/8) trained ~30 steps in bf16, bf16 + compile, bf16 + compile + float8, bf16 + compile with
activation offload (its peak against compile's alone is offload's saving), then the 8B flavor
with full AC where it fits. Prints tokens/s, TFLOP/s, MFU (against the data sheet, and against
the bf16 matmul rate measured on the same GPU) and peak memory per variant, next to
tools/estimate's traced and closed-form peaks, then the ratios the GPU targets are stated in
(compile gain, float8 / bf16, offload's memory), and writes them to gpu-<date>-<gpu>.md in --out
(default benchmarks/).

A variant whose larger estimate is over FIT of the GPU's memory is skipped with both figures
rather than launched to run out of memory: the 8B one (about 120 GiB with AdamW in fp32) runs on
an H200 (141 GB) but not on an H100 (80 GB), and device minutes are scarce.

Each variant runs in its own process (a clean memory peak); a variant that fails (e.g. out of
memory, float8 on a GPU before sm_89) is reported as such and the others still run. The
vocabulary is Tessera's offline 2048-token BPE (nothing is downloaded), so the output layer is
smaller than Llama 3's 128k one.

--dry-run (automatic without CUDA) runs the same variants on CPU with the debug model at tiny
size, the float8 ones skipped by name: it proves the plumbing (child processes, estimates, the
result file) before a device run spends minutes on it.

  tools/bench/gpu.sh [--steps 30] [--budget_s 420]    (from source, the machine's python3)
  bazel run //tools/bench:gpu_bench -- [--dry-run] [--steps 30] [--budget_s 420] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMON = ["--training.mixed_precision_param", "bfloat16", "--training.seq_len", "2048", "--metrics.log_freq", "5",
          "--lr_scheduler.warmup_steps", "5", "--training.dataloader.num_workers", "1"]
ONE_B = ["--model.flavor", "1B", "--training.local_batch_size", "4"]
EIGHT_B = ["--model.flavor", "8B", "--training.local_batch_size", "1", "--activation_checkpoint.mode", "full"]
COMPILE = ["--compile.enable", "true"]
FLOAT8 = ["--model.converters", "float8", "--float8.filter_fqns", "output"]
VARIANTS = {
    "1B bf16": ONE_B,
    "1B bf16 + compile": [*ONE_B, *COMPILE],
    "1B bf16 + compile + float8": [*ONE_B, *COMPILE, *FLOAT8],
    "1B bf16 + compile + activation offload": [*ONE_B, *COMPILE, "--activation_checkpoint.mode", "offload"],
    "8B bf16 + full AC + compile": [*EIGHT_B, *COMPILE],
}
# The dry run's overrides (the last value of a key wins): every variant on the debug model.
DRY_RUN = ["--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.local_batch_size", "2",
           "--metrics.log_freq", "2", "--lr_scheduler.warmup_steps", "1"]
DRY_RUN_COMPILE = ["--compile.backend", "aot_eager"]  # for the variants that compile
# The share of the GPU's memory an estimated peak may take: the CUDA context, cuBLAS workspaces
# and the allocator's fragmentation live outside the estimate.
FIT = 0.95
# Below this much budget a variant is not started: one without compile needs about half of it on a GPU.
MIN_LEFT_S = 60
# (what, numerator's variant, denominator's variant, figure): the ratios the GPU targets are stated in.
RATIOS = (("compile gain, tokens/s", "1B bf16 + compile", "1B bf16", "tps"),
          ("float8 / bf16 (both compiled), tokens/s", "1B bf16 + compile + float8", "1B bf16 + compile", "tps"),
          ("activation offload / none (both compiled), peak memory", "1B bf16 + compile + activation offload",
           "1B bf16 + compile", "peak_gib"))


def _measure(argv: list[str]) -> dict:
    """In the child: trains and returns the last logged window's rates and the peak memory."""
    import torch

    from tessera.trainer.config import load_config
    from tessera.trainer.metrics import measured_peak_tflops
    from tessera.trainer.train import train

    history = [h for h in train(load_config(argv)) if "tps" in h]
    last = history[-1]
    warmup = next((h["compile_warmup_s"] for h in history if "compile_warmup_s" in h), None)
    cuda = torch.cuda.is_available()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    matmul = measured_peak_tflops("cuda" if cuda else "cpu", torch.bfloat16)  # after training: the device idle
    return {"tps": last["tps"], "tflops": last["tflops"], "mfu_pct": last["mfu_pct"], "matmul_tflops": matmul,
            "peak_gib": peak, "warmup_s": warmup, "loss": last["loss"]}


def estimated_peak_gib(argv: list[str], trace: bool = False) -> float | None:
    """tools/estimate's peak for the variant on one GPU: the closed form (instant; None where a
    model has none) or the trace (fake tensors through the real code, compile left out; seconds)."""
    import estimate
    from tessera.trainer.config import load_config
    from tessera.trainer.plan import make_plan

    role = estimate.estimate(make_plan(load_config(argv), 1, "cuda", check_only=True), trace=trace)["roles"][0]
    source = role.get("traced" if trace else "formula")
    return source["peak"] / 2**30 if source else None


def estimates(argv: list[str]) -> dict:
    """Both peaks in GiB (formula_gib, traced_gib), and why one failed (formula_error,
    traced_error): a failed estimate is that cell's figure, and the variant still runs."""
    found = {}
    for key, trace in (("formula", False), ("traced", True)):
        try:
            found[f"{key}_gib"] = estimated_peak_gib(argv, trace)
        except Exception as e:
            found.update({f"{key}_gib": None, f"{key}_error": f"{type(e).__name__}: {e}"[:200]})
    return found


def variant_argv(name: str, steps: int, dump: Path, dry: bool) -> list[str]:
    """The trainer's arguments for one variant, its checkpoints and logs in a folder of its own."""
    compiles = dry and "--compile.enable" in VARIANTS[name]
    return [*COMMON, *VARIANTS[name], "--training.steps", str(steps), "--job.dump_folder", str(dump / name.replace(" ", "_")),
            *(DRY_RUN if dry else []), *(DRY_RUN_COMPILE if compiles else [])]


def skip_reason(name: str, estimated: dict, capacity_gib: float | None) -> str | None:
    """Why a variant is not launched: float8 without a GPU, or the larger estimate over FIT of its memory."""
    if capacity_gib is None and "float8" in name:
        return "needs CUDA"
    largest = max(filter(None, (estimated["formula_gib"], estimated["traced_gib"])), default=None)
    if capacity_gib is not None and largest is not None and largest > FIT * capacity_gib:
        return f"estimated {largest:.1f} GiB, over {FIT:.0%} of this GPU's {capacity_gib:.1f} GiB"
    return None


def _run(argv: list[str], timeout_s: float, env: dict | None) -> dict:
    """The child's figures, or why there are none: killed at the end of the budget is a skip (the
    budget was short, nothing failed), any other end without figures an error."""
    command = [sys.executable, __file__, "--measure", json.dumps(argv)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"skipped": f"time budget spent, stopped after {timeout_s:.0f} s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": last[:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--budget_s", type=float, default=420.0, help="wall-clock budget for all variants")
    parser.add_argument("--out", type=Path, help="folder of the result file (default: the repository's benchmarks/)")
    parser.add_argument("--dry-run", action="store_true", help="CPU plumbing check at tiny size (automatic without CUDA)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(_measure(json.loads(args.measure))))
        return 0
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    gpu = torch.cuda.get_device_name() if cuda else "cpu-dry-run"
    capacity = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None
    env = None if cuda else {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a dry run stays on CPU
    dump = Path(tempfile.mkdtemp(prefix="tessera_gpu_bench_"))
    deadline, rows = time.monotonic() + args.budget_s, {}
    for name in VARIANTS:
        if deadline - time.monotonic() < MIN_LEFT_S:
            rows[name] = {"skipped": "time budget spent"}
            continue
        argv = variant_argv(name, args.steps, dump, dry=not cuda)
        estimated = estimates(argv)
        skip = skip_reason(name, estimated, capacity)
        rows[name] = {"skipped": skip, **estimated} if skip else {**_run(argv, deadline - time.monotonic(), env), **estimated}
        print(name, rows[name], flush=True)
    shutil.rmtree(dump, ignore_errors=True)
    return _report(rows, gpu, args, dry=not cuda)


def _ratios(rows: dict[str, dict]) -> list[str]:
    """A line per ratio: its figure where both variants measured it, else why not."""
    lines = []
    for what, top, bottom, key in RATIOS:
        a, b = rows[top].get(key), rows[bottom].get(key)
        if a is not None and b is not None:
            lines.append(f"- {what}: {a / b:.2f}x")
        else:
            ran = all("tps" in rows[v] for v in (top, bottom))
            lines.append(f"- {what}: not measured ({'no CUDA memory figures' if ran else 'a variant did not run'})")
    return lines


def _missing(row: dict, key: str) -> str:
    """An estimate's cell without a figure: it failed, was never made, or the model has no formula."""
    if f"{key}_error" in row:
        return f"failed: {row[f'{key}_error']}"
    return "" if f"{key}_gib" not in row else "no formula"


def _against(estimated: float | None, peak: float | None, missing: str) -> str:
    """An estimate's cell: GiB and its error against the measured peak (none on CPU)."""
    if estimated is None:
        return missing
    return f"{estimated:.1f}" + ("" if peak is None else f" ({estimated / peak - 1:+.1%})")


def _report(rows: dict[str, dict], gpu: str, args: argparse.Namespace, dry: bool) -> int:
    """The table, printed and written to gpu-<date>-<gpu>.md; exit 1 where a launched variant failed."""
    setting = "debug model, seq 64, CPU (dry run)" if dry else "seq 2048, bf16 params (FSDP-free single GPU)"
    lines = [f"# GPU benchmark {datetime.date.today()} on {gpu}", "",
             f"{args.steps} steps, {setting}; rates of the last logged window.", "",
             "| variant | tokens/s | TFLOP/s | MFU % | MFU % of measured bf16 matmul | peak GiB (max_memory_allocated) | "
             "estimated GiB, traced (error) | estimated GiB, formula (error) | compile warm-up s | loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        peak = r.get("peak_gib")
        traced, formula = (_against(r.get(f"{key}_gib"), peak, _missing(r, key)) for key in ("traced", "formula"))
        if "skipped" in r or "error" in r:
            outcome = f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r['error']}"
            lines.append(f"| {name} | {outcome} | | | | | {traced} | {formula} | | |")
            continue
        lines.append(f"| {name} | {r['tps']:,.0f} | {r['tflops']:.1f} | {r['mfu_pct']:.1f} | "
                     f"{100 * r['tflops'] / r['matmul_tflops']:.1f} (of {r['matmul_tflops']:.3g} TFLOP/s) | "
                     f"{'n/a' if peak is None else f'{peak:.1f}'} | {traced} | {formula} | {r['warmup_s'] or 0:.0f} | "
                     f"{r['loss']:.3f} |")
    lines += ["", *_ratios(rows)]
    text = "\n".join(lines) + "\n"
    print(text)
    root = Path(os.environ.get("BUILD_WORKSPACE_DIRECTORY", Path(__file__).resolve().parents[2]))
    out = (args.out or root / "benchmarks") / f"gpu-{datetime.date.today()}-{gpu.replace(' ', '_')}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written to {out}")
    return 1 if any("error" in r for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
