"""Command line: `plan --model llama3 --flavor 70B --gpus 256 --gpu h100 [--seq_len 8192]
[--global_batch N] [--top 3] [--tp 1,2,4,8] [--efficiency 0.35] [--memory_fraction 0.9] [--max_traced 100]`.

Enumerates layouts the trainer can run (HSDP replicas x FSDP x CP x TP x PP with each pipeline
schedule and stages per rank, EP for MoE models, float8, async TP, AC mode, local batch), keeps
those the trainer's own job plan accepts (compiled where it takes compile, else eager) and whose peak
fits (the closed form of tools/estimate/formulas.py for Llama-shaped models, the traced estimate
for the others), ranks them by the step-time model of README.md and prints the best distinct
layouts with their reasoning and the exact trainer flags. Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import heapq
import itertools
import sys

import torch

from tessera import pp as tessera_pp
from tessera.ep import find_experts
from tessera.models import get_model_spec, list_model_specs
from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.gpus import GIB, GPU, PLANNED as GPUS
from tessera.trainer.plan import JobPlan, make_plan

import formulas
import step_time
import traced
from schedules import SCHEDULES, layers_per_stage

AC_MODES = ("none", "selective", "full", "offload", "memory_budget")
MEMORY_BUDGET = 0.5  # the budget mode memory_budget is planned at (compile's partitioner keeps half)
LOSS_CHUNK = 1024  # tokens a chunk of the chunked loss (training.loss_chunk_size) projects at a time
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
    async_tp: bool = False  # torch's async TP (an inductor pass: where the plan compiles)
    reduce_every: bool = False  # FSDP reduce-scatters every accumulation micro-batch, not once after the last
    ep: int = 1  # expert parallel (MoE models): all cp x tp ranks and part of dp_shard
    loss_chunk: int = 0  # training.loss_chunk_size: 0 the whole logits

    def accumulation(self, global_batch: int) -> int:
        """Micro-batches of `local` sequences a step takes to reach `global_batch` (with a
        pipeline: passes of its local batch)."""
        return global_batch // (self.local * self.dp_replicate * self.dp_shard)

    @property
    def key(self) -> tuple[int, ...]:
        """What makes layouts distinct in the ranking: (data-parallel, cp, tp, pp, ep) degrees; FSDP
        against HSDP, like the schedule, float8, async TP, AC and batch, is a variant of one."""
        return self.dp_replicate * self.dp_shard, self.cp, self.tp, self.pp, self.ep

    def flags(self, args, ac: str, compiled: bool = True) -> list[str]:
        """The trainer's flags; `compiled`: torch.compile (and async TP where the layout asks)."""
        par = "--parallelism."
        flags = [f"--model.name={args.model}", f"--model.flavor={args.flavor}", f"--model.tokenizer_path={args.tokenizer_path}",
                 f"--training.seq_len={args.seq_len}",
                 f"--training.local_batch_size={self.local}", f"--training.global_batch_size={args.global_batch}",
                 "--training.mixed_precision_param=bfloat16", "--training.mixed_precision_reduce=float32",
                 f"{par}data_parallel_replicate_degree={self.dp_replicate}", f"{par}data_parallel_shard_degree={self.dp_shard}",
                 f"{par}tensor_parallel_degree={self.tp}", f"{par}context_parallel_degree={self.cp}",
                 f"{par}pipeline_parallel_degree={self.pp}", f"--activation_checkpoint.mode={ac}"]
        if ac == "memory_budget":
            flags.append(f"--activation_checkpoint.memory_budget={MEMORY_BUDGET}")
        if self.ep > 1:
            flags.append(f"{par}expert_parallel_degree={self.ep}")
        if self.loss_chunk:
            flags.append(f"--training.loss_chunk_size={self.loss_chunk}")
        if compiled:
            flags.append("--compile.enable=true")
        if self.reduce_every:
            flags.append(f"{par}fsdp_reduce_every_microbatch=true")
        if self.async_tp and compiled:
            flags.append(f"{par}enable_async_tensor_parallel=true")
        if self.schedule:
            flags.append(f"{par}pipeline_parallel_schedule={self.schedule}")
        if self.layers_per_stage:
            flags.append(f"{par}pipeline_parallel_layers_per_stage={self.layers_per_stage}")
        if self.float8:
            flags.append("--model.converters=float8")
            if self.loss_chunk:  # the chunked loss projects in high precision
                flags.append("--float8.filter_fqns=output")
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


def _schedule_accepts(schedule: str | None, pp: int, v: int, microbatches: int) -> bool:
    """The micro-batch rules of torch's schedules (tessera.pp.check_microbatches, which the job
    plan applies too), before the costlier job plan."""
    try:
        tessera_pp.check_microbatches(schedule, pp, pp * v, microbatches)
    except ValueError:
        return False
    return True


def layouts(args, gpu: GPU):
    """Every layout to try, with the AC modes: TP within a node, CP from LONG_CONTEXT on, each
    pipeline schedule with each stages-per-rank count the layers allow, FSDP or HSDP over the
    rest, float8 where the GPU has it, async TP wherever TP and compile are on (never slower in
    the step-time model, so the synchronous variant is not tried); local batch: 1-16 sequences
    without a pipeline, else the whole data-parallel share in one pass of micro-batches of one
    sequence (more micro-batches only shrink a bubble while the held activations stay capped,
    GPipe's aside); the whole logits' loss or the chunked one (it costs one more forward of the
    output projection, so it wins only where it lets a faster layout fit). Models without the
    closed form (`traced`): no pipeline, no float8, synchronous TP, the whole logits, no memory
    budget (the trace runs uncompiled), no offload (the host link is priced by the closed form's
    block activations); for MoE models every expert-parallel degree the trainer takes (a
    multiple of cp x tp whose quotient divides dp_shard, dividing the experts)."""
    spec = get_model_spec(args.model)
    a = spec.flavors[args.flavor]
    layers, experts, traced_model = a.n_layers, spec.n_experts(a), args.model not in formulas.LLAMA_SHAPED
    for tp in args.tp:
        for cp in (1, 2, 4, 8) if args.seq_len >= LONG_CONTEXT else (1,):
            for pp in (1,) if traced_model else (1, 2, 4, 8, 16):
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
                                    or not _schedule_accepts(schedule, pp, v, local):
                                continue
                            accumulates = pp == 1 and shard * cp > 1 and args.global_batch > local * dp
                            eps = [e for e in (1, 2, 4, 8, 16, 32, 64, 128, 256) if e == 1 or experts and experts % e == 0
                                   and e % (cp * tp) == 0 and shard % (e // (cp * tp)) == 0]
                            for float8, every, ep, chunk in itertools.product(
                                    (False, True) if gpu.has_float8 and not traced_model else (False,),
                                    (False, True) if accumulates else (False,), eps,
                                    (0,) if traced_model else (0, LOSS_CHUNK)):
                                layout = Layout(replicate, shard, cp, tp, pp, schedule, v, per_stage, float8, local,
                                                async_tp=tp > 1 and not traced_model, reduce_every=every, ep=ep,
                                                loss_chunk=chunk)
                                for ac in AC_MODES:
                                    # a trace runs uncompiled, and prices no host transfer
                                    if not (traced_model and ac in ("memory_budget", "offload")):
                                        yield layout, ac


def lower_bound(layout: Layout, ac: str, args, gpu: GPU, a, fp8: frozenset[str]) -> float:
    """Compute, bubble and TP collectives of the average pp rank of model args `a`: no more than
    the step-time model's total for the layout (the busiest rank computes at least the average, TP
    is linear in a rank's modules, other communication only adds), so the search can skip layouts
    whose bound exceeds the times already found; compiled, as compile is never slower in the
    model; offload's copies back to the device. Models without the closed form: compute and
    expert parallel's all-to-alls (_all_to_all_floor)."""
    blocks = a.n_layers / layout.pp
    accumulation = layout.accumulation(args.global_batch)
    micro = (layout.local if layout.pp > 1 else 1) * accumulation
    tokens = layout.local * args.seq_len * accumulation
    fp8 = fp8 if layout.float8 else frozenset()
    efficiency = step_time.run_efficiency(args.efficiency, True)
    if args.model not in formulas.LLAMA_SHAPED:
        w = step_time.spec_work(get_model_spec(args.model), a, args.seq_len, tokens, accumulation, layout.tp, layout.cp,
                                step_time.recompute_share(ac, a.n_layers, memory_budget=MEMORY_BUDGET), "bfloat16", gpu,
                                efficiency)
        return w.total + _all_to_all_floor(layout, a, _moe_layers(args.model, args.flavor), tokens / layout.cp / layout.tp, gpu)
    w = step_time.work(a, args.seq_len, tokens, micro, blocks, 1 / layout.pp, layout.tp, layout.cp,
                       step_time.recompute_share(ac, blocks, memory_budget=MEMORY_BUDGET), fp8, "bfloat16", gpu, efficiency,
                       bool(layout.loss_chunk))
    tp = micro * step_time.tp_seconds(a, tokens / layout.cp / micro, 2, blocks, 1 / layout.pp, 1 / layout.pp, ac, layout.tp,
                                      fp8, bool(fp8), layout.async_tp, step_time.peaks(gpu, "bfloat16", efficiency), gpu)
    # offload: the activations' copies back, exposed whole (step_time.offload_seconds), their bulk at least
    offload = (ac == "offload") * blocks * formulas.linear_activations(a, tokens / layout.cp, layout.tp, 2) / \
        (gpu.host_gbps * 1e9)
    return w.total + step_time.bubble(layout.schedule, layout.pp, layout.stages_per_rank, w) + tp + offload


def _all_to_all_floor(layout: Layout, a, moe_layers: int, rows: float, gpu: GPU) -> float:
    """Expert parallel's exchange at its least: each of the `moe_layers` sends the rank's routed
    rows (its `rows` tokens x top_k, bf16) out and back, forward and backward, (ep-1)/ep of them through
    each GPU's link (the ep group is consecutive ranks: NVLink within a node, else the NIC; the
    balanced routing the estimate assumes, tools/estimate README)."""
    if layout.ep <= 1:
        return 0.0
    sent = 2 * 2 * moe_layers * rows * a.moe.top_k * a.dim * 2
    return step_time.ring_seconds(sent, layout.ep, step_time.group_nodes(layout.ep, 1, gpu), gpu)[1]


@traced.shared_meshes()  # layouts of equal dims (AC modes, local batches) share DTensor's caches
def search(args, gpu: GPU, traces: dict | None = None) -> tuple[list[Candidate], int, int, float | None]:
    """The best `args.top` distinct layouts (Layout.key; each with its best variant), exactly:
    layouts are tried in order of their lower bound and the search stops once that bound reaches
    the top's slowest. Models without the closed form are traced, a few seconds a layout, so at
    most `args.max_traced` layouts are, likeliest first (the result then says so). Returns (them,
    layouts enumerated, evaluated, and where the cap stopped the search the least lower bound left
    untried, else None)."""
    a = get_model_spec(args.model).flavors[args.flavor]  # the vocab of the flavor's tokenizer, as a check-only plan's
    traced_model = args.model not in formulas.LLAMA_SHAPED
    options = None if traced_model else formulas.float8_of(make_plan(load_config(["--model.converters=float8"]), 1, "cuda",
                                                                     check_only=True))
    fp8 = formulas.float8_linears(options, a)
    counts = _parameter_counts(args) if traced_model else None
    tried = list(layouts(args, gpu))
    fits = {layout: _state_fits(layout, args, gpu, a, counts) for layout in dict.fromkeys(layout for layout, _ in tried)}
    queue = [(lower_bound(layout, ac, args, gpu, a, fp8), i, layout, ac) for i, (layout, ac) in enumerate(tried)
             if fits[layout]]
    if traced_model:  # the likeliest first, so that a capped search finds them: FSDP's traffic guessed on top
        queue = [(bound + _fsdp_guess(layout, args, a, counts, gpu, bound) + _tp_guess(layout, ac, args, a, gpu), i, layout,
                  ac, bound) for bound, i, layout, ac in queue]
    else:
        queue = [(bound, i, layout, ac, bound) for bound, i, layout, ac in queue]
    heapq.heapify(queue)
    best: dict[tuple, Candidate] = {}
    plans: dict[tuple[Layout, str], JobPlan | None] = {}
    traces: dict[tuple[Layout, str], traced.RankMemory] = {} if traces is None else traces  # a caller's, to reuse
    too_big: dict[tuple[Layout, bool], list[tuple[Layout, str]]] = {}  # layouts over memory, by _family
    kept: dict[tuple, float] = {}  # activation bytes per sequence seen, by _kept_key
    fitted: set[tuple[Layout, str]] = set()
    evaluated, stopped_at = 0, None
    while queue:
        priority, i, layout, ac, bound = heapq.heappop(queue)
        top = sorted(c.step_s for c in best.values())[:args.top]
        if len(top) == args.top and bound >= top[-1]:
            if not traced_model:  # in bound order: none left can do better
                break
            continue
        if layout.key in best and bound >= best[layout.key].step_s:  # cannot improve its layout
            continue
        family = _family(layout, args)
        if any(_needs_more(layout, ac, *over) for over in too_big.get(family, ())) or _outrun(layout, ac, fitted):
            continue
        if traced_model and priority < _LAST and _likely_over(layout, ac, args, gpu, counts, kept):
            heapq.heappush(queue, (priority + _LAST, i, layout, ac, bound))  # try it once the likelier fits are
            continue
        if traced_model and len(traces) >= args.max_traced:
            stopped_at = min(q[-1] for q in [*queue, (bound,)])
            break
        candidate = _evaluate(layout, ac, args, gpu, plans, traces)
        evaluated += 1
        if (layout, ac) in traces:  # what a sequence keeps (with held gradients): to guess the others' memory
            kept[_kept_key(layout, ac, args)] = traces[layout, ac].activations / layout.local
        if candidate is None and plans[layout, ac] is not None and ac != "offload":  # (offload's may be host memory's)
            too_big.setdefault(family, []).append((layout, ac))
        if candidate:
            fitted.add((layout, ac))
        if candidate and (layout.key not in best or candidate.step_s < best[layout.key].step_s):
            best[layout.key] = candidate
    found = sorted(best.values(), key=lambda c: (c.step_s, c.peak))[:args.top]
    return found, len(tried), evaluated, stopped_at


def _outrun(layout: Layout, ac: str, fitted: set[tuple[Layout, str]]) -> bool:
    """Whether a twin that fits is faster in the step-time model: the whole logits' loss beside
    the chunked one, AC none beside offload (each saves memory by only adding time). A twin's bound
    is lower, so it was tried first."""
    return bool(layout.loss_chunk) and (dataclasses.replace(layout, loss_chunk=0), ac) in fitted or \
        ac == "offload" and (layout, "none") in fitted


def _fsdp_guess(layout: Layout, args, a, counts: tuple[int, int], gpu: GPU, compute: float) -> float:
    """A guess (to order a capped search, never to prune) at FSDP/HSDP's exposed seconds: every
    micro-batch gathers the rank's TP-local bf16 weights twice (forward, then backward), every
    reduction moves their fp32 gradients, over the shard group's links (the experts' smaller
    group under EP taken as the shard group), and the replicas all-reduce the shards; hidden
    behind `compute` as step_time.traced_step_time hides them."""
    weights = _tp_local_weights(layout, counts)
    micro = layout.accumulation(args.global_batch)
    reductions = micro if layout.reduce_every else 1
    shard = layout.dp_shard * layout.cp
    nodes = step_time.group_nodes(shard, layout.tp, gpu)
    seconds = micro * step_time.ring_seconds(2 * 2 * weights, shard, nodes, gpu)[1] + \
        reductions * step_time.ring_seconds(4 * weights, shard, nodes, gpu)[1]
    if layout.dp_replicate > 1:
        seconds += reductions * step_time.ring_seconds(4 * weights / shard, layout.dp_replicate, step_time.group_nodes(
            layout.dp_replicate, shard * layout.tp, gpu), gpu, all_reduce=True)[1]
    return step_time.exposed_behind_units(seconds, seconds, compute, (a.n_layers + 1) * micro)


def _family(layout: Layout, args) -> tuple[Layout, bool]:
    """Layouts whose memory orders by _needs_more: alike but for the local batch, the HSDP split
    and AC, and holding whole gradients alike. Not across expert parallel degrees: more ep ways
    hold fewer experts but larger all-to-all buffers (Qwen3's MoE debug flavor, FSDP 8, local 8:
    EP 2 peaks 5 % above EP 1)."""
    return dataclasses.replace(layout, dp_replicate=0, dp_shard=0, local=0), _holds_gradients(layout, args)


# more kept for backward, more memory; selective "op" and compile's budget are not ordered (a family's
# matmuls decide what "op" keeps)
_AC_KEEPS = {"none": 2, "selective": 1, "memory_budget": 1, "full": 0, "offload": -1}


def _needs_more(layout: Layout, ac: str, over: Layout, over_ac: str) -> bool:
    """Whether `layout` needs at least the memory of `over` (of its _family): as many sequences or
    more, its shards as few or fewer ways (its state less split), AC keeping as much or more."""
    keeps_more = ac == over_ac or _AC_KEEPS[ac] > _AC_KEEPS[over_ac]
    return layout.local >= over.local and layout.dp_shard <= over.dp_shard and keeps_more


_LAST = 1e6  # added to the priority of a layout deferred as likely over memory


def _likely_over(layout: Layout, ac: str, args, gpu: GPU, counts: tuple[int, int], kept: dict) -> bool:
    """A guess (to order a capped search, never to prune) that the layout will not fit: its state
    as _state_fits counts it plus the activations per sequence a traced layout alike (_kept_key)
    kept, times its sequences, over memory by more than 5 %."""
    per_sequence = kept.get(_kept_key(layout, ac, args))
    if per_sequence is None:
        return False
    return _sharded_state(layout, counts) + per_sequence * layout.local > 1.05 * args.memory_fraction * gpu.memory_gib * GIB


def _kept_key(layout: Layout, ac: str, args) -> tuple:
    """What a sequence's activations depend on, with FSDP's whole gradients (the trace counts those
    held under accumulation with the activations; expert parallel splits the experts')."""
    return layout.tp, layout.cp, layout.ep, ac, _holds_gradients(layout, args)


def _tp_guess(layout: Layout, ac: str, args, a, gpu: GPU) -> float:
    """A guess (to order a capped search) at synchronous TP's seconds: sequence parallel's gathers
    and reduce-scatters of the hidden states, two of each per block and pass (forward, backward,
    full AC's recompute), each a ring over NVLink."""
    if layout.tp <= 1:
        return 0.0
    micro = layout.accumulation(args.global_batch)
    passes = 3 if ac == "full" else 2
    one = step_time.ring_seconds(layout.local * args.seq_len / layout.cp * a.dim * 2, layout.tp, 1, gpu)
    return micro * a.n_layers * passes * 4 * sum(one)


def _holds_gradients(layout: Layout, args) -> bool:
    """Whether FSDP holds whole gradients between backwards (a pipeline, or accumulation reducing
    once after the last micro-batch)."""
    return layout.pp > 1 or (layout.accumulation(args.global_batch) > 1 and not layout.reduce_every)


def _sharded_state(layout: Layout, counts: tuple[int, int]) -> float:
    """fp32 weights and AdamW's two moments of every parameter (`counts`: _parameter_counts) split
    tp x dp_shard x cp ways: TP replicates some, so a floor."""
    return 3 * formulas.F32 * counts[0] / (layout.tp * layout.dp_shard * layout.cp)


def _tp_local_weights(layout: Layout, counts: tuple[int, int]) -> float:
    """Parameters a rank holds whole between FSDP's gathers: all split tp ways, the routed experts
    ep ways more."""
    total, experts = counts
    return ((total - experts) + experts / layout.ep) / layout.tp


@functools.cache
def _meta_model(model: str, flavor: str) -> torch.nn.Module:
    """The flavor's model on the meta device, built once."""
    spec = get_model_spec(model)
    with torch.device("meta"):
        return spec.build(spec.flavors[flavor])


@functools.cache
def _moe_layers(model: str, flavor: str) -> int:
    """The flavor's blocks that hold routed experts (the MoE seam's `experts` module): all but
    DeepSeek's leading dense ones, every second of Llama 4 Maverick's."""
    return sum(bool(find_experts(block, required=False)) for block in _meta_model(model, flavor).layers.values())


def _parameter_counts(args) -> tuple[int, int]:
    """(all parameters, the routed experts') of the flavor."""
    params = dict(_meta_model(args.model, args.flavor).named_parameters())
    return sum(p.numel() for p in params.values()), sum(p.numel() for n, p in params.items() if ".experts." in n)


def _state_fits(layout: Layout, args, gpu: GPU, a, counts: tuple[int, int] | None) -> bool:
    """Whether the model state alone (formulas.state_floor, fp32 reduce as the flags ask) leaves
    room: a check before the job plan, which the pipelined layouts' make_plan makes costly. Models
    without the closed form (`counts` from _parameter_counts): fp32 weights and AdamW's moments of
    every parameter split tp x dp_shard x cp ways, the held gradients tp ways (the experts' ep
    ways more) — TP replicates some, so this is a floor."""
    held = _holds_gradients(layout, args)
    if counts is None:
        floor = formulas.state_floor(a, layout.tp, layout.dp_shard * layout.cp, layout.pp, held)
    else:
        floor = _sharded_state(layout, counts) + held * formulas.F32 * _tp_local_weights(layout, counts)
    return floor <= args.memory_fraction * gpu.memory_gib * GIB


def _job_plan(layout: Layout, ac: str, args, plans: dict) -> tuple[JobPlan, list[str]] | None:
    """The trainer's job plan for the layout and its flags (None: refused), made once: compiled
    where the plan takes compile (every layout since issue 34; a family may still refuse it), else
    eager."""
    if (layout, ac) not in plans:
        plans[layout, ac] = None
        for compiled in (True, False):
            flags = layout.flags(args, ac, compiled)
            try:
                plans[layout, ac] = make_plan(load_config(flags), args.gpus, "cuda", check_only=True), flags
                break
            except ConfigError:
                continue
    return plans[layout, ac]


def _reduction(key: tuple[str, str]) -> bool:
    """Whether a collective (kind, mesh dim) is FSDP/HSDP's gradient reduction: a reduce-scatter
    over the dims FSDP shards over, an all-reduce over the replicas (HSDP, DDP). An all-reduce over
    the shard dims is the gradient norm's (tessera.fsdp.clip_grad_norm_), once a step."""
    kind, dim = key
    dim = step_time.job_dim(dim)
    return (kind == "reduce_scatter" and dim in step_time.FSDP_DIMS) or (kind == "all_reduce" and dim == "dp_replicate")


@traced.shared_meshes()  # its local batches of 2 and 4 have equal dims
def traced_estimate(layout: Layout, ac: str, args, plans: dict, traces: dict) -> traced.RankMemory:
    """traced.trace_by_blocks of the layout's job plan, made once. Under accumulation a local batch
    of 8 or more sequences is extended from the traces of 2 and 4 (accumulating too): the
    activations and each phase's peak grow by the same bytes per sequence, a step's collectives
    are its micro-batches' (each linear in the sequences) plus the gradient reductions (once a
    step, or once a micro-batch). Not from 1: one sequence's peak falls elsewhere in the step
    (DeepSeek's debug flavor: 1.9 % lower at 4 from 1 and 2). test_plan checks it against the
    direct trace."""
    def trace(lay: Layout) -> traced.RankMemory:
        if (lay, ac) not in traces:
            traces[lay, ac] = traced.trace_by_blocks(_job_plan(lay, ac, args, plans)[0], 0)
        return traces[lay, ac]

    accumulation = layout.accumulation(args.global_batch)
    pair = [dataclasses.replace(layout, local=b) for b in (2, 4)]
    if layout.local < 8 or accumulation < 2 or any(_job_plan(lay, ac, args, plans) is None for lay in pair):
        return trace(layout)
    two, four = (trace(lay) for lay in pair)
    steps = (layout.local - 2) / 2  # of two sequences each, from 2
    runs = accumulation * layout.local // 2  # micro-batches of a step at 2 sequences each

    def grow(field: str) -> dict:
        by_2, by_4 = getattr(two, field), getattr(four, field)
        out = {}
        for key, value in by_2.items():
            if _reduction(key):  # once a step, or once a micro-batch
                out[key] = value * accumulation // runs if layout.reduce_every else value
            else:  # each micro-batch's, linear in its sequences
                per_2, per_4 = value / runs, by_4.get(key, 0) / (runs // 2)
                out[key] = round(accumulation * (per_2 + (per_4 - per_2) * steps))
        return out

    phases = {k: round(v + (four.phase_peaks[k] - v) * steps) for k, v in two.phase_peaks.items()}
    return dataclasses.replace(four, activations=round(two.activations + (four.activations - two.activations) * steps),
                               phase_peaks=phases, peak=max(phases.values()), at_peak={},
                               comm=grow("comm"), calls=grow("calls"))


def _evaluate(layout: Layout, ac: str, args, gpu: GPU, plans: dict, traces: dict) -> Candidate | None:
    """The trainer's job plan for the layout (None: refused) and, if the peak fits, its time."""
    planned = _job_plan(layout, ac, args, plans)
    if planned is None:
        return None
    plan, flags = planned
    if args.model not in formulas.LLAMA_SHAPED:  # the traced estimate, from shallow traces
        est = traced_estimate(layout, ac, args, plans, traces)
        if est.peak > args.memory_fraction * gpu.memory_gib * GIB:
            return None
        parts = step_time.traced_step_time(plan, est, gpu, args.efficiency)
        return Candidate(layout, ac, flags, plan, est.peak, parts["total"], parts)
    estimates = [formulas.estimate_rank(plan, r) for r in range(layout.pp)]
    peak = max(e.peak for e in estimates)
    host = max(e.host for e in estimates)  # activation offload's
    if peak > args.memory_fraction * gpu.memory_gib * GIB or host > args.memory_fraction * gpu.host_gib * GIB:
        return None
    parts = step_time.step_time(plan, gpu, args.efficiency, estimates)
    return Candidate(layout, ac, flags, plan, peak, parts["total"], parts)


def describe(c: Candidate, gpu: GPU, rank: int) -> str:
    d, p, lay = c.plan.dims, c.parts, c.layout
    degrees = " x ".join(f"{k} {v}" for k, v in d.degrees().items() if v > 1) or "single"
    degrees += f" (ep {d.ep} of them)" if d.ep > 1 else ""
    pipeline = f", {lay.schedule} with {lay.stages_per_rank} stage(s) per rank" if lay.schedule else ""
    tokens = c.plan.batch.global_tokens
    return "\n".join([
        f"#{rank}: {degrees}{pipeline}, {'float8' if lay.float8 else 'bf16'}, "
        f"{('compiled + async TP' if c.plan.tensor_parallel.async_tp else 'compiled') if c.plan.compile.blocks else 'eager'}, "
        f"AC {c.ac}{f' {MEMORY_BUDGET}' if c.ac == 'memory_budget' else ''}"
        f"{f', loss in chunks of {lay.loss_chunk}' if lay.loss_chunk else ''}, local batch {c.plan.batch.local} "
        f"x {c.plan.batch.accumulation} step(s){' (FSDP reduces each)' if lay.reduce_every else ''}: {c.step_s:.2f} s/step, {tokens / c.step_s / d.world_size:,.0f} tokens/s/GPU; "
        f"peak {c.peak / GIB:.1f} of {gpu.memory_gib} GiB",
        "    why: " + ", ".join(f"{name} {p[key]:.2f} s" for key, name in (
            ("compute", "compute"), ("bubble", "pipeline bubble"), ("tp", "TP collectives"), ("cp", "CP K/V gathers"),
            ("fsdp", "exposed FSDP/HSDP"), ("ep", "EP all-to-all"), ("pp", "pipeline transfers"), ("offload", "host transfers"),
            ("other", "other collectives")) if p.get(key) or key == "compute"),
        f"    flags: {' '.join(c.flags)}",
    ])


def _tp_degrees(given: str | None, gpus: int, gpu: GPU) -> tuple[int, ...]:
    """The TP degrees to try (default 1, 2, 4, 8): those that fit a node (TP stays within NVLink)
    and divide the GPUs. Given degrees of which none does are refused, naming why."""
    try:
        degrees = (1, 2, 4, 8) if given is None else tuple(int(t) for t in given.split(","))
    except ValueError:
        raise ConfigError(f"--tp {given!r} is not a comma-separated list of degrees") from None
    if any(t < 1 for t in degrees):
        raise ConfigError(f"--tp {min(degrees)} must be >= 1")
    fitting = tuple(t for t in degrees if t <= gpu.gpus_per_node and gpus % t == 0)
    if not fitting:
        t = degrees[0]
        if t > gpu.gpus_per_node:
            raise ConfigError(f"--tp {given}: {t} exceeds the {gpu.gpus_per_node} GPUs of a {gpu.name} node "
                              "(tensor parallel stays within a node)")
        raise ConfigError(f"--tp {given}: {t} does not divide --gpus {gpus}")
    return fitting


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--tokenizer_path", default="./assets/tokenizer/original/tokenizer.model",
                        help="the run's tokenizer (the shipped configs' path), checked to fit the flavor's vocabulary where present")
    parser.add_argument("--global_batch", type=int, default=None, help="sequences per step (default: one per GPU)")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--tp", default=None, help="tensor-parallel degrees to try, comma-separated (default 1,2,4,8); "
                        "those that fit a node and divide --gpus are tried")
    parser.add_argument("--efficiency", type=float, default=0.35, help="share of the bf16 peak compiled compute reaches (README)")
    parser.add_argument("--memory_fraction", type=float, default=0.9, help="share of GPU memory a plan may use")
    parser.add_argument("--max_traced", type=int, default=100,
                        help="models without the closed form: layouts traced at most (seconds each)")

    parser.error = lambda message: (_ for _ in ()).throw(ConfigError(message))  # one line, exit 2
    args = parser.parse_args(argv)
    if args.model not in list_model_specs():
        raise ConfigError(f"--model {args.model!r} is not one of {list_model_specs()}")
    if args.flavor not in get_model_spec(args.model).flavors:
        raise ConfigError(f"--flavor {args.flavor!r} is not a flavor of {args.model}: {sorted(get_model_spec(args.model).flavors)}")
    if args.gpu not in GPUS:
        raise ConfigError(f"--gpu {args.gpu!r} is not one of {sorted(GPUS)}")
    if args.global_batch is None:
        args.global_batch = args.gpus
    for name in ("gpus", "seq_len", "top", "max_traced", "global_batch"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} {getattr(args, name)} must be >= 1")
    if not 0 < args.efficiency <= 1 or not 0 < args.memory_fraction <= 1:
        raise ConfigError("--efficiency and --memory_fraction must be within (0, 1]")
    args.tp = _tp_degrees(args.tp, args.gpus, GPUS[args.gpu])
    return args


def check_job(args: argparse.Namespace) -> None:
    """What no layout changes (the flavor's context length against seq_len, the tokenizer where
    present against its vocabulary) checked once, by the trainer's plan for one rank, before the
    search: every layout's plan would refuse it alike, and the search could say only that no
    layout fits."""
    make_plan(load_config([f"--model.name={args.model}", f"--model.flavor={args.flavor}",
                           f"--model.tokenizer_path={args.tokenizer_path}", f"--training.seq_len={args.seq_len}"]),
              1, "cuda", check_only=True)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        check_job(args)
        gpu = GPUS[args.gpu]
        found, enumerated, evaluated, stopped_at = search(args, gpu)
        if not found:
            untried = f" among the {args.max_traced} layouts --max_traced let it trace" if stopped_at is not None else ""
            raise ConfigError(f"no layout of {args.model}/{args.flavor} fits {args.gpus} x {gpu.name} "
                              f"at seq_len {args.seq_len}, global batch {args.global_batch}{untried}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.model}/{args.flavor} on {args.gpus} x {gpu.name}, seq_len {args.seq_len}, global batch "
          f"{args.global_batch} sequences: best {len(found)} distinct layouts ({enumerated} candidates, "
          f"{evaluated} evaluated; the rest bounded out, over memory on their model state alone or needing "
          f"more than one over memory):")
    if stopped_at is not None:
        print(f"(stopped after --max_traced {args.max_traced} layouts traced: those left untried take at least "
              f"{stopped_at:.2f} s a step, so the ranking is exact only below that; raise --max_traced to settle the rest)")
    for i, c in enumerate(found, 1):
        print(describe(c, gpu, i))
    return 0


if __name__ == "__main__":
    sys.exit(main())
