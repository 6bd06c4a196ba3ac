"""Side-by-side CPU benchmarks, every figure measured in this one run (see README.md):

- variants (default): Tessera's trainer against a bare PyTorch loop (the floor: the same model,
  optimizer, clipping and batches, the batches made beforehand, a loss read at log steps only); Tessera under FSDP, TP and CP on 2 local ranks; one process with
  per-block compile, activation checkpointing (full, selective per-op) and float8 (torchao,
  emulated on CPU: a correctness path, slower than fp32 there); Muon against AdamW at FSDP 2 and 4
  (step time, peak RSS, and the bytes Muon's owner gathers and scatters move per step). Each variant runs in its own
  process (peak RSS is its own); `--repeats N` runs the list N times interleaved and reports
  medians. Prints tokens/s per rank, peak RSS, the ratios to the bare loop and to the plain
  trainer, and the framework's overhead over the bare loop. Compile's warm-up step is left out
  of its rate (and printed).
- `--peer`: Tessera against torchtitan 0.2.2 (peer.py), fp32 and bf16, 1 and 2 processes,
  interleaved repeats, median tokens/s per rank and the ratio Tessera / torchtitan; `--model
  deepseek_v3` (torchtitan's deepseek_v3 debug TOML, 2 processes: EP 2 x FSDP 2) or qwen3 (its
  debugmodel_moe). The output ends with one line per run shape: `ratio <model> <dtype> <nproc>: <x>`.
- `--peer --long_context`: block-causal training at `--seqs` (8k, 16k) with CP 2 on the llama3
  debug model, one sequence per step: Tessera's tokens/s per rank and peak memory against
  torchtitan's same job (its block-causal path is FlexAttention, flavor debugmodel_flex_attn),
  and its plain causal SDPA under CP 2, or the exception each of torchtitan's runs ends with.
- `--profile`: where one step goes (profile_split.py), Tessera's and (with the peer) torchtitan's,
  for `--model` too (MoE: routing, permutation and the routed experts apart).
- MoE dispatch: `--variants tessera,capacity,ep2,ep2_capacity --model.name deepseek_v3
  --model.flavor debugmodel`: dropless against capacity-factor dispatch, one process and EP 2.

  bazel run //tools/bench -- [--steps 30] [--warmup 3] [--repeats 1] [--variants bare,tessera,...] [--section.key value ...]
  long sequences, cp 1 vs 2: --variants tessera,cp2,cp2_alltoall --training.seq_len 8192 --training.local_batch_size 1
  bazel run //tools/bench -- --peer [--model llama3|deepseek_v3|qwen3] [--peer_root DIR] [--dtypes float32,bfloat16] [--nprocs 1,2] [--repeats 2] [--steps 30] [--seq_len 256]
  bazel run //tools/bench -- --peer --long_context [--seqs 8192,16384] [--steps 4] [--warmup 1]
  bazel run //tools/bench -- --profile [--model llama3|deepseek_v3|qwen3] [--peer_root DIR] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

VARIANTS = {
    "bare": ("bare PyTorch loop", 1),
    "tessera": ("tessera trainer", 1),
    "fsdp2": ("tessera FSDP", 2),
    "fsdp4": ("tessera FSDP", 4),
    "muon_fsdp2": ("tessera FSDP + Muon", 2),
    "muon_fsdp4": ("tessera FSDP + Muon", 4),
    "tp2": ("tessera TP (SP, loss parallel)", 2),
    "cp2": ("tessera CP (ring, K/V all-gathered)", 2),
    "cp2_alltoall": ("tessera CP (ring, K/V passed on)", 2),
    "compile": ("tessera + compile", 1),
    "ac_full": ("tessera + full AC", 1),
    "ac_op": ("tessera + selective AC (op)", 1),
    "float8": ("tessera + float8 (emulated)", 1),
    "capacity": ("tessera MoE, capacity factor 1.25", 1),
    "ep2": ("tessera EP 2 x FSDP 2 (dropless)", 2),
    "ep2_capacity": ("tessera EP 2 x FSDP 2, capacity 1.25", 2),
}
CAPACITY = ["--parallelism.expert_capacity_factor", "1.25"]
EP2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"]
LAYOUT_ARGS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "fsdp4": ["--parallelism.data_parallel_shard_degree", "4"],
    "muon_fsdp2": ["--parallelism.data_parallel_shard_degree", "2", "--optimizer.name", "Muon"],
    "muon_fsdp4": ["--parallelism.data_parallel_shard_degree", "4", "--optimizer.name", "Muon"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "cp2": ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "cp2_alltoall": ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                 "--parallelism.context_parallel_rotate_method", "alltoall"],
    "compile": ["--compile.enable", "true"],
    "ac_full": ["--activation_checkpoint.mode", "full"],
    "ac_op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "float8": ["--model.converters", "float8", "--float8.filter_fqns", "output"],
    "capacity": CAPACITY,
    "ep2": EP2,
    "ep2_capacity": [*EP2, *CAPACITY],
}


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def timed_after(warmup: int, log_freq: int) -> int:
    """The last untimed step: the first log step (1 and every log_freq-th) at or after the warm-up,
    so the trainer's throughput windows (which run from one log step to the next) and the bare
    loop's time the same steps, with the trainer's usual log frequency."""
    return 1 if warmup <= 1 else -(-warmup // log_freq) * log_freq


def _tokens_per_second(windows: list[tuple[int, float]]) -> float:
    """Tokens over time for (steps, tokens/s) windows (a mean of rates would overweight fast ones)."""
    if not windows:
        raise SystemExit("bench: no step is timed: --steps must reach past the first log step after --warmup")
    return sum(n for n, _ in windows) / sum(n / tps for n, tps in windows)


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
    tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.hf_assets_path or None)
    spec = get_model_spec(config.model.name)
    args = dataclasses.replace(spec.flavors[config.model.flavor], max_seq_len=t.seq_len)
    model = spec.build(args)
    loader = build_dataloader(
        load_dataset(dataset_source(t), text_field=t.dataset_text_field), tokenizer, t.seq_len, t.local_batch_size
    )
    o = config.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                                  foreach=o.implementation == "foreach", fused=o.implementation == "fused")
    bf16 = t.mixed_precision_param == "bfloat16"
    batches = [next(loader) for _ in range(steps)]  # made beforehand: the floor has no data pipeline
    rates = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        inputs, labels = batches[step - 1]
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % config.metrics.log_freq == 0:  # what the trainer reads at its log steps
            loss.item()
        rates.append((1, t.local_batch_size * t.seq_len / (time.perf_counter() - start)))
    return {"tps": _tokens_per_second(rates[timed_after(warmup, config.metrics.log_freq):]), "rss": _peak_rss_gib()}


@contextlib.contextmanager
def _owner_traffic(moved: list[int]):
    """Counts into moved[0] the bytes this rank sends and receives in gathers and scatters: the
    traffic of Muon's owners (tessera.optim.owners), which nothing else in a step uses."""
    import torch.distributed as dist

    gather, scatter = dist.gather, dist.scatter

    def counted(collective, tensor, pieces, **kwargs):
        moved[0] += tensor.numel() * tensor.element_size() * (len(pieces) - 1 if pieces else 1)
        return collective(tensor, pieces, **kwargs)

    dist.gather = lambda tensor, gather_list=None, **kw: counted(gather, tensor, gather_list, **kw)
    dist.scatter = lambda tensor, scatter_list=None, **kw: counted(scatter, tensor, scatter_list, **kw)
    try:
        yield
    finally:
        dist.gather, dist.scatter = gather, scatter


def _trainer_rank(rank: int, world_size: int, overrides: list[str], warmup: int) -> dict:
    from tessera.trainer.config import load_config
    from tessera.trainer.train import train

    config = load_config(overrides)
    moved = [0]
    with _owner_traffic(moved):
        history = [h for h in train(config) if "tps" in h]
    warm_up = next((h["compile_warmup_s"] for h in history if "compile_warmup_s" in h), None)
    first = timed_after(warmup, config.metrics.log_freq)
    windows = [(h["step"] - before["step"], h["tps"]) for before, h in zip(history, history[1:]) if before["step"] >= first]
    tps = _tokens_per_second(windows)
    return {"tps": tps, "rss": _peak_rss_gib(), "warmup_s": warm_up,
            "step_s": config.training.local_batch_size * config.training.seq_len / tps,
            "owner_mib": moved[0] / config.training.steps / 2**20}


def measure_tessera(overrides: list[str], steps: int, warmup: int, ranks: int) -> dict:
    overrides = [*overrides, "--training.steps", str(steps)]
    if ranks == 1:
        return _trainer_rank(0, 1, overrides, warmup)
    from tessera.mesh.testing import run_on_ranks

    per_rank = run_on_ranks(_trainer_rank, ranks, overrides, warmup)
    return {"tps": sum(r["tps"] for r in per_rank) / ranks, "rss": max(r["rss"] for r in per_rank),
            "step_s": max(r["step_s"] for r in per_rank), "owner_mib": max(r["owner_mib"] for r in per_rank)}


def _child(variant: str, overrides: list[str], steps: int, warmup: int) -> dict:
    command = [sys.executable, __file__, "--measure", variant, "--steps", str(steps), "--warmup", str(warmup), *overrides]
    # a CPU benchmark: keep every variant (and the bare floor) off any visible GPU
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"bench: variant {variant} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(runs: list[dict]) -> dict:
    """The run with the median rate (its RSS and warm-up come with it)."""
    return sorted(runs, key=lambda r: r["tps"])[len(runs) // 2]


def run_variants(known, overrides: list[str]) -> None:
    variants = known.variants.split(",")
    runs = {v: [] for v in variants}
    for _ in range(known.repeats):  # interleaved: drift in the machine's load hits every variant alike
        for v in variants:
            runs[v].append(_child(v, overrides, known.steps, known.warmup))
    results = {v: _median(r) for v, r in runs.items()}
    floor, plain = results.get("bare"), results.get("tessera")
    print(f"\n{'variant':34} {'ranks':>5} {'tokens/s/rank':>14} {'peak RSS/rank':>14} {'vs bare':>8} "
          f"{'vs tessera':>10} {'RSS vs tessera':>15}")
    for v, r in results.items():
        name, ranks = VARIANTS[v]
        vs_bare = f"{r['tps'] / floor['tps']:.2f}x" if floor else "-"
        vs_plain = f"{r['tps'] / plain['tps']:.2f}x" if plain else "-"
        rss = f"{r['rss'] / plain['rss']:.2f}x" if plain else "-"
        print(f"{name:34} {ranks:>5} {r['tps']:>14,.1f} {r['rss']:>11.2f}GiB {vs_bare:>8} {vs_plain:>10} {rss:>15}")
        if known.repeats > 1:
            rates = ", ".join(f"{x['tps']:,.0f}" for x in runs[v])
            print(f"{'':34}       runs: {rates}")
        if r.get("owner_mib"):
            plain_fsdp = results.get(v.removeprefix("muon_"))
            vs = (f"; step {r['step_s'] / plain_fsdp['step_s']:.2f}x and peak RSS {r['rss'] / plain_fsdp['rss']:.2f}x "
                  f"of AdamW at {ranks} ranks") if plain_fsdp and plain_fsdp is not r else ""
            print(f"{'':34}       Muon's owners move {r['owner_mib']:.1f} MiB per step on the busiest rank{vs}")
        if r.get("warmup_s"):
            print(f"{'':34}       compile warm-up (first step): {r['warmup_s']:.1f} s{_pays_after(r, plain)}")
    if floor and plain:
        print(f"framework overhead vs the bare loop: {100 * (1 - plain['tps'] / floor['tps']):+.1f}% "
              f"(medians of {known.repeats} interleaved runs)")
    print(f"({known.steps} steps, timed after the first log step from step {known.warmup}; overrides: {' '.join(overrides) or 'none'}; "
          f"load average {os.getloadavg()[0]:.2f})")


def _pays_after(compiled: dict, plain: dict | None) -> str:
    """When compile's first step is paid back by its faster steps (one rank's steps)."""
    if not plain or "step_s" not in plain:
        return ""
    saved = plain["step_s"] - compiled["step_s"]
    if saved <= 0:
        return "; never pays back (no faster than eager)"
    return f"; pays back after {(compiled['warmup_s'] - plain['step_s']) / saved:,.0f} steps ({1e3 * saved:.1f} ms/step saved)"


def _peer_or_exit(path: str | None, needed: bool):
    from peer import SETUP_HINT, peer_root

    root = peer_root(path)
    if root is None and needed:
        raise SystemExit(f"bench: {SETUP_HINT}")
    if root is None:
        print(f"bench: {SETUP_HINT}; Tessera only", flush=True)
    return root


# what both stacks run instead where torchtitan fails its TOML's own activation checkpointing on
# CPU (deepseek_v3 under EP 2: its per-op selective AC meets a profiler record_function it did not save)
_PEER_FALLBACK = ["--activation_checkpoint.mode", "none"]


def _peer_cell(root: Path, out: Path, known, dtype: str, nproc: int, first: int, tokens_per_step: int,
               extra: list[str]) -> tuple[dict | None, str | None]:
    """One (dtype, processes) cell's runs per stack, interleaved A B, then B A, ...: (runs, None),
    or (None, the exception torchtitan's run ended with); Tessera's failing is a bug, raised."""
    from peer import failure_reason, launch, parse

    runs = {"torchtitan": [], "tessera": []}
    for r in range(known.repeats):
        for which in (("torchtitan", "tessera") if r % 2 == 0 else ("tessera", "torchtitan")):
            folder = out / f"{which}_{dtype}_np{nproc}{'_fallback' if extra else ''}_{r}"
            try:
                text = launch(which, root, dtype, nproc, known.steps, folder, extra, model=known.model, seq_len=known.seq_len)
            except RuntimeError:
                if which == "tessera":
                    raise
                return None, failure_reason((folder / "output.log").read_text())
            runs[which].append(parse(which, text, first, tokens_per_step))
    return runs, None


def run_peer(known) -> None:
    """Tessera vs torchtitan per (dtype, processes): A B, then B A, ... (drift hits both). Each
    cell: the median over runs of each run's median tokens/s per rank, and of its tokens per CPU
    second of the rank's process (steadier while other jobs load the machine). A cell torchtitan
    cannot run as configured is printed with the exception it ended with, then measured with both
    stacks under _PEER_FALLBACK (its ratio line says so)."""
    import tempfile

    root = _peer_or_exit(known.peer_root, needed=True)
    out = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    first = known.warmup + 1
    ratios = []
    print(f"model {known.model}, seq_len {known.seq_len}, local batch 8, {known.steps} steps; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    print(f"{'dtype':9} {'procs':>5} {'torchtitan tok/s/rank':>22} {'tessera tok/s/rank':>19} {'ratio':>6}  "
          f"{'per CPU-s: titan':>16} {'tessera':>8} {'ratio':>6}  {'peak GiB: titan':>15} {'tessera':>7}  "
          "runs (titan | tessera)")
    tokens_per_step = known.seq_len * 8
    for nproc in known.nprocs:
        for dtype in known.dtypes:
            extra = []
            runs, failure = _peer_cell(root, out, known, dtype, nproc, first, tokens_per_step, extra)
            if failure:
                print(f"{dtype:9} {nproc:>5}  torchtitan fails: {failure}; both with {' '.join(_PEER_FALLBACK)}:", flush=True)
                extra = _PEER_FALLBACK
                runs, failure = _peer_cell(root, out, known, dtype, nproc, first, tokens_per_step, extra)
                if failure:
                    print(f"{dtype:9} {nproc:>5}  torchtitan fails again: {failure}", flush=True)
                    continue
            titan, tessera = (statistics.median(x["tps"] for x in runs[w]) for w in ("torchtitan", "tessera"))
            titan_cpu, tessera_cpu = (statistics.median(x["tpcs"] or 0 for x in runs[w]) for w in ("torchtitan", "tessera"))
            cpu_ratio = f"{tessera_cpu / titan_cpu:>5.2f}x" if titan_cpu else "    -"
            cells = " | ".join(", ".join(f"{x['tps']:,.0f}" for x in runs[w]) for w in ("torchtitan", "tessera"))
            titan_peak, tessera_peak = (max(x["peak"] or 0 for x in runs[w]) for w in ("torchtitan", "tessera"))
            print(f"{dtype:9} {nproc:>5} {titan:>22,.0f} {tessera:>19,.0f} {tessera / titan:>5.2f}x  "
                  f"{titan_cpu:>16,.0f} {tessera_cpu:>8,.0f} {cpu_ratio}  {titan_peak:>15.2f} {tessera_peak:>7.2f}  "
                  f"{cells}  (load {os.getloadavg()[0]:.2f})",
                  flush=True)
            ratios.append(f"ratio {known.model} {dtype} {nproc}: {tessera / titan:.2f} (per CPU-second: "
                          f"{tessera_cpu / titan_cpu if titan_cpu else float('nan'):.2f})"
                          + (f" with {' '.join(extra)}" if extra else ""))
            if nproc == 1 and dtype == known.dtypes[0]:
                print(f"{'':16}parameters: torchtitan {runs['torchtitan'][0]['params']:,}, tessera "
                      f"{runs['tessera'][0]['params']:,}", flush=True)
    print(f"(median tokens/s per rank over steps {first}..{known.steps} of each run, median of {known.repeats} "
          f"interleaved runs; logs in {out})")
    print("\n".join(ratios))


def run_long_context(known) -> None:
    """Block-causal at each of --seqs with CP 2, one sequence per step: Tessera, then torchtitan's
    block-causal (FlexAttention) and causal (SDPA) under the same layout, each figure or the
    exception its run ended with."""
    import tempfile

    from peer import failure_reason, launch, parse

    root = _peer_or_exit(known.peer_root, needed=True)
    out = Path(tempfile.mkdtemp(prefix="bench-long-"))
    cp2 = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"]
    runs = {"tessera block-causal": ("tessera", ["--model.attn_mask_type", "block_causal"]),
            "torchtitan block-causal (flex)": ("torchtitan", ["--model.flavor", "debugmodel_flex_attn"]),
            "torchtitan causal (sdpa)": ("torchtitan", [])}
    print(f"llama3 debugmodel, fp32, CP 2, local batch 1, {known.steps} steps (median tokens/s per rank over steps "
          f"{known.warmup + 1}..{known.steps}); load average {os.getloadavg()[0]:.2f}", flush=True)
    for seq in known.seqs:
        for name, (which, flags) in runs.items():
            folder = out / f"{name.split(' (')[0].replace(' ', '_')}_{seq}"
            try:
                text = launch(which, root, "float32", 2, known.steps, folder, [*cp2, *flags], seq_len=seq, local_batch=1)
            except RuntimeError:
                print(f"seq {seq:>6,}  {name:31} fails: {failure_reason((folder / 'output.log').read_text())}", flush=True)
                continue
            figures = parse(which, text, known.warmup + 1)
            peak = figures["peak"]
            print(f"seq {seq:>6,}  {name:31} {figures['tps']:>8,.0f} tokens/s per rank, peak "
                  f"{peak if peak is not None else float('nan'):.2f} GiB RSS, final loss {figures['loss']:.4f} "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    print(f"(logs in {out})")


def run_profile(known, overrides: list[str]) -> None:
    """One traced step per dtype: Tessera's split, and torchtitan's when the peer is there."""
    import tempfile

    from peer import PEER_TOML, launch, latest_trace, profiling_args
    from profile_split import format_table, split

    root = _peer_or_exit(known.peer_root, needed=known.model in PEER_TOML)
    out = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    columns = {}
    for dtype in known.dtypes:
        for which in ("tessera", "torchtitan") if root else ("tessera",):
            folder = out / f"{which}_{dtype}"
            extra = [*profiling_args(which, known.steps), *(overrides if which == "tessera" else [])]
            launch(which, root, dtype, 1, known.steps, folder, extra, regions=True, model=known.model,
                   seq_len=known.seq_len)
            columns[f"{which} {dtype}"] = split(latest_trace(folder / "dump"))
    print(format_table(columns))
    print(f"(step {known.steps} of each run, 1 process; load average {os.getloadavg()[0]:.2f}; traces in {out})")


def _at_least(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= least, refused on the command line, not by a traceback
    (0 repeats) or a run that times nothing."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, not {value}")
        return value
    return parse


def _counts(text: str) -> list[int]:
    """An argparse type: comma-separated whole numbers >= 1 (--nprocs, --seqs)."""
    return [_at_least(1)(part) for part in text.split(",")]


def _dtypes(text: str) -> list[str]:
    """An argparse type: comma-separated values of --training.mixed_precision_param (--dtypes),
    refused on the command line, not after the runs before the first that fails on one."""
    from tessera.trainer.config import CHOICES

    choices = CHOICES[("training", "mixed_precision_param")]
    dtypes = text.split(",")
    unknown = [dtype for dtype in dtypes if dtype not in choices]
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]!r} is not a dtype; choose from {', '.join(choices)}")
    return dtypes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=_at_least(1), help="steps per run (default 30; --long_context: 4)")
    parser.add_argument("--warmup", type=_at_least(0),
                        help="steps left out of the timing, rounded up to a log step (metrics.log_freq); "
                             "default 3 (--long_context: 1)")
    parser.add_argument("--repeats", type=_at_least(1), default=1, help="interleaved runs of each variant (medians)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--peer", action="store_true", help="Tessera vs torchtitan 0.2.2 (needs PEER_ROOT)")
    parser.add_argument("--profile", action="store_true", help="split one step by kind of work")
    parser.add_argument("--peer_root", default=None, help="the torchtitan peer folder (default: $PEER_ROOT)")
    parser.add_argument("--dtypes", type=_dtypes, default="float32,bfloat16",
                        help="--peer / --profile: comma-separated training.mixed_precision_param values")
    parser.add_argument("--nprocs", type=_counts, default="1,2")
    parser.add_argument("--model", default="llama3", choices=("llama3", "deepseek_v3", "qwen3"),
                        help="--peer / --profile: the model both stacks train (peer.py's MODELS)")
    parser.add_argument("--seq_len", type=_at_least(1), default=256, help="--peer / --profile: tokens per sequence")
    parser.add_argument("--long_context", action="store_true",
                        help="--peer: block-causal with CP 2 at --seqs, Tessera vs torchtitan")
    parser.add_argument("--seqs", type=_counts, default="8192,16384", help="--long_context: sequence lengths")
    parser.add_argument("--measure", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    known, overrides = parser.parse_known_args(argv)
    if known.long_context and not known.peer:
        parser.error("--long_context is a --peer comparison: add --peer")
    known.steps = (4 if known.long_context else 30) if known.steps is None else known.steps
    known.warmup = (1 if known.long_context else 3) if known.warmup is None else known.warmup
    if known.steps <= known.warmup:
        parser.error("--steps must exceed --warmup")
    unknown = [v for v in known.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")

    if not known.measure:  # the trainer's overrides: refused here once, not in every child run
        from tessera.trainer.config import ConfigError, load_config
        try:
            load_config(overrides)
        except ConfigError as e:
            print(f"bench: error: {e}", file=sys.stderr)
            return 2
    if known.measure:
        layout = LAYOUT_ARGS.get(known.measure, [])
        if known.measure == "bare":
            result = measure_bare(overrides, known.steps, known.warmup)
        else:
            result = measure_tessera([*overrides, *layout], known.steps, known.warmup, VARIANTS[known.measure][1])
        print(json.dumps(result))
        return 0
    if known.long_context:
        run_long_context(known)
    elif known.peer:
        run_peer(known)
    elif known.profile:
        run_profile(known, overrides)
    else:
        run_variants(known, overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
