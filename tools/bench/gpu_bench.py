"""GPU throughput check (one GPU): a Llama-3-shaped ~1B model (the 1B flavor: dim 2048, 16 layers,
GQA 32/8) trained ~30 steps in bf16, bf16 + compile, bf16 + compile + float8, bf16 + compile with
activation offload (its peak against compile's alone is offload's saving), then the 8B flavor
with FSDP-style memory settings (full AC) when it fits. Prints tokens/s, TFLOP/s, MFU and peak
memory per variant, next to tools/estimate's closed-form peak, and writes them to
gpu-<date>-<gpu>.md in --out (default benchmarks/).

Each variant runs in its own process (a clean memory peak); a variant that fails (e.g. out of
memory, float8 on a GPU before sm_89) is reported as such and the others still run. The
vocabulary is Tessera's offline 2048-token BPE (nothing is downloaded), so the output layer is
smaller than Llama 3's 128k one.

  tools/bench/gpu.sh [--steps 30] [--budget_s 420]    (from source, the machine's python3)
  bazel run //tools/bench:gpu_bench -- [--steps 30] [--budget_s 420] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
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


def _measure(argv: list[str]) -> dict:
    """In the child: trains and returns the last logged window's rates and the peak memory."""
    import torch

    from tessera.trainer.config import load_config
    from tessera.trainer.train import train

    history = [h for h in train(load_config(argv)) if "tps" in h]
    last = history[-1]
    warmup = next((h["compile_warmup_s"] for h in history if "compile_warmup_s" in h), None)
    return {"tps": last["tps"], "tflops": last["tflops"], "mfu_pct": last["mfu_pct"],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "warmup_s": warmup, "loss": last["loss"]}


def _estimated_peak_gib(argv: list[str]) -> float | None:
    """tools/estimate's closed-form peak for the variant on one GPU (None where it has no formula)."""
    import estimate
    from tessera.trainer.config import load_config
    from tessera.trainer.plan import make_plan

    role = estimate.estimate(make_plan(load_config(argv), 1, "cuda", check_only=True), trace=False)["roles"][0]
    return role["formula"]["peak"] / 2**30 if "formula" in role else None


def _run(name: str, argv: list[str], timeout_s: float) -> dict:
    command = [sys.executable, __file__, "--measure", json.dumps(argv)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {timeout_s:.0f} s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": last[:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--budget_s", type=float, default=420.0, help="wall-clock budget for all variants")
    parser.add_argument("--out", type=Path, help="folder of the result file (default: the repository's benchmarks/)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(_measure(json.loads(args.measure))))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device visible", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    dump = Path(os.environ.get("TMPDIR", "/tmp")) / "tessera_gpu_bench"
    deadline, rows = time.monotonic() + args.budget_s, {}
    for name, extra in VARIANTS.items():
        left = deadline - time.monotonic()
        if left < 30:
            rows[name] = {"error": "skipped: time budget spent"}
            continue
        argv = [*COMMON, *extra, "--training.steps", str(args.steps), "--job.dump_folder", str(dump / name.replace(" ", "_"))]
        rows[name] = _run(name, argv, left)
        if "error" not in rows[name]:
            rows[name]["estimated_gib"] = _estimated_peak_gib(argv)
        print(name, rows[name], flush=True)
    lines = [f"# GPU benchmark {datetime.date.today()} on {gpu}", "",
             f"{args.steps} steps, seq 2048, bf16 params (FSDP-free single GPU); rates of the last 5-step window.", "",
             "| variant | tokens/s | TFLOP/s | MFU % | peak GiB (max_memory_allocated) | estimated GiB (error) | "
             "compile warm-up s | loss |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | |")
        else:
            est = r["estimated_gib"]
            estimated = "no formula" if est is None else f"{est:.1f} ({est / r['peak_gib'] - 1:+.1%})"
            lines.append(f"| {name} | {r['tps']:,.0f} | {r['tflops']:.1f} | {r['mfu_pct']:.1f} | {r['peak_gib']:.1f} | "
                         f"{estimated} | {r['warmup_s'] or 0:.0f} | {r['loss']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    root = Path(os.environ.get("BUILD_WORKSPACE_DIRECTORY", Path(__file__).resolve().parents[2]))
    out = (args.out or root / "benchmarks") / f"gpu-{datetime.date.today()}-{gpu.replace(' ', '_')}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
