"""Closed-form estimates for Llama-shaped models (every flavor of tessera.models' llama2/llama3):
per-rank model state exact (the shard arithmetic of tessera.tp and FSDP2), activations and peak
from what autograd keeps per block (derived in README.md, checked against the traced estimate),
FLOPs from the model spec, and collective bytes per step. Instant, so the planner can call it for
every layout; the traced estimate is the reference."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import torch

from tessera import pp
from tessera.trainer.plan import JobPlan

if TYPE_CHECKING:  # imported where float8 is asked about: torchao may be absent (a bare GPU machine)
    from tessera.float8 import Float8Options

F32 = 4
LLAMA_SHAPED = ("llama2", "llama3")  # the model specs the closed form covers


def covers(plan: JobPlan) -> bool:
    """Whether the closed form knows the plan's model (its shapes are Llama's); others are traced only."""
    return plan.spec.name in LLAMA_SHAPED


def block_linears(a) -> dict[str, tuple[int, int, int]]:
    """A block's linears by name within the block: (out features, in features, the dim tensor
    parallel splits: 0 colwise, 1 rowwise)."""
    h, q, kv, f = a.dim, a.n_heads * a.head_dim, a.kv_heads * a.head_dim, a.ffn_hidden_dim
    return {"attention.wq": (q, h, 0), "attention.wk": (kv, h, 0), "attention.wv": (kv, h, 0), "attention.wo": (h, q, 1),
            "feed_forward.w1": (f, h, 0), "feed_forward.w3": (f, h, 0), "feed_forward.w2": (h, f, 1)}


def op_kept_linears(a) -> list[str]:
    """The block linears whose outputs selective AC "op" keeps (tessera.models.blocks, torchtitan's
    policy): the 1st, 3rd, ... matmul of a block (a float8 linear's too: its matmul reaches the
    policy as aten.mm of float8 tensor subclasses)."""
    return list(block_linears(a))[::2]


def _block_params(a) -> list[tuple[int, int, int | None]]:
    """(rows, cols, dim tensor parallel splits) of one block's parameters (None: replicated)."""
    return [*block_linears(a).values(), (a.dim, 1, None), (a.dim, 1, None)]


def float8_of(plan: JobPlan) -> Float8Options | None:
    """The float8 linear converter's options as the job plan resolved them for its layout, or None."""
    if not plan.converters:
        return None
    from tessera.float8 import Float8Options

    return next((c.options for c in plan.converters if isinstance(c.options, Float8Options)), None)


@functools.cache  # the planner asks for every layout it evaluates; an answer builds 8 meta linears
def float8_linears(options: Float8Options | None, a) -> frozenset[str]:
    """Names within a block (and "output") of the linears the converter swaps: tessera.float8's
    own rule, on the full (pre-TP) shapes."""
    if options is None:
        return frozenset()
    from tessera.float8.convert import selected

    shapes = {f"layers.0.{k}": (i, o) for k, (o, i, _) in block_linears(a).items()} | {"output": (a.dim, a.vocab_size)}
    return frozenset(name.removeprefix("layers.0.") for name, (i, o) in shapes.items()
                     if selected(name, torch.nn.Linear(i, o, bias=False, device="meta"), options))


def fsdp_float8(options: Float8Options | None, fp8: frozenset[str]) -> frozenset[str]:
    """Of the float8 linears `fp8`, those FSDP gathers in float8 (float8.enable_fsdp_float8_all_gather)."""
    return fp8 if options and options.enable_fsdp_float8_all_gather else frozenset()


def _module_params(a, name: str) -> list[tuple[int, int, int | None]]:
    if name.startswith("layers."):
        return _block_params(a)
    return {"tok_embeddings": [(a.vocab_size, a.dim, 0)], "norm": [(a.dim, 1, None)],
            "output": [] if a.tie_embeddings else [(a.vocab_size, a.dim, 0)]}[name]


def _param_names(a, module: str) -> list[str]:
    """The parameter names of `module`, in _module_params' order."""
    if module.startswith("layers."):
        return [f"{module}.{k}.weight" for k in block_linears(a)] + [f"{module}.attention_norm.weight",
                                                                      f"{module}.ffn_norm.weight"]
    return [f"{module}.weight" for _ in _module_params(a, module)]


def _optimizer_bytes(plan: JobPlan, modules: list[str], fsdp: int) -> tuple[int, int]:
    """This rank's optimizer state: AdamW's two moments (fp32, or optimizer.state_dtype) and a float32 step per parameter,
    Muon's one fp32 momentum buffer per matrix it steps; and the step's largest Muon temporaries
    (its owner holds one whole matrix in the Newton-Schulz dtype, with the iteration's X, X X^T,
    its polynomial and the next X)."""
    a, opt = plan.model_args, plan.optimizer
    muon = {n for g in opt.groups if g.algorithm == "muon" for n in g.names}
    state, largest = 0, 0
    moment = opt.state_dtype.itemsize if opt.state_dtype else F32
    for module in modules:
        for name, (rows, cols, split) in zip(_param_names(a, module), _module_params(a, module)):
            elements = _local_elements(rows, cols, split, plan.dims.tp, fsdp)
            state += F32 * elements if name in muon else 2 * moment * elements + F32
            if name in muon:
                short = min(rows, cols)
                largest = max(largest, opt.muon.ns_dtype.itemsize * (3 * rows * cols + 2 * short * short))
    return state, largest


def _local_elements(rows: int, cols: int, split: int | None, tp: int, fsdp: int) -> int:
    """Elements one rank stores: TP splits `split`, then FSDP2 chunks dim 0 of that into equal,
    padded shards (every rank allocates the padded size)."""
    if split == 0:
        rows = math.ceil(rows / tp)
    elif split == 1:
        cols = math.ceil(cols / tp)
    return math.ceil(rows / fsdp) * cols


def stage_modules(plan: JobPlan, pp_rank: int) -> list[str]:
    """The module names the pp rank holds (the whole model without pipeline parallelism)."""
    a = plan.model_args
    if plan.pipeline is None:
        return ["tok_embeddings", *(f"layers.{i}" for i in range(a.n_layers)), "norm", "output"]
    parts = plan.pipeline.parts
    return [m for s in pp.stage_ids(pp_rank, plan.dims.pp, len(parts), plan.pipeline.schedule) for m in parts[s]]


@dataclasses.dataclass
class FormulaEstimate:
    params: int
    grads: int
    optimizer: int
    buffers: int
    activations: int  # at the end of forward, all micro-batches in flight
    peak: int
    comm: dict[tuple[str, str], int]
    host: int = 0  # host memory the blocks' activations are offloaded to (activation_checkpoint.mode offload)


def estimate_rank(plan: JobPlan, pp_rank: int = 0) -> FormulaEstimate:
    a, dims = plan.model_args, plan.dims
    fsdp = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    modules = stage_modules(plan, pp_rank)
    shapes = [p for m in modules for p in _module_params(a, m)]
    elements = sum(_local_elements(r, c, s, dims.tp, fsdp) for r, c, s in shapes)
    params = F32 * elements
    optimizer, muon_temporaries = _optimizer_bytes(plan, modules, fsdp)
    buffers = 8 * plan.batch.seq_len * a.head_dim // 2 * (len(local_stages(plan, pp_rank)))  # complex64 RoPE table per part
    blocks = sum(m.startswith("layers.") for m in modules)
    tp_local_block = sum(_local_elements(r, c, s, dims.tp, 1) for r, c, s in _block_params(a))
    options = float8_of(plan)
    fp8 = float8_linears(options, a)
    # FSDP keeps the last block, the output and the final norm gathered from forward into backward
    # ("default"; "never": every group, "always": none), float8 ones in float8 under its float8 all-gather
    kept = _kept_gathered(plan, modules, fsdp_float8(options, fp8)) if fsdp > 1 else 0
    act = activations(plan, pp_rank) + kept
    grads = params
    if dims.tp > 1 and fsdp == 1 and "tok_embeddings" in modules:
        grads += F32 * _whole_embedding(plan)
    held = _held_grads(plan, shapes, grads, fsdp, "tok_embeddings" in modules)
    # backward: gradients take the place of the activations they free. Its tallest moments: the
    # loss's (the logits' gradient beside every activation), and a block's near the top (the head's
    # activations freed, the block's forward rebuilt, and where FSDP regathers: a per-block
    # 3·e·P_b, fitted to whole traces of 405B (tools/estimate README: -8 % to +1 %) and read as
    # this block's gathered weights, the next one's prefetched and this block's unsharded
    # gradients, in the param dtype whatever the all-gather's; the kept last block is freed by
    # then, and the last reduce-scatter's fp32 input overlaps them in an order this does not follow);
    # or the optimizer step (gradients, + foreach AdamW's parameter-sized temporaries, fused: in
    # place; + Muon's whole matrix on its owner)
    last_block = _recompute_bytes(plan) + (3 * plan.precision.param.itemsize * tp_local_block if _regathers(plan, fsdp) else 0)
    if "output" in modules and plan.loss.chunk_size:
        # the chunked loss's gradient of the gathered hidden states, still in its reduce-scatter
        # (an async collective waited on in the norm's backward) while the last block rebuilds
        last_block += 2 * _gathered_hidden(plan)
    elif "output" in modules:
        last_block -= _head_activations(plan)
    temporaries = (params if plan.optimizer.implementation == "foreach" else 0) + muon_temporaries
    peak = params + optimizer + buffers + max(act + held + max(_logits_grad(plan, modules, fp8), last_block), grads + temporaries)
    return FormulaEstimate(params, grads, optimizer, buffers, act, peak,
                           comm_bytes(plan, elements, _kept_gathered(plan, modules, frozenset()) if fsdp > 1 else 0, blocks, modules, pp_rank),
                           _offloaded(plan, pp_rank))


def _offloaded(plan: JobPlan, pp_rank: int) -> int:
    """What mode offload moves to host memory: what mode none would keep beyond what it keeps."""
    if plan.checkpointing.mode != "offload":
        return 0
    kept_all = dataclasses.replace(plan, checkpointing=dataclasses.replace(plan.checkpointing, mode="none"))
    return activations(kept_all, pp_rank) - activations(plan, pp_rank)


def rank_flops(plan: JobPlan, pp_rank: int) -> float:
    """Model FLOPs (the spec's formula, recompute excluded) of one step on a rank of pp rank
    `pp_rank`: its blocks' share of its data-parallel rank's tokens, over TP and CP."""
    blocks = sum(m.startswith("layers.") for m in stage_modules(plan, pp_rank))
    tokens = plan.batch.local * plan.batch.seq_len * plan.batch.accumulation
    return plan.flops_per_token * tokens * blocks / plan.model_args.n_layers / plan.dims.tp / plan.dims.cp


def _held_grads(plan: JobPlan, shapes: list[tuple[int, int, int | None]], grads: int, fsdp: int, embedding: bool) -> int:
    """Bytes of the gradients a backward finds already there: with accumulation or a pipeline
    (more than one backward per step), those of the micro-batches before. Without FSDP, or where
    each micro-batch reduces (`reductions`), they are the parameters' own (`grads`). Otherwise
    FSDP2 reduces once, after the last backward (tessera.trainer.step.gradient_sync; torch's
    pipeline stages likewise), holding each gradient whole (TP-local) in the reduce dtype until
    then — the vocab-parallel embedding's whole vocabulary's (_whole_embedding; 3.4 GiB more for
    70B at TP 8)."""
    if plan.pipeline is None and plan.batch.accumulation == 1:
        return 0
    if fsdp == 1 or reductions(plan) > 1:
        return grads
    whole = _whole_embedding(plan) if embedding else 0
    return plan.precision.reduce.itemsize * (sum(_local_elements(r, c, s, plan.dims.tp, 1) for r, c, s in shapes) + whole)


def _whole_embedding(plan: JobPlan) -> int:
    """Elements the vocab-parallel embedding's gradient holds beyond its TP-local shard: torch's
    backward of the vocab-sharded lookup returns the whole vocabulary's gradient (traced; the real
    CPU runs agree at TP 2)."""
    a, tp = plan.model_args, plan.dims.tp
    return a.vocab_size * a.dim - _local_elements(a.vocab_size, a.dim, 0, tp, 1) if tp > 1 else 0


def state_floor(a, tp: int, fsdp: int, pp: int, held: bool) -> float:
    """A floor under every pp rank's peak from the model state alone (the busiest rank holds at
    least the mean share): fp32 parameters and AdamW's two moments, sharded, and the whole TP-local
    fp32 gradients when held (`held`: more than one backward a step). Lets the planner drop a
    layout before building its job plan."""
    ends = [p for m in ("tok_embeddings", "norm", "output") for p in _module_params(a, m)]
    local = (sum(_local_elements(r, c, s, tp, 1) for r, c, s in ends) +
             a.n_layers * sum(_local_elements(r, c, s, tp, 1) for r, c, s in _block_params(a))) / pp
    return 3 * F32 * local / fsdp + (F32 * local if held else 0)


def _regathers(plan: JobPlan, fsdp: int) -> bool:
    """Whether FSDP gathers each block again for its backward (it resharded after forward)."""
    return fsdp > 1 and plan.fsdp.reshard_after_forward != "never"


def _kept_gathered(plan: JobPlan, modules: list[str], fp8: frozenset[str]) -> int:
    """Bytes of gathered weights FSDP keeps from forward into backward: the param dtype's, one
    byte for the `fp8` linears (those FSDP gathers in float8; the collective bytes pass none)."""
    a, dims, e = plan.model_args, plan.dims, plan.precision.param.itemsize
    policy = plan.fsdp.reshard_after_forward
    blocks = [m for m in modules if m.startswith("layers.")]
    block = sum(_local_elements(o, i, split, dims.tp, 1) * (1 if name in fp8 else e) for name, (o, i, split) in block_linears(a).items())
    block += 2 * a.dim * e  # the two norms
    head = 0 if a.tie_embeddings else a.vocab_size * a.dim // dims.tp * (1 if "output" in fp8 else e)
    every = {"tok_embeddings": a.vocab_size * a.dim // dims.tp * e, "norm": a.dim * e, "output": head}
    if policy == "always":
        return 0
    if policy == "never":
        return block * len(blocks) + sum(every.get(m, 0) for m in modules)
    return block * bool(blocks) + sum(every[m] for m in ("norm", "output") if m in modules)


def local_stages(plan: JobPlan, pp_rank: int) -> list[int]:
    """The stages the pp rank runs ([0] without pipeline parallelism)."""
    if plan.pipeline is None:
        return [0]
    return pp.stage_ids(pp_rank, plan.dims.pp, len(plan.pipeline.parts), plan.pipeline.schedule)


def _compute_bytes(plan: JobPlan) -> int:
    """Activations' element size: the low-precision dtype under FSDP mixed precision or autocast."""
    return plan.precision.param.itemsize


def _microbatch_tokens(plan: JobPlan) -> int:
    """Tokens of one micro-batch on a rank: its local batch over the pipeline micro-batches,
    its share of each sequence under context parallel."""
    b = plan.pipeline.microbatches if plan.pipeline else 1
    return plan.batch.local * plan.batch.seq_len // b // plan.dims.cp


def norm_kept(plan: JobPlan) -> int:
    """Bytes per element an RMSNorm keeps for backward besides its output and rstd (README: measured
    on one norm), by the code path of the plan's device: CUDA's fused kernel keeps its input; on CPU
    tessera's RMSNorm keeps the normalized input in fp32, but a DTensor's (tensor parallel) takes
    torch's composite, which keeps its input, the fp32 upcast of a low-precision input and the
    normalized input before the weight."""
    e = _compute_bytes(plan)
    if plan.device == "cuda":
        return e
    if plan.dims.tp == 1:
        return F32
    return 2 * e + (F32 if e != F32 else 0)


def block_activations(plan: JobPlan, mode: str) -> float:
    """Bytes one block keeps per micro-batch for backward under AC `mode` (README: the derivation)."""
    a, t, cp = plan.model_args, plan.dims.tp, plan.dims.cp
    tokens = _microbatch_tokens(plan)
    h, q, e = a.dim, a.n_heads * a.head_dim, _compute_bytes(plan)
    small = tokens * F32 * 2 / t + tokens * a.n_heads // t * F32  # RMSNorm rstd x2, attention logsumexp
    norms = tokens * 2 * norm_kept(plan) * h / t
    gathered_inputs = 2 * h * (t - 1) / t  # under sequence parallel the linears keep the gathered norm outputs
    if mode == "offload":  # everything saved goes to host; backward brings back one block at a time
        return 0.0
    if mode == "memory_budget":  # compile's partitioner, read as between recomputing all (full) and nothing
        budget = plan.checkpointing.memory_budget
        return budget * block_activations(plan, "none") + (1 - budget) * block_activations(plan, "full")
    if mode == "full":
        return tokens * e * h / t
    if mode == "selective":  # option "op": blocks' input, attention's output, every second matmul's output
        linears = block_linears(a)  # a rowwise one's (wo, w2) before its reduce-scatter: whole rows
        kept = sum(linears[n][0] / (t if linears[n][2] == 0 else 1) for n in op_kept_linears(a))
        scattered = 2 * h / t if t > 1 else 0  # the sequence-parallel reduce-scatters' results (wo's, w2's)
        return tokens * e * (h / t + q / t + kept + scattered) + tokens * a.n_heads // t * F32
    # context parallel: attention keeps the K and V (heads repeated) it gathered from the other cp ranks
    gathered_kv = 2 * q / t * (cp - 1)
    return linear_activations(a, tokens, t, e) + tokens * e * (gathered_inputs + gathered_kv) + norms + small


def linear_activations(a, tokens: float, tp: int, itemsize: int) -> float:
    """The bulk of what a block keeps without AC, for `tokens` tokens of model args `a`: the
    linears' and attention's inputs and outputs, (dim + 5 q + 4 ffn) / tp elements a token."""
    return tokens * itemsize * (a.dim + 5 * a.n_heads * a.head_dim + 4 * a.ffn_hidden_dim) / tp


def _recompute_bytes(plan: JobPlan) -> float:
    """Backward of a checkpointed block rebuilds its activations (an offloaded one copies them
    back): one block's worth on top."""
    mode = plan.checkpointing.mode
    if mode == "none":
        return 0
    return block_activations(plan, "none") - block_activations(plan, mode)


def _every_nth(plan: JobPlan) -> int | None:
    ac = plan.checkpointing
    return int(ac.selective_option) if ac.mode == "selective" and ac.selective_option != "op" else None


def _blocks_by_mode(plan: JobPlan, blocks: int) -> tuple[tuple[str, int], ...]:
    """(AC mode, blocks) for `blocks` blocks: selective AC every N-th block checkpoints the N-th,
    2N-th, ... whole (full AC) and keeps the rest (tessera.models.apply_activation_checkpointing)."""
    every = _every_nth(plan)
    if every:
        return ("full", blocks // every), ("none", blocks - blocks // every)
    return ((plan.checkpointing.mode, blocks),)


def _head_activations(plan: JobPlan) -> float:
    """Bytes the head keeps per micro-batch to the loss: the final norm's output, what it keeps and
    its gathered output, then the logits in the compute dtype (the step holds them until the loss
    is computed) and their fp32 log-softmax; the fp32 upcast between them is freed."""
    a, t, e = plan.model_args, plan.dims.tp, _compute_bytes(plan)
    tokens = _microbatch_tokens(plan)
    hidden = tokens * (e * a.dim / t + norm_kept(plan) * a.dim / t + e * a.dim * (t - 1) / t)
    if plan.loss.chunk_size:  # the chunked loss keeps the (gathered) hidden states only
        return hidden
    return hidden + tokens * a.vocab_size / t * (F32 + e)


def _logits_grad(plan: JobPlan, modules: list[str], fp8: frozenset[str]) -> float:
    """The logits' gradient at the loss's backward: fp32, and (without loss parallel, below fp32)
    its cast to the compute dtype beside it; under loss parallel only the fp32 one is live. A
    float8 output projection adds its input's gradient, whole (gathered under sequence parallel),
    in the compute dtype, and under loss parallel the gradient's two float8 casts (row- and
    column-major, for the input- and weight-gradient matmuls): traced, to the byte."""
    if "output" not in modules:
        return 0
    if plan.loss.chunk_size:
        return _chunk_grad(plan)
    a, e, tokens = plan.model_args, _compute_bytes(plan), _microbatch_tokens(plan)
    cast = e if e != F32 and not plan.loss.parallel else 0
    grad = tokens * a.vocab_size / plan.dims.tp * (F32 + cast)
    if "output" in fp8:
        grad += tokens * a.dim * e + (2 * tokens * a.vocab_size / plan.dims.tp if plan.loss.parallel else 0)
    return grad


def _gathered_hidden(plan: JobPlan) -> float:
    """Bytes of one micro-batch's final hidden states, whole (gathered over the tp ranks)."""
    return _microbatch_tokens(plan) * plan.model_args.dim * _compute_bytes(plan)


def _chunk_grad(plan: JobPlan) -> float:
    """The chunked loss's tallest moment in backward (fitted to whole traces of Llama 3 8B and 70B,
    tools/estimate README): one chunk's recomputed logits in fp32 and their gradient (and its cast to
    the compute dtype without loss parallel), the output
    weight's gradient twice (the chunk's and the sum so far, gathered, in the parameter dtype),
    and the hidden states' gradient (with tensor parallel: the chunks', their concatenation and
    the reduce-scatter's Partial input and output)."""
    a, t, e = plan.model_args, plan.dims.tp, _compute_bytes(plan)
    chunk = min(plan.loss.chunk_size, _microbatch_tokens(plan))
    cast = e if e != F32 and not plan.loss.parallel else 0
    weight = 0 if a.tie_embeddings else 2 * a.vocab_size * a.dim / t * plan.precision.param.itemsize
    return chunk * a.vocab_size / t * (2 * F32 + cast) + weight + (4 if t > 1 else 1) * _gathered_hidden(plan)


def _microbatch_activations(plan: JobPlan, modules: list[str]) -> float:
    """Bytes one micro-batch leaves in `modules` at the end of its forward: each block's share
    under the AC mode, the head's logits (last stage), the token ids and labels (first stage)."""
    blocks = sum(m.startswith("layers.") for m in modules)
    out = sum(n * block_activations(plan, mode) for mode, n in _blocks_by_mode(plan, blocks))
    if "output" in modules:
        out += _head_activations(plan)
    if "tok_embeddings" in modules:
        out += 2 * _microbatch_tokens(plan) * 8  # token ids and labels
    return out


def held_in_flight(schedule: str, pp_size: int, stages_per_rank: int, microbatches: int, pp_rank: int) -> list[int]:
    """Micro-batches whose forward a pp rank has run and whose (input-)backward it has not, per
    local stage (in tessera.pp.stage_ids order), when their count peaks, as torch 2.13's schedules
    order them (torch/distributed/pipelining/schedules.py; test_estimate checks this against the
    action lists torch generates):
    - GPipe: every forward before any backward: m;
    - 1F1B: pp - rank warm-up forwards, then one backward per forward;
    - Interleaved1F1B / InterleavedZeroBubble: (v-1)·r + h·(pp-1-rank) warm-up forwards (r: micro-
      batches per round, m // max(1, m // pp); h: 2, or 1 for the zero-bubble one, capped at m·v),
      then one more forward before the first backward; the k-th forward runs local stage (k // r) mod v;
    - ZBVZeroBubble: 2·pp - 1 - rank on its first stage and rank + 1 on its second."""
    m, v, size, rank = microbatches, stages_per_rank, pp_size, pp_rank
    if schedule == "GPipe":
        return [m]
    if schedule == "1F1B":
        return [min(m, size - rank)]
    if schedule == "ZBVZeroBubble":
        return [min(m, 2 * size - 1 - rank), min(m, rank + 1)]
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        per_round = m // max(1, m // size)
        hops = 2 if schedule == "Interleaved1F1B" else 1
        forwards = min((v - 1) * per_round + hops * (size - 1 - rank) + 1, m * v)
        return [sum((k // per_round) % v == j for k in range(forwards)) for j in range(v)]
    raise ValueError(f"no in-flight model for pipeline schedule {schedule!r}")


def activations(plan: JobPlan, pp_rank: int) -> int:
    """Bytes at the end of forward: one micro-batch without pipeline parallelism; under it, each
    local stage's micro-batch activations times the micro-batches the schedule holds for it."""
    if plan.pipeline is None:
        return int(_microbatch_activations(plan, stage_modules(plan, pp_rank)))
    stages = local_stages(plan, pp_rank)
    held = held_in_flight(plan.pipeline.schedule, plan.dims.pp, len(stages), plan.pipeline.microbatches, pp_rank)
    return int(sum(n * _microbatch_activations(plan, list(plan.pipeline.parts[s])) for s, n in zip(stages, held)))


def comm_bytes(plan: JobPlan, local_elements: int, kept: int, blocks: int, modules: list[str],
               pp_rank: int = 0) -> dict[tuple[str, str], int]:
    """Collective buffer bytes per step (as collectives.py counts them): FSDP all-gathers the
    parameters (param dtype) in forward and, resharded, again in backward, per micro-batch, and
    reduce-scatters gradients (reduce dtype) `reductions` times; TP gathers and scatters each block's two
    sequence-parallel inputs and outputs in forward and backward (and in recompute); pipeline
    stages send activations forward and gradients back."""
    dims, batch = plan.dims, plan.batch
    out: dict[tuple[str, str], int] = {}
    fsdp = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    if fsdp > 1:
        gathered = local_elements * fsdp * plan.precision.param.itemsize
        rounds = 1 if plan.pipeline is not None else batch.accumulation  # a pipeline keeps stages gathered
        out[("all_gather", "fsdp")] = int((2 * gathered - kept) * rounds)
        out[("reduce_scatter", "fsdp")] = int(local_elements * fsdp * plan.precision.reduce.itemsize) * reductions(plan)
    if dims.dp_replicate > 1:  # DDP, or HSDP's all-reduce of the reduce-scattered shards across replicas
        out[("all_reduce", "dp_replicate")] = int(local_elements * plan.precision.reduce.itemsize) * reductions(plan)
    tokens = batch.local * batch.seq_len * batch.accumulation // dims.cp  # this rank's share of the sequences
    e = plan.precision.param.itemsize
    if dims.cp > 1:  # all-gather K and V (heads repeated) of the whole sequence; backward reduce-scatters dK, dV;
        # recompute regathers them (full AC, and selective "op", which saves no gather)
        a = plan.model_args
        per_block = 2 * tokens * dims.cp * a.n_heads * a.head_dim // dims.tp * e
        rerun = sum(n for mode, n in _blocks_by_mode(plan, blocks) if mode in ("full", "selective"))
        out[("all_gather", "cp")] = per_block * (blocks + rerun)
        out[("reduce_scatter", "cp")] = per_block * blocks
    if dims.tp > 1:
        ends = ("tok_embeddings" in modules) + ("output" in modules)
        gathered, scattered = tp_bytes(tokens * plan.model_args.dim * e, _blocks_by_mode(plan, blocks), ends,
                                       plan.checkpointing.early_stop)
        out[("all_gather", "tp")], out[("reduce_scatter", "tp")] = int(gathered), int(scattered)
    if dims.pp > 1:  # per micro-batch, each stage boundary to another rank: activations forward, gradients back
        out[("send_recv", "pp")] = int(2 * _pipeline_hops(plan, pp_rank) * tokens * plan.model_args.dim // dims.tp * e)
    return out


def reductions(plan: JobPlan) -> int:
    """Gradient reductions per step: one (after the last micro-batch; a pipeline's, after its last
    backward), or each accumulation micro-batch's with parallelism.fsdp_reduce_every_microbatch and
    under DDP (torch's DDP all-reduces every backward)."""
    dims = plan.dims
    every = plan.fsdp.reduce_every_microbatch or not dims.fsdp_enabled
    return plan.batch.accumulation if plan.pipeline is None and every else 1


def tp_bytes(hidden: float, blocks_by_mode, ends: float, early_stop: bool = True) -> tuple[float, float]:
    """(all-gather, reduce-scatter) buffer bytes of sequence-parallel TP per step: each block
    gathers its two inputs (attention, feed-forward) and reduce-scatters its two outputs in
    forward, the reverse in backward; recompute regathers both inputs and, under full AC, reruns
    wo's reduce-scatter, and w2's, the block's last, unless it stops early (`early_stop`; selective
    AC "op" keeps both reduce-scatters' results); the
    embedding and the head one each; offload recomputes nothing, nor does compile's memory budget
    rerun a collective (torch's partitioner saves them: partitioners.force_save_collectives).
    `hidden`: the bytes of the step's hidden states on this rank (tokens x dim x element size);
    `blocks_by_mode`: (AC mode, blocks) pairs."""
    rerun = {"none": (0, 0), "offload": (0, 0), "memory_budget": (0, 0), "full": (1, 0.5 if early_stop else 1),
             "selective": (1, 0)}
    gathered = scattered = hidden * ends
    for mode, blocks in blocks_by_mode:
        regather, rescatter = rerun[mode]
        gathered += 2 * hidden * blocks * (2 + regather)
        scattered += 2 * hidden * blocks * (2 + rescatter)
    return gathered, scattered


def _pipeline_hops(plan: JobPlan, pp_rank: int) -> int:
    """Stage boundaries the rank sends or receives across (a V-shaped schedule's turn at the last
    rank stays on it)."""
    n, size = len(plan.pipeline.parts), plan.dims.pp
    owner = {s: r for r in range(size) for s in pp.stage_ids(r, size, n, plan.pipeline.schedule)}
    return sum((owner[s] == pp_rank) + (owner[s + 1] == pp_rank) for s in range(n - 1) if owner[s] != owner[s + 1])
