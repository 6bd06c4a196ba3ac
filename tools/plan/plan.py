"""Command line: `plan --model llama3 --flavor 70B --gpus 256 --gpu h100 [--seq_len 8192]
[--global_batch N] [--top 3] [--efficiency 0.5] [--memory_fraction 0.9]`.

Enumerates layouts the trainer can run (HSDP replicas x FSDP x CP x TP x PP with each pipeline
schedule and stages per rank, float8, async TP, AC mode, local batch; compiled wherever the
trainer can compile), keeps those the trainer's own job plan accepts and whose closed-form peak
(tools/estimate/formulas.py) fits, ranks them by the step-time model of README.md and prints the
best distinct layouts with their reasoning and the exact trainer flags. Bad input: one line on
stderr, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import logging
import sys

# torchao's import reports optional kernels it cannot load and deprecated pytree registrations;
# the planner runs neither
for _logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_logger).setLevel(logging.ERROR)

from tessera.mesh import resolve_parallel_dims  # noqa: E402
from tessera.models import get_model_spec, list_model_specs  # noqa: E402
from tessera.trainer.config import ActivationCheckpoint, ConfigError, load_config  # noqa: E402
from tessera.trainer.plan import JobPlan, make_plan  # noqa: E402

import formulas  # noqa: E402
import step_time  # noqa: E402
from gpus import GIB, GPU, GPUS  # noqa: E402
from schedules import SCHEDULES, layers_per_stage  # noqa: E402

AC_MODES = ("none", "selective", "full")
LONG_CONTEXT = 32768  # context parallel is tried from this seq_len on


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run the job, short of the AC mode."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    schedule: str | None  # None without pipeline parallelism
    stages_per_rank: int
    layers_per_stage: int | None
    float8: bool
    local: int
    async_tp: bool = False  # torch's async TP (an inductor pass: compiled plans only)
    reduce_every: bool = False  # FSDP reduce-scatters every accumulation micro-batch, not once after the last

    @property
    def compiled(self) -> bool:
        """torch.compile wherever the trainer allows it (not with CP yet), as in the efficiency's fit."""
        return self.cp == 1

    @property
    def key(self) -> tuple[int, int, int, int]:
        """What makes layouts distinct in the ranking: (data-parallel, cp, tp, pp) degrees; FSDP
        against HSDP, like the schedule, float8, async TP, AC and batch, is a variant of one."""
        return self.dp_replicate * self.dp_shard, self.cp, self.tp, self.pp

    def flags(self, args, ac: str) -> list[str]:
        par = "--parallelism."
        flags = [f"--model.name={args.model}", f"--model.flavor={args.flavor}", f"--model.tokenizer_path={args.tokenizer_path}",
                 f"--training.seq_len={args.seq_len}",
                 f"--training.local_batch_size={self.local}", f"--training.global_batch_size={args.global_batch}",
                 "--training.mixed_precision_param=bfloat16", "--training.mixed_precision_reduce=float32",
                 f"{par}data_parallel_replicate_degree={self.dp_replicate}", f"{par}data_parallel_shard_degree={self.dp_shard}",
                 f"{par}tensor_parallel_degree={self.tp}", f"{par}context_parallel_degree={self.cp}",
                 f"{par}pipeline_parallel_degree={self.pp}", f"--activation_checkpoint.mode={ac}"]
        if self.compiled:
            flags.append("--compile.enable=true")
        if self.reduce_every:
            flags.append(f"{par}fsdp_reduce_every_microbatch=true")
        if self.async_tp:
            flags.append(f"{par}enable_async_tensor_parallel=true")
        if self.schedule:
            flags.append(f"{par}pipeline_parallel_schedule={self.schedule}")
        if self.layers_per_stage:
            flags.append(f"{par}pipeline_parallel_layers_per_stage={self.layers_per_stage}")
        if self.float8:
            flags.append("--model.converters=float8")
            if self.dp_shard * self.cp > 1:  # FSDP gathers the float8 linears' weights in float8
                flags += ["--float8.enable_fsdp_float8_all_gather=true", "--float8.precompute_float8_dynamic_scale_for_fsdp=true"]
        return flags


@dataclasses.dataclass
class Candidate:
    layout: Layout
    ac: str
    flags: list[str]
    plan: JobPlan
    peak: int
    step_s: float
    parts: dict[str, float]


def _shard_options(rest: int, inner: int, gpu: GPU) -> list[tuple[int, int]]:
    """(dp_replicate, dp_shard) splits of the `rest` data-parallel ranks: all sharded (FSDP), or
    HSDP with each replica's shards on 1, 2, 4 or 8 whole nodes (`inner`: cp x tp ranks each)."""
    out = [(1, rest)]
    for nodes in (1, 2, 4, 8):
        shard = nodes * gpu.gpus_per_node // inner if nodes * gpu.gpus_per_node % inner == 0 else 0
        if shard > 1 and rest % shard == 0 and rest // shard > 1:
            out.append((rest // shard, shard))
    return out


def _torch_accepts(schedule: str | None, pp: int, microbatches: int) -> bool:
    """torch 2.13's own schedule checks, which the trainer's job plan does not make yet: 1F1B
    needs as many micro-batches as stages; the interleaved ones a multiple of their rounds."""
    if schedule == "1F1B":
        return microbatches >= pp
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return microbatches % max(1, microbatches // pp) == 0
    return True


def layouts(args, gpu: GPU):
    """Every layout to try, with the AC modes: TP within a node, CP from LONG_CONTEXT on, each
    pipeline schedule with each stages-per-rank count the layers allow, FSDP or HSDP over the
    rest, float8 where the GPU has it, async TP wherever TP and compile are on (never slower in
    the step-time model, so the synchronous variant is not tried); local batch: 1-16 sequences
    without a pipeline, else the whole data-parallel share in one pass of micro-batches of one
    sequence (more micro-batches only shrink a bubble while the held activations stay capped,
    GPipe's aside)."""
    layers = get_model_spec(args.model).flavors[args.flavor].n_layers
    for tp in (t for t in args.tp if t <= gpu.gpus_per_node):
        for cp in (1, 2, 4, 8) if args.seq_len >= LONG_CONTEXT else (1,):
            for pp in (1, 2, 4, 8, 16):
                if args.gpus % (tp * cp * pp) or (pp > 1 and layers < 2 * pp):
                    continue
                pipelines = [(None, 1, None)] if pp == 1 else [
                    (s.name, v, layers_per_stage(s.name, pp, v, layers)) for s in SCHEDULES.values() for v in s.stages_per_rank]
                for replicate, shard in _shard_options(args.gpus // (tp * cp * pp), tp * cp, gpu):
                    dp = replicate * shard
                    locals_ = (1, 2, 4, 8, 16) if pp == 1 else (args.global_batch // dp,)
                    for schedule, v, per_stage in pipelines:
                        for local in locals_:
                            if per_stage is False or not local or args.global_batch % (local * dp) \
                                    or not _torch_accepts(schedule, pp, local):
                                continue
                            accumulates = pp == 1 and shard * cp > 1 and args.global_batch > local * dp
                            for float8, every in itertools.product((False, True) if gpu.has_float8 else (False,),
                                                                   (False, True) if accumulates else (False,)):
                                layout = Layout(replicate, shard, cp, tp, pp, schedule, v, per_stage, float8, local,
                                                async_tp=tp > 1 and cp == 1, reduce_every=every)
                                for ac in AC_MODES:
                                    yield layout, ac


def lower_bound(layout: Layout, ac: str, args, gpu: GPU, a, fp8: frozenset[str]) -> float:
    """Compute, bubble and TP collectives of the average pp rank of model args `a`: no more than
    the step-time model's total for the layout (the busiest rank computes at least the average, TP
    is linear in a rank's modules, other communication only adds), so the search can skip layouts
    whose bound exceeds the times already found."""
    blocks = a.n_layers / layout.pp
    accumulation = args.global_batch // (layout.local * layout.dp_replicate * layout.dp_shard)
    micro = (layout.local if layout.pp > 1 else 1) * accumulation
    tokens = layout.local * args.seq_len * accumulation
    fp8 = fp8 if layout.float8 else frozenset()
    efficiency = step_time.run_efficiency(args.efficiency, layout.compiled)
    w = step_time.work(a, args.seq_len, tokens, micro, blocks, 1 / layout.pp, layout.tp, layout.cp,
                       step_time.recompute_share(ActivationCheckpoint(mode=ac), blocks), fp8, "bfloat16", gpu, efficiency)
    tp = micro * step_time.tp_seconds(a, tokens / layout.cp / micro, 2, blocks, 1 / layout.pp, 1 / layout.pp, ac, layout.tp,
                                      fp8, bool(fp8), layout.async_tp, step_time.peaks(gpu, "bfloat16", efficiency), gpu)
    return w.total + step_time.bubble(layout.schedule, layout.pp, layout.stages_per_rank, w) + tp


def search(args, gpu: GPU) -> tuple[list[Candidate], int, int]:
    """The best `args.top` distinct layouts (Layout.key; each with its best variant), exactly:
    layouts are tried in order of their lower bound and the search stops once that bound reaches
    the top's slowest. Returns (them, layouts enumerated, evaluated)."""
    a = get_model_spec(args.model).flavors[args.flavor]  # the vocab of the flavor's tokenizer, as a check-only plan's
    options = step_time.float8_of(load_config(["--model.converters=float8"]), resolve_parallel_dims(1))
    fp8 = step_time.float8_linears(options, a)
    tried = list(layouts(args, gpu))
    queue = [(lower_bound(layout, ac, args, gpu, a, fp8), i, layout, ac) for i, (layout, ac) in enumerate(tried)
             if _state_fits(layout, args, gpu, a)]
    heapq.heapify(queue)
    best: dict[tuple, Candidate] = {}
    plans: dict[tuple[Layout, str], JobPlan | None] = {}
    evaluated = 0
    while queue:
        bound, _, layout, ac = heapq.heappop(queue)
        top = sorted(c.step_s for c in best.values())[:args.top]
        if len(top) == args.top and bound >= top[-1]:
            break
        if layout.key in best and bound >= best[layout.key].step_s:  # cannot improve its layout
            continue
        candidate = _evaluate(layout, ac, args, gpu, plans)
        evaluated += 1
        if candidate and (layout.key not in best or candidate.step_s < best[layout.key].step_s):
            best[layout.key] = candidate
    found = sorted(best.values(), key=lambda c: (c.step_s, c.peak))[:args.top]
    return found, len(tried), evaluated


def _state_fits(layout: Layout, args, gpu: GPU, a) -> bool:
    """Whether the model state alone (formulas.state_floor, fp32 reduce as the flags ask) leaves
    room: a check before the job plan, which the pipelined layouts' make_plan makes costly."""
    held = layout.pp > 1 or (args.global_batch > layout.local * layout.dp_replicate * layout.dp_shard
                             and not layout.reduce_every)
    floor = formulas.state_floor(a, layout.tp, layout.dp_shard * layout.cp, layout.pp, held)
    return floor <= args.memory_fraction * gpu.memory_gib * GIB


def _evaluate(layout: Layout, ac: str, args, gpu: GPU, plans: dict) -> Candidate | None:
    """The trainer's job plan for the layout (None: refused) and, if the peak fits, its time."""
    flags = layout.flags(args, ac)
    if (layout, ac) not in plans:
        try:
            plans[layout, ac] = make_plan(load_config(flags), args.gpus, "cuda", check_only=True)
        except ConfigError:
            plans[layout, ac] = None
    plan = plans[layout, ac]
    if plan is None:
        return None
    estimates = [formulas.estimate_rank(plan, r) for r in range(layout.pp)]
    peak = max(e.peak for e in estimates)
    if peak > args.memory_fraction * gpu.memory_gib * GIB:
        return None
    parts = step_time.step_time(plan, gpu, args.efficiency, estimates)
    return Candidate(layout, ac, flags, plan, peak, parts["total"], parts)


def describe(c: Candidate, gpu: GPU, rank: int) -> str:
    d, p, lay = c.plan.dims, c.parts, c.layout
    degrees = " x ".join(f"{k} {v}" for k, v in d.degrees().items() if v > 1) or "single"
    pipeline = f", {lay.schedule} with {lay.stages_per_rank} stage(s) per rank" if lay.schedule else ""
    tokens = c.plan.batch.global_size * c.plan.batch.seq_len
    return "\n".join([
        f"#{rank}: {degrees}{pipeline}, {'float8' if lay.float8 else 'bf16'}, "
        f"{('compiled + async TP' if lay.async_tp else 'compiled') if lay.compiled else 'eager'}, "
        f"AC {c.ac}, local batch {c.plan.batch.local} "
        f"x {c.plan.batch.accumulation} step(s){' (FSDP reduces each)' if lay.reduce_every else ''}: {c.step_s:.2f} s/step, {tokens / c.step_s / d.world_size:,.0f} tokens/s/GPU; "
        f"peak {c.peak / GIB:.1f} of {gpu.memory_gib} GiB",
        "    why: " + ", ".join(f"{name} {p[key]:.2f} s" for key, name in (
            ("compute", "compute"), ("bubble", "pipeline bubble"), ("tp", "TP collectives"), ("cp", "CP K/V gathers"),
            ("fsdp", "exposed FSDP/HSDP"), ("pp", "pipeline transfers")) if p[key] or key == "compute"),
        f"    flags: {' '.join(c.flags)}",
    ])


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--tokenizer_path", default="./assets/tokenizer/original/tokenizer.model",
                        help="the run's tokenizer (the shipped configs' path); missing here: the flavor's vocabulary")
    parser.add_argument("--global_batch", type=int, default=None, help="sequences per step (default: one per GPU)")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--tp", default="1,2,4,8", help="tensor-parallel degrees to try (comma-separated)")
    parser.add_argument("--efficiency", type=float, default=0.35, help="share of the bf16 peak compiled compute reaches (README)")
    parser.add_argument("--memory_fraction", type=float, default=0.9, help="share of GPU memory a plan may use")

    parser.error = lambda message: (_ for _ in ()).throw(ConfigError(message))  # one line, exit 2
    args = parser.parse_args(argv)
    if args.model not in list_model_specs():
        raise ConfigError(f"--model {args.model!r} is not one of {list_model_specs()}")
    if args.model not in formulas.LLAMA_SHAPED:
        raise ConfigError(f"--model {args.model}: the planner's closed form covers {', '.join(formulas.LLAMA_SHAPED)} only "
                          "(tools/estimate traces the others)")
    if args.flavor not in get_model_spec(args.model).flavors:
        raise ConfigError(f"--flavor {args.flavor!r} is not a flavor of {args.model}: {sorted(get_model_spec(args.model).flavors)}")
    if args.gpu not in GPUS:
        raise ConfigError(f"--gpu {args.gpu!r} is not one of {sorted(GPUS)}")
    for name in ("gpus", "seq_len", "top"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} {getattr(args, name)} must be >= 1")
    if not 0 < args.efficiency <= 1 or not 0 < args.memory_fraction <= 1:
        raise ConfigError("--efficiency and --memory_fraction must be within (0, 1]")
    try:
        args.tp = tuple(int(t) for t in args.tp.split(","))
    except ValueError:
        raise ConfigError(f"--tp {args.tp!r} is not a comma-separated list of degrees") from None
    if any(t < 1 for t in args.tp):
        raise ConfigError(f"--tp {args.tp} must be >= 1")
    args.global_batch = args.global_batch or args.gpus
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        gpu = GPUS[args.gpu]
        found, enumerated, evaluated = search(args, gpu)
        if not found:
            raise ConfigError(f"no layout of {args.model}/{args.flavor} fits {args.gpus} x {gpu.name} "
                              f"at seq_len {args.seq_len}, global batch {args.global_batch}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.model}/{args.flavor} on {args.gpus} x {gpu.name}, seq_len {args.seq_len}, global batch "
          f"{args.global_batch} sequences: best {len(found)} distinct layouts ({enumerated} candidates, "
          f"{evaluated} evaluated, the rest bounded out or over memory on their model state alone):")
    for i, c in enumerate(found, 1):
        print(describe(c, gpu, i))
    return 0


if __name__ == "__main__":
    sys.exit(main())
