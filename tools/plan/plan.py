"""Command line: `plan --model llama3 --flavor 70B --gpus 256 --gpu h100 [--seq_len 8192]
[--global_batch N] [--top 3] [--efficiency 0.5] [--memory_fraction 0.9]`.

Enumerates layouts the trainer can run (dp_shard x tp x pp with the 1F1B schedule, AC mode,
local batch), keeps those whose closed-form peak (tools/estimate/formulas.py, on the trainer's own
job plan) fits, ranks them by the step-time model of README.md and prints the best with their
reasoning and the exact trainer flags. Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tessera.models import get_model_spec, list_model_specs
from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.plan import JobPlan, make_plan

import formulas
from gpus import GIB, GPU, GPUS

AC_RECOMPUTE = {"none": 0.0, "selective": 0.1, "full": 1 / 3}  # extra compute: a forward of what is recomputed
RING_HOP_S = 20e-6  # latency per ring step of a collective (NCCL-like), across nodes
ALPHA_OVERLAP = 0.8  # share of FSDP / pipeline communication that hides behind compute


@dataclasses.dataclass
class Candidate:
    flags: list[str]
    plan: JobPlan
    peak: int
    step_s: float
    parts: dict[str, float]


def _comm_seconds(bytes_: float, group: int, gpu: GPU, span: int) -> float:
    """Ring collective: (n-1)/n of the buffer crosses each GPU's link; a group spanning `span` consecutive ranks beyond a node runs at the inter-node bandwidth."""
    if group <= 1:
        return 0.0
    inter = span > gpu.gpus_per_node
    bandwidth = (gpu.inter_node_gbps if inter else gpu.intra_node_gbps) * 1e9
    return bytes_ * (group - 1) / group / bandwidth


def step_time(plan: JobPlan, gpu: GPU, efficiency: float) -> dict[str, float]:
    """Seconds per step of the busiest rank: compute at `efficiency` of the dtype's peak (plus AC
    recompute), the pipeline bubble of 1F1B, TP collectives (on the critical path), FSDP and
    pipeline transfers of which ALPHA_OVERLAP hides behind compute."""
    dims = plan.dims
    ranks = [formulas.estimate_rank(plan, r) for r in range(dims.pp)]
    flops = max(r.flops_per_step for r in ranks) * (1 + AC_RECOMPUTE[plan.config.activation_checkpoint.mode])
    compute = flops / (gpu.tflops[str(plan.param_dtype).removeprefix("torch.")] * 1e12 * efficiency)
    comm = max(ranks, key=lambda r: sum(r.comm.values())).comm
    spans = {"tp": dims.tp, "fsdp": dims.tp * dims.dp_shard, "pp": dims.world_size, "dp_replicate": dims.world_size}
    groups = {"tp": dims.tp, "fsdp": dims.dp_shard, "pp": 2, "dp_replicate": dims.dp_replicate}
    seconds = {dim: 0.0 for dim in groups}
    for (kind, dim), n in comm.items():
        seconds[dim] += _comm_seconds(n, groups[dim], gpu, spans[dim])
    calls = (plan.model_args.n_layers // dims.pp + 2) * 3 * plan.batch.accumulation  # FSDP gathers and scatters
    seconds["fsdp"] += calls * (dims.dp_shard - 1) * RING_HOP_S if dims.dp_shard > 1 else 0
    micro = plan.pipeline.microbatches if plan.pipeline else 1
    bubble = compute * (dims.pp - 1) / micro if dims.pp > 1 else 0.0  # 1F1B idles (pp-1) micro-batch slots
    hidden = ALPHA_OVERLAP * compute
    exposed = seconds["tp"] + max(0.0, seconds["fsdp"] + seconds["pp"] + seconds["dp_replicate"] - hidden)
    return {"compute": compute, "bubble": bubble, "tp_comm": seconds["tp"], "exposed_comm": exposed - seconds["tp"],
            "total": compute + bubble + exposed}


def candidates(args, gpu: GPU) -> list[Candidate]:
    """Every layout the trainer's job plan accepts, with its peak memory and step time."""
    out = []
    spec = get_model_spec(args.model)
    layers = spec.flavors[args.flavor].n_layers
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8, 16):
            if args.gpus % (tp * pp) or tp > gpu.gpus_per_node or (pp > 1 and layers < 2 * pp):
                continue
            dp = args.gpus // (tp * pp)
            for local in (1, 2, 4, 8, 16, 32):
                if args.global_batch % (local * dp) or (pp == 1 and local > 8):
                    continue
                for ac in ("none", "selective", "full"):
                    flags = [f"--model.name={args.model}", f"--model.flavor={args.flavor}",
                             f"--training.seq_len={args.seq_len}", f"--training.local_batch_size={local}",
                             f"--training.global_batch_size={args.global_batch}",
                             "--training.mixed_precision_param=bfloat16", "--training.mixed_precision_reduce=float32",
                             f"--parallelism.tensor_parallel_degree={tp}", f"--parallelism.pipeline_parallel_degree={pp}",
                             "--parallelism.data_parallel_shard_degree=-1", f"--activation_checkpoint.mode={ac}"]
                    if pp > 1:
                        flags.append("--parallelism.pipeline_parallel_schedule=1F1B")
                    try:
                        plan = make_plan(load_config(flags), args.gpus, "cuda", check_only=True)
                    except ConfigError:
                        continue
                    peak = max(formulas.estimate_rank(plan, r).peak for r in range(pp))
                    if peak > args.memory_fraction * gpu.memory_gib * GIB:
                        continue
                    parts = step_time(plan, gpu, args.efficiency)
                    out.append(Candidate(flags, plan, peak, parts["total"], parts))
    return sorted(out, key=lambda c: (c.step_s, c.peak))


def describe(c: Candidate, gpu: GPU, rank: int) -> str:
    d, p = c.plan.dims, c.parts
    degrees = " x ".join(f"{k} {v}" for k, v in d.degrees().items() if v > 1) or "single"
    tokens = c.plan.batch.global_size * c.plan.batch.seq_len
    return "\n".join([
        f"#{rank}: {degrees}, AC {c.plan.config.activation_checkpoint.mode}, local batch {c.plan.batch.local} "
        f"x {c.plan.batch.accumulation} micro-batches: {c.step_s:.2f} s/step, "
        f"{tokens / c.step_s / d.world_size:,.0f} tokens/s/GPU; peak {c.peak / GIB:.1f} of {gpu.memory_gib} GiB",
        f"    why: compute {p['compute']:.2f} s, pipeline bubble {p['bubble']:.2f} s, TP collectives {p['tp_comm']:.2f} s, "
        f"exposed FSDP/PP transfers {p['exposed_comm']:.2f} s",
        f"    flags: {' '.join(c.flags)}",
    ])


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--global_batch", type=int, default=None, help="sequences per step (default: one per GPU)")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--efficiency", type=float, default=0.5, help="share of peak FLOPs compute reaches")
    parser.add_argument("--memory_fraction", type=float, default=0.9, help="share of GPU memory a plan may use")

    parser.error = lambda message: (_ for _ in ()).throw(ConfigError(message))  # one line, exit 2
    args = parser.parse_args(argv)
    if args.model not in list_model_specs():
        raise ConfigError(f"--model {args.model!r} is not one of {list_model_specs()}")
    if args.flavor not in get_model_spec(args.model).flavors:
        raise ConfigError(f"--flavor {args.flavor!r} is not a flavor of {args.model}: {sorted(get_model_spec(args.model).flavors)}")
    if args.gpu not in GPUS:
        raise ConfigError(f"--gpu {args.gpu!r} is not one of {sorted(GPUS)}")
    for name in ("gpus", "seq_len", "top"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} {getattr(args, name)} must be >= 1")
    if not 0 < args.efficiency <= 1 or not 0 < args.memory_fraction <= 1:
        raise ConfigError("--efficiency and --memory_fraction must be within (0, 1]")
    args.global_batch = args.global_batch or args.gpus
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        gpu = GPUS[args.gpu]
        found = candidates(args, gpu)
        if not found:
            raise ConfigError(f"no layout of {args.model}/{args.flavor} fits {args.gpus} x {gpu.name} "
                              f"at seq_len {args.seq_len}, global batch {args.global_batch}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.model}/{args.flavor} on {args.gpus} x {gpu.name}, seq_len {args.seq_len}, global batch "
          f"{args.global_batch} sequences; {len(found)} layouts fit, best {min(args.top, len(found))}:")
    for i, c in enumerate(found[:args.top], 1):
        print(describe(c, gpu, i))
    return 0


if __name__ == "__main__":
    sys.exit(main())
