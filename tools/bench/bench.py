"""Side-by-side CPU benchmark: Tessera's trainer against a bare PyTorch loop (the floor) on the
same model, data and batch; Tessera under FSDP and TP on 2 local ranks; and one process with
per-block compile, activation checkpointing (full, selective per-op) and float8 (torchao,
emulated on CPU: a correctness path, slower than fp32 there).

Each variant runs in its own process, so peak RSS is that variant's own. Prints tokens/s per
rank, peak RSS per rank, and the ratios to the bare loop and to the plain trainer, all measured
in this one run. Compile's warm-up step is left out of its rate (and printed).

  bazel run //tools/bench -- [--steps 20] [--warmup 3] [--variants bare,tessera,fsdp2,...] [--section.key value ...]
  long sequences, cp 1 vs 2: --variants tessera,cp2 --training.seq_len 8192 --training.local_batch_size 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VARIANTS = {
    "bare": ("bare PyTorch loop", 1),
    "tessera": ("tessera trainer", 1),
    "fsdp2": ("tessera FSDP", 2),
    "tp2": ("tessera TP (SP, loss parallel)", 2),
    "cp2": ("tessera CP (all-gather KV)", 2),
    "compile": ("tessera + compile", 1),
    "ac_full": ("tessera + full AC", 1),
    "ac_op": ("tessera + selective AC (op)", 1),
    "float8": ("tessera + float8 (emulated)", 1),
}
LAYOUT_ARGS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "cp2": ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "compile": ["--compile.enable", "true"],
    "ac_full": ["--activation_checkpoint.mode", "full"],
    "ac_op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "float8": ["--model.converters", "float8"],
}


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _tokens_per_second(per_step_tps: list[float], warmup: int) -> float:
    """Tokens over time for the steps after warm-up (a mean of rates would overweight fast steps)."""
    timed = per_step_tps[warmup:]
    return len(timed) / sum(1.0 / tps for tps in timed)


def measure_bare(overrides: list[str], steps: int, warmup: int) -> dict:
    import contextlib
    import dataclasses

    import torch
    import torch.nn.functional as F

    from tessera.data import build_dataloader, load_dataset, load_tokenizer
    from tessera.models import get_model_spec
    from tessera.trainer.config import load_config
    from tessera.trainer.plan import dataset_source

    config = load_config(overrides)
    t = config.training
    torch.manual_seed(config.debug.seed)
    tokenizer = load_tokenizer(config.model.tokenizer_path or None)
    spec = get_model_spec(config.model.name)
    args = dataclasses.replace(spec.flavors[config.model.flavor], vocab_size=tokenizer.vocab_size, max_seq_len=t.seq_len)
    model = spec.build(args)
    loader = build_dataloader(
        load_dataset(dataset_source(t), text_field=t.dataset_text_field), tokenizer, t.seq_len, t.local_batch_size
    )
    o = config.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    bf16 = t.mixed_precision_param == "bfloat16"
    rates = []
    for _ in range(steps):
        start = time.perf_counter()
        inputs, labels = next(loader)
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        rates.append(t.local_batch_size * t.seq_len / (time.perf_counter() - start))
    return {"tps": _tokens_per_second(rates, warmup), "rss": _peak_rss_gib()}


def _trainer_rank(rank: int, world_size: int, overrides: list[str], warmup: int) -> dict:
    from tessera.trainer.config import load_config
    from tessera.trainer.train import train

    history = train(load_config(overrides))
    warm_up = next((h["compile_warmup_s"] for h in history if "compile_warmup_s" in h), None)
    return {"tps": _tokens_per_second([h["tps"] for h in history if "tps" in h], warmup), "rss": _peak_rss_gib(),
            "warmup_s": warm_up}


def measure_tessera(overrides: list[str], steps: int, warmup: int, ranks: int) -> dict:
    overrides = [*overrides, "--training.steps", str(steps), "--metrics.log_freq", "1"]
    if ranks == 1:
        return _trainer_rank(0, 1, overrides, warmup)
    from tessera.mesh.testing import run_on_ranks

    per_rank = run_on_ranks(_trainer_rank, ranks, overrides, warmup)
    return {"tps": sum(r["tps"] for r in per_rank) / ranks, "rss": max(r["rss"] for r in per_rank)}


def _child(variant: str, overrides: list[str], steps: int, warmup: int) -> dict:
    command = [sys.executable, __file__, "--measure", variant, "--steps", str(steps), "--warmup", str(warmup), *overrides]
    # a CPU benchmark: keep every variant (and the bare floor) off any visible GPU
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if proc.returncode != 0:
        raise SystemExit(f"bench: variant {variant} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--measure", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    known, overrides = parser.parse_known_args()
    if known.steps <= known.warmup:
        parser.error("--steps must exceed --warmup")
    variants = known.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")

    if known.measure:
        layout = LAYOUT_ARGS.get(known.measure, [])
        if known.measure == "bare":
            result = measure_bare(overrides, known.steps, known.warmup)
        else:
            result = measure_tessera([*overrides, *layout], known.steps, known.warmup, VARIANTS[known.measure][1])
        print(json.dumps(result))
        return 0

    results = {v: _child(v, overrides, known.steps, known.warmup) for v in variants}
    floor, plain = results.get("bare"), results.get("tessera")
    print(f"\n{'variant':34} {'ranks':>5} {'tokens/s/rank':>14} {'peak RSS/rank':>14} {'vs bare':>8} "
          f"{'vs tessera':>10} {'RSS vs tessera':>15}")
    for v, r in results.items():
        name, ranks = VARIANTS[v]
        vs_bare = f"{r['tps'] / floor['tps']:.2f}x" if floor else "-"
        vs_plain = f"{r['tps'] / plain['tps']:.2f}x" if plain else "-"
        rss = f"{r['rss'] / plain['rss']:.2f}x" if plain else "-"
        print(f"{name:34} {ranks:>5} {r['tps']:>14,.1f} {r['rss']:>11.2f}GiB {vs_bare:>8} {vs_plain:>10} {rss:>15}")
        if r.get("warmup_s"):
            print(f"{'':34}       compile warm-up (first step): {r['warmup_s']:.1f} s")
    print(f"({known.steps} steps, first {known.warmup} untimed; overrides: {' '.join(overrides) or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
