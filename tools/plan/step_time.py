"""The step-time model (README.md, "Step-time model"): seconds of one training step on the busiest
pipeline rank = compute (a stated share of the dtype's peak; float8 linears at the float8 peak,
plus their casts; eager plans at EAGER_EFFICIENCY of that) + the schedule's bubble + exposed
communication: CP collectives and synchronous TP ones on the critical path, async TP ones behind
the matmul each is fused with, FSDP/HSDP collectives behind the compute of the neighbouring unit
(FSDP2's prefetch) with NCCL's ring latency, pipeline transfers on the fill and drain chain.
"""

from __future__ import annotations

import dataclasses
import math

from tessera.trainer.plan import JobPlan

import formulas
from tessera.trainer.gpus import GPU
from schedules import SCHEDULES

# NCCL's ring cost model (NVIDIA/nccl src/graph/tuning.cc, Ring/Simple): a collective's latency is
# a base plus one hardware latency per ring step, NVLink or network; all-gather and reduce-scatter
# take n - 1 steps (nodes - 1 of them between nodes), all-reduce twice as many.
NCCL_BASE_S = 8.4e-6
NCCL_NVLINK_STEP_S = 3.4e-6
NCCL_NET_STEP_S = 9.6e-6
# Share of the bandwidth time of collectives running under compute that costs the compute
# nothing: fitted to torchtitan's Llama 3.1 8B runs on 8 and 128 H100s (README.md, "Overlap").
OVERLAP = 0.97
# float8 matmuls reach a smaller share of their peak than bf16 ones: the ratio fitted to
# torchtitan's Llama 3.1 8B FSDP 8 runs with and without float8 (README.md, "Efficiency").
FLOAT8_EFFICIENCY = 0.71
# HBM bytes per element of each operand (input, weight, output gradient) of a float8 linear per
# micro-batch: amax read (2), cast read + write (2 + 1), float8 transpose for backward (1 + 1).
FLOAT8_CAST_BYTES = 7
# Share of the compiled efficiency an eager model reaches: fitted to torchtitan's Llama 3.1 8B
# FSDP 8 runs with and without torch.compile (README.md, "Constants").
EAGER_EFFICIENCY = 0.86

# Sequence-parallel TP's collectives in one block, per micro-batch, as (kind, the linears async TP
# fuses it with, passes per AC mode). Fused: an all-gather with the matmuls consuming its result
# (forward: the block inputs into q/k/v and w1/w3; backward: the output gradients into wo's and
# w2's input-gradient matmuls), a reduce-scatter with the one matmul producing its input (forward:
# wo, w2). Not fused, so exposed even under async TP: the backward reduce-scatters of the block
# inputs' gradients, which sum q/k/v's (w1/w3's) input-gradient matmuls first, while torch's pass
# (torch/_inductor/fx_passes/micro_pipeline_tp.py, _find_producer_matmul) takes a reduce-scatter's
# input from a single matmul only. Passes: forward + backward, plus AC's recompute (full regathers
# both inputs and reruns both reduce-scatters, or wo's alone when it stops early; selective "op"
# regathers both inputs and keeps both reduce-scatters' results): formulas.tp_bytes' bytes.
_QKV, _W13 = ("attention.wq", "attention.wk", "attention.wv"), ("feed_forward.w1", "feed_forward.w3")
TP_FUSIONS = (
    ("all_gather", _QKV, {"none": 1, "full": 2, "full_early_stop": 2, "selective": 2}),
    ("reduce_scatter", (), {"none": 1, "full": 1, "full_early_stop": 1, "selective": 1}),  # q/k/v's input gradients, summed
    ("reduce_scatter", ("attention.wo",), {"none": 1, "full": 2, "full_early_stop": 2, "selective": 1}),
    ("all_gather", ("attention.wo",), {"none": 1, "full": 1, "full_early_stop": 1, "selective": 1}),
    ("all_gather", _W13, {"none": 1, "full": 2, "full_early_stop": 2, "selective": 2}),
    ("reduce_scatter", (), {"none": 1, "full": 1, "full_early_stop": 1, "selective": 1}),  # w1/w3's input gradients, summed
    ("reduce_scatter", ("feed_forward.w2",), {"none": 1, "full": 2, "full_early_stop": 1, "selective": 1}),
    ("all_gather", ("feed_forward.w2",), {"none": 1, "full": 1, "full_early_stop": 1, "selective": 1}),
)


def ring_seconds(nbytes: float, ranks: int, nodes: int, gpu: GPU, all_reduce: bool = False) -> tuple[float, float]:
    """(latency, bandwidth time) of one ring collective whose gathered (or reduced) buffer is
    `nbytes`, over `ranks` GPUs on `nodes` nodes: (n-1)/n of the buffer through each GPU's link,
    NVLink within a node, its NIC across nodes; all-reduce twice."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0, 0.0
    times = 2 if all_reduce else 1
    step = NCCL_NET_STEP_S if nodes > 1 else NCCL_NVLINK_STEP_S
    latency = NCCL_BASE_S + times * ((ranks - nodes) * NCCL_NVLINK_STEP_S + (nodes - 1) * step)
    bandwidth = (gpu.inter_node_gbps if nodes > 1 else gpu.intra_node_gbps) * 1e9
    return latency, times * nbytes * (ranks - 1) / ranks / bandwidth


def group_nodes(ranks: int, stride: int, gpu: GPU) -> int:
    """Nodes a group of `ranks` GPUs `stride` ranks apart spans (mesh dims are laid out row-major)."""
    return max(1, math.ceil(ranks * stride / gpu.gpus_per_node))


@dataclasses.dataclass
class Work:
    """One rank's compute in one step, seconds: forward, input-gradient backward (AC recompute
    included), weight-gradient backward, float8 casts; over `microbatches` micro-batches."""

    forward: float
    backward: float
    weights: float
    casts: float
    microbatches: int

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.weights + self.casts


def peaks(gpu: GPU, dtype: str, efficiency: float) -> dict[bool, float]:
    """FLOP/s a matmul reaches, by whether it runs in float8."""
    return {True: gpu.tflops.get("float8", 0) * 1e12 * efficiency * FLOAT8_EFFICIENCY,
            False: gpu.tflops[dtype] * 1e12 * efficiency}


def work(a, seq_len: int, tokens: float, microbatches: int, blocks: float, head: float, tp: int, cp: int,
         recompute: float, fp8: frozenset[str], dtype: str, gpu: GPU, efficiency: float, loss_chunked: bool = False) -> Work:
    """Compute of a rank holding `blocks` blocks and `head` output projections (fractions allowed:
    the planner's bound uses the average rank) for `tokens` tokens of its data-parallel rank per
    step in `microbatches` micro-batches; `recompute`: share of the blocks whose forward AC
    reruns. FLOPs as the model spec counts them (6 per weight per token: 2 forward, 2 input
    gradient, 2 weight gradient), except attention, whose causal mask halves the spec's
    12·heads·head_dim·seq (a third of it forward, two thirds input gradient). `loss_chunked`: the
    chunked loss reruns the output projection's forward in backward."""
    peak = peaks(gpu, dtype, efficiency)
    rank_tokens = tokens / cp / tp
    blocks_linear = sum(6 * o * i * rank_tokens * blocks / peak[n in fp8] for n, (o, i, _) in formulas.block_linears(a).items())
    linear = blocks_linear + 6 * a.vocab_size * a.dim * rank_tokens * head / peak["output" in fp8]
    attention = 6 * a.n_heads * a.head_dim * seq_len * rank_tokens * blocks / peak[False]
    rows = tokens / cp / microbatches  # a linear's rows per micro-batch (sequence-parallel inputs gathered)
    # a rank casts its own part of each operand: the input shard (a colwise linear's input is cast
    # before its float8 all-gather, a rowwise one's holds 1/tp of the features), its weight shard,
    # and its part of the output gradient (a rowwise linear's is gathered whole)
    operands = sum(blocks * (rows * i / tp + o * i / tp + rows * (o / tp if s == 0 else o))
                   for n, (o, i, s) in formulas.block_linears(a).items() if n in fp8)
    if "output" in fp8:
        operands += head * (rows * a.dim + a.dim * a.vocab_size / tp + rows * a.vocab_size / tp)
    casts = FLOAT8_CAST_BYTES * operands * microbatches / (gpu.hbm_tbps * 1e12)
    recomputed = recompute * (blocks_linear + attention) / 3  # the blocks' forward, again
    recomputed += loss_chunked * 2 * a.vocab_size * a.dim * rank_tokens * head / peak[False]  # the head's, in high precision
    return Work(forward=(linear + attention) / 3, backward=linear / 3 + 2 * attention / 3 + recomputed,
                weights=linear / 3, casts=casts, microbatches=microbatches)


def recompute_share(mode: str, blocks: float, selective_option: str = "op", memory_budget: float | None = None) -> float:
    """Share of a rank's blocks' forward AC (mode, selective_option, memory_budget: a
    CheckpointingPlan's) reruns: all (full), none (none, offload; selective "op", whose rerun of
    every second matmul the fitted efficiency holds: README "A bias in the fit"), every N-th block
    (selective N), and for compile's memory budget b, 1 - b: read like its memory, between none's
    and full's (tools/bench ac_bench, compiled, CPU: 0.43 of full's recompute at 0.5, 1.0 at 0)."""
    if mode == "full":
        return 1.0
    if mode == "memory_budget":
        return 1 - memory_budget
    if mode == "selective" and selective_option != "op":  # the N-th, 2N-th, ... block (as formulas)
        return (blocks // int(selective_option)) / max(blocks, 1)
    return 0.0


def run_efficiency(efficiency: float, is_compiled: bool) -> float:
    """`efficiency` (fitted on a compiled run) for a compiled model, EAGER_EFFICIENCY of it eager."""
    return efficiency * (1 if is_compiled else EAGER_EFFICIENCY)


def rank_work(plan: JobPlan, pp_rank: int, gpu: GPU, efficiency: float) -> Work:
    modules = formulas.stage_modules(plan, pp_rank)
    blocks = sum(m.startswith("layers.") for m in modules)
    batch, micro = plan.batch, plan.pipeline.microbatches if plan.pipeline else 1
    return work(plan.model_args, batch.seq_len, batch.local * batch.seq_len * batch.accumulation, micro * batch.accumulation,
                blocks, "output" in modules, plan.dims.tp, plan.dims.cp,
                recompute_share(plan.checkpointing.mode, blocks, plan.checkpointing.selective_option,
                                plan.checkpointing.memory_budget),
                formulas.float8_linears(formulas.float8_of(plan), plan.model_args),
                str(plan.precision.param).removeprefix("torch."), gpu, run_efficiency(efficiency, plan.compile.blocks),
                bool(plan.loss.chunk_size))


def bubble(schedule: str | None, pp: int, v: int, w: Work) -> float:
    """The schedule's idle seconds per step, from one micro-batch's forward, input-gradient
    (with the casts) and weight-gradient times on the rank."""
    if schedule is None:
        return 0.0
    m = w.microbatches
    return SCHEDULES[schedule].idle(pp, v, w.forward / m, (w.backward + w.casts) / m, w.weights / m)


def linear_seconds(a, names: tuple[str, ...], rows: float, tp: int, fp8: frozenset[str], peak: dict[bool, float]) -> float:
    """Forward seconds of the named linears (a block's, or "output") over `rows` rows split `tp`
    ways; an input-gradient matmul takes as long."""
    shapes = formulas.block_linears(a) | {"output": (a.vocab_size, a.dim, 0)}
    return sum(2 * rows * shapes[n][0] * shapes[n][1] / tp / peak[n in fp8] for n in names)


def tp_seconds(a, rows: float, itemsize: int, blocks: float, embedding: float, head: float, ac_mode: str, tp: int,
               fp8: frozenset[str], float8_gather: bool, async_tp: bool, peak: dict[bool, float], gpu: GPU,
               early_stop: bool = True) -> float:
    """One micro-batch's sequence-parallel TP collectives on a rank holding `blocks` blocks and
    `embedding`, `head` of those modules (fractions: the planner's bound), each moving the
    micro-batch's hidden states (`rows` x dim). Under float8 TP styles a block's gathers move
    float8: its inputs (torchao's PrepareFloat8ModuleInput casts before the gather) and wo's, w2's
    output gradients (Float8RowwiseParallel casts them before the backward's gather); the
    embedding's and the head's stay in the compute dtype.
    Synchronous: exposed. Async TP (torch's fused all-gather-matmul / matmul-reduce-scatter, an
    inductor pass) splits each into tp chunks run beside that many chunks of the matmul it feeds
    (or that feeds it): the step takes max(matmul, collective + one chunk of the matmul), so what
    exceeds (tp-1)/tp of the matmul is exposed, and 1 - OVERLAP of the bandwidth time under it
    still slows the matmul. Those TP_FUSIONS leaves unfused, and the embedding's pair, stay exposed.
    `early_stop`: full AC's recomputation stops before w2's reduce-scatter."""
    if tp <= 1:
        return 0.0
    nodes, one = group_nodes(tp, 1, gpu), rows * a.dim * itemsize
    # offload reruns nothing; compile's partitioner never reruns a collective (force_save_collectives)
    recomputes = ac_mode if ac_mode in ("full", "selective") else "none"
    if recomputes == "full" and early_stop:
        recomputes = "full_early_stop"
    events = [(kind, names, blocks * passes[recomputes], float8_gather and kind == "all_gather")
              for kind, names, passes in TP_FUSIONS]
    events += [(kind, names, count, False) for kind in ("all_gather", "reduce_scatter")
               for names, count in (((), embedding), (("output",), head))]
    total = 0.0
    for kind, names, count, in_float8 in events:
        latency, bandwidth = ring_seconds(one / 2 if in_float8 else one, tp, nodes, gpu)
        hide = linear_seconds(a, names, rows, tp, fp8, peak) * (tp - 1) / tp if async_tp else 0.0
        total += count * (max(0.0, latency + bandwidth - hide) + (1 - OVERLAP) * min(bandwidth, hide))
    return total


def step_time(plan: JobPlan, gpu: GPU, efficiency: float, estimates: list | None = None) -> dict[str, float]:
    """Seconds of one step, by part, on the pp rank whose total is largest (`estimates`: each pp
    rank's formulas.estimate_rank, if already made)."""
    estimates = estimates or [formulas.estimate_rank(plan, r) for r in range(plan.dims.pp)]
    return max((_rank_step(plan, r, est, gpu, efficiency) for r, est in enumerate(estimates)), key=lambda p: p["total"])


def _rank_step(plan: JobPlan, pp_rank: int, est, gpu: GPU, efficiency: float) -> dict[str, float]:
    dims, batch = plan.dims, plan.batch
    w = rank_work(plan, pp_rank, gpu, efficiency)
    options = formulas.float8_of(plan)
    fp8 = formulas.float8_linears(options, plan.model_args)
    a, e, micro = plan.model_args, plan.precision.param.itemsize, plan.pipeline.microbatches if plan.pipeline else 1
    rows = batch.local * batch.seq_len // micro // dims.cp  # a micro-batch's tokens on the rank (gathered)
    one = rows * a.dim * e  # their hidden states
    kv = batch.local * batch.seq_len // micro * a.n_heads * a.head_dim // dims.tp * e  # its gathered K (or V)
    modules = formulas.stage_modules(plan, pp_rank)
    out = {"compute": w.total,
           "bubble": bubble(plan.pipeline and plan.pipeline.schedule, dims.pp, len(formulas.local_stages(plan, pp_rank)), w)}
    peak = peaks(gpu, str(plan.precision.param).removeprefix("torch."), run_efficiency(efficiency, plan.compile.blocks))
    out["tp"] = w.microbatches * tp_seconds(
        a, rows, e, sum(m.startswith("layers.") for m in modules), "tok_embeddings" in modules, "output" in modules,
        plan.checkpointing.mode, dims.tp, fp8, bool(fp8) and options.recipe_name == "tensorwise",
        plan.tensor_parallel.async_tp, peak, gpu, plan.checkpointing.early_stop)
    # CP's K and V gathers (dK, dV reduce-scatters), each a whole sequence's: synchronous with attention, exposed
    lat, bw = ring_seconds(kv, dims.cp, group_nodes(dims.cp, dims.tp, gpu), gpu)
    out["cp"] = sum(est.comm.get((kind, "cp"), 0) for kind in ("all_gather", "reduce_scatter")) / kv * (lat + bw)
    out["fsdp"] = _fsdp_exposed(plan, pp_rank, est, w, formulas.fsdp_float8(options, fp8), gpu)
    out["pp"] = _pipeline_exposed(plan, one / dims.tp, gpu)
    out["offload"] = offload_seconds(plan, sum(m.startswith("layers.") for m in modules), w, gpu)
    out["total"] = sum(out.values())
    return out


def offload_seconds(plan: JobPlan, blocks: int, w: Work, gpu: GPU) -> float:
    """Activation offload's exposed host transfers (mode offload; tessera.models.offload): each
    block's saved tensors (its AC-none activations) go out on a side stream behind the next
    block's forward, each block's own exposed beyond that compute; they come back on the compute
    stream when backward unpacks them, exposed whole (no prefetch)."""
    if plan.checkpointing.mode != "offload":
        return 0.0
    micro = plan.pipeline.microbatches if plan.pipeline else 1
    one = formulas.block_activations(plan, "none") / (gpu.host_gbps * 1e9)  # a block's per micro-batch, one way
    units = blocks * micro * plan.batch.accumulation
    return exposed_behind_units(one * units, one * units, w.forward, units) + one * units


def _fsdp_exposed(plan: JobPlan, pp_rank: int, est, w: Work, fp8_gathered: frozenset[str], gpu: GPU) -> float:
    """FSDP2 gathers unit i+1 while unit i computes forward, and in backward gathers the next
    unit and reduce-scatters (HSDP: then all-reduces across replicas) the last one behind the
    current unit's backward: each unit exposes max(0, its collectives - that compute); the first
    gather and the last reduction have nothing to hide behind; of the bandwidth time that hides,
    1 - OVERLAP still slows compute. Per accumulation round, reducing after the last one or after
    each (formulas.reductions); a pipeline gathers its stages once and reduces once per step,
    behind one micro-batch's compute."""
    dims = plan.dims
    shard = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    if shard <= 1 and dims.dp_replicate <= 1:
        return 0.0
    units = sum(m.startswith("layers.") for m in formulas.stage_modules(plan, pp_rank)) + 1  # blocks + the root's
    rounds = 1 if plan.pipeline else plan.batch.accumulation
    compute_f = w.forward / w.microbatches / units
    compute_b = (w.backward + w.weights + w.casts) / w.microbatches / units
    gathered = est.params // formulas.F32 * shard * plan.precision.param.itemsize  # a forward's gathers
    back_gathered = est.comm.get(("all_gather", "fsdp"), 0) / rounds - gathered  # resharded ones, again in backward
    if fp8_gathered:
        scale = 1 - _linear_share(plan.model_args, fp8_gathered) / 2
        gathered, back_gathered = gathered * scale, back_gathered * scale
    nodes = group_nodes(shard, dims.tp, gpu)
    ag = ring_seconds(gathered / units, shard, nodes, gpu)
    ag_back = ring_seconds(back_gathered / units, shard, nodes, gpu)
    reductions = formulas.reductions(plan)  # per step: after the last round, or after each
    rs = ring_seconds(est.comm.get(("reduce_scatter", "fsdp"), 0) / reductions / units, shard, nodes, gpu)
    ar = ring_seconds(est.comm.get(("all_reduce", "dp_replicate"), 0) / reductions / units, dims.dp_replicate,
                      group_nodes(dims.dp_replicate, shard * dims.tp, gpu), gpu, all_reduce=True)
    exposed = hidden = 0.0
    for last in [False] * (rounds - 1) + [True]:
        reduce = (rs, ar) if last or reductions > 1 else ()
        forward_t, backward_t = sum(ag), sum(ag_back) + sum(sum(c) for c in reduce)
        exposed += forward_t + (units - 1) * max(0.0, forward_t - compute_f)
        exposed += sum(sum(c) for c in reduce) + (units - 1) * max(0.0, backward_t - compute_b)
        hidden += (units - 1) * (min(ag[1], compute_f) + min(ag_back[1] + sum(c[1] for c in reduce), compute_b))
    return exposed + (1 - OVERLAP) * hidden


def _linear_share(a, names: frozenset[str]) -> float:
    """Share of a block's weights in the named linears."""
    linears = formulas.block_linears(a)
    return sum(o * i for n, (o, i, _) in linears.items() if n in names) / sum(o * i for o, i, _ in linears.values())


def _pipeline_exposed(plan: JobPlan, transfer: float, gpu: GPU) -> float:
    """Stage-to-stage transfers (`transfer` bytes each) hide behind compute in the steady state;
    the first micro-batch's activations on their way through every stage boundary, and the last
    one's gradients on the way back, do not: 2 x (stages - 1) transfers, across nodes when a pp
    rank's peers are a node or more apart (pp is the outermost mesh dim)."""
    if plan.pipeline is None:
        return 0.0
    across = plan.world_size // plan.dims.pp >= gpu.gpus_per_node
    bandwidth = (gpu.inter_node_gbps if across else gpu.intra_node_gbps) * 1e9
    latency = NCCL_BASE_S + (NCCL_NET_STEP_S if across else NCCL_NVLINK_STEP_S)
    return 2 * (len(plan.pipeline.parts) - 1) * (latency + transfer / bandwidth)


# Models without the closed form (Qwen3, DeepSeek-V3, MoE): the step from the traced estimate
# (tools/estimate traced.trace_by_blocks: its collectives' bytes and calls per mesh dimension, and
# the ranks of each group) and the model spec's FLOPs. Coarser than the Llama model above: no
# float8, no async TP, no pipeline; FSDP's units are the blocks plus the root, each hiding its
# collectives behind its own compute, forward and backward together.
FSDP_DIMS = ("fsdp", "expert_fsdp", "dp_replicate", "dp_shard")


def job_dim(dim: str) -> str:
    """A traced collective's mesh dimension as the job knows it: the ep group is often another
    dimension's too ("fsdp=ep"), and its all-to-alls are told apart by their kind."""
    return dim.removesuffix("=ep")


def exposed_behind_units(seconds: float, bandwidth: float, compute: float, units: int) -> float:
    """Collectives spread over `units` (each block and the root, per micro-batch), each unit's
    behind its own compute: the first unit's exposed, each other one's beyond its compute, and
    1 - OVERLAP of the bandwidth time hidden slowing that compute."""
    per_unit, compute = seconds / units, compute / units
    return per_unit + (units - 1) * (max(0.0, per_unit - compute) + (1 - OVERLAP) * min(bandwidth / units, compute))


def spec_work(spec, a, seq_len: int, tokens: float, microbatches: int, tp: int, cp: int, recompute: float, dtype: str,
              gpu: GPU, efficiency: float, loss_chunked: bool = False) -> Work:
    """Compute of a rank for `tokens` tokens of its data-parallel rank per step, from the spec's
    FLOPs per token: 6 per active weight (a token's routed experts only) plus attention's
    12·layers·heads·head_dim·seq, halved for the causal mask as `work` does; split forward /
    input gradient / weight gradient as `work` does; AC reruns the blocks' forward
    (`recompute`: recompute_share) — all but the output projection's, which the chunked loss
    (`loss_chunked`) reruns."""
    peak = gpu.tflops[dtype] * 1e12 * efficiency
    rank_tokens = tokens / cp / tp
    linear = spec.flops_per_token(a, 0) * rank_tokens
    attention = (spec.flops_per_token(a, seq_len) - spec.flops_per_token(a, 0)) / 2 * rank_tokens
    blocks = linear - 6 * a.vocab_size * a.dim * rank_tokens
    recomputed = recompute * (blocks + attention) / 3 + loss_chunked * 2 * a.vocab_size * a.dim * rank_tokens
    return Work(forward=(linear + attention) / 3 / peak, backward=(linear / 3 + 2 * attention / 3 + recomputed) / peak,
                weights=linear / 3 / peak, casts=0.0, microbatches=microbatches)


def plan_spec_work(plan: JobPlan, gpu: GPU, efficiency: float) -> Work:
    b, dims, a, ac = plan.batch, plan.dims, plan.model_args, plan.checkpointing
    return spec_work(plan.spec, a, b.seq_len, b.local * b.seq_len * b.accumulation, b.accumulation, dims.tp, dims.cp,
                     recompute_share(ac.mode, a.n_layers, ac.selective_option, ac.memory_budget),
                     str(plan.precision.param).removeprefix("torch."),
                     gpu, run_efficiency(efficiency, plan.compile.blocks), bool(plan.loss.chunk_size))


def traced_step_time(plan: JobPlan, est, gpu: GPU, efficiency: float) -> dict[str, float]:
    """Seconds of one step by part, from a traced estimate `est` (traced.RankMemory: comm, calls,
    groups): each collective a ring over its group's ranks and nodes (an all-to-all too: (n-1)/n
    of its buffer through each GPU's link); expert parallel's all-to-alls, TP's and CP's
    collectives exposed (synchronous); FSDP/HSDP's behind the compute of their unit (blocks + the
    root, per micro-batch), the first unit's exposed, 1 - OVERLAP of the hidden bandwidth time
    slowing compute."""
    w = plan_spec_work(plan, gpu, efficiency)
    out = dict.fromkeys(("bubble", "tp", "cp", "ep", "fsdp", "pp", "other"), 0.0) | {"compute": w.total}
    fsdp_total = fsdp_bandwidth = 0.0
    for key, nbytes in est.comm.items():
        kind, dim = key
        calls, ranks = est.calls[key], est.groups[dim]  # a collective on a group the trace did not name: a bug
        nodes = len({r // gpu.gpus_per_node for r in ranks})
        latency, bandwidth = ring_seconds(nbytes / calls, len(ranks), nodes, gpu, all_reduce=kind == "all_reduce")
        seconds = calls * (latency + bandwidth)
        dim = job_dim(dim)
        if kind == "all_to_all":
            out["ep"] += seconds
        elif dim in FSDP_DIMS:
            fsdp_total, fsdp_bandwidth = fsdp_total + seconds, fsdp_bandwidth + calls * bandwidth
        else:
            out[dim if dim in ("tp", "cp") else "other"] += seconds
    out["fsdp"] = exposed_behind_units(fsdp_total, fsdp_bandwidth, w.total, (plan.model_args.n_layers + 1) * w.microbatches)
    out["total"] = sum(out.values())
    return out
