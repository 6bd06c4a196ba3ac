"""The traced estimate: for one rank, the trainer's own model code and the libraries' real
parallelism (tessera.tp, tessera.fsdp, tessera.pp's stage cut) applied over a fake process group,
weights materialised as fake tensors, then one training step (the configured micro-batches, AC,
clipping and AdamW) run on fake tensors while the dispatcher counts live bytes and collectives.

Nothing is allocated and nothing is sent, so a 405B rank costs seconds and a few hundred MB.
Compile is left out (it changes kernels, not what is kept). The model takes the code path of the
device the plan is for: CPU fake tensors take tessera's CPU paths as real CPU tensors do, and a
"cuda" plan's norms and FlexAttention layers keep what CUDA's kernels keep (gpu_kernels.py).
Pipeline stages are traced for their model state only: torch's schedules exchange shape metadata
that a fake group cannot carry, so a stage's activations come from the closed-form formula times
the schedule's micro-batches in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import types
import weakref
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import _sharding_prop
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from tessera import fsdp, pp
from tessera.mesh import Meshes, build_meshes
from tessera.models import offload
from tessera.trainer.parallelize import convert, parallelize
from tessera.trainer.plan import JobPlan, traced_on_cpu
from tessera.trainer.chunked_loss import ChunkedCrossEntropy
from tessera.trainer.step import build_loss, gradient_sync, step_functions
from tessera.trainer.optimizer import build_optimizers

from collectives import Collectives, group_dims, group_ranks
from gpu_kernels import flex_attentions, flex_kept, fused_rms_norms
from live_bytes import LiveBytes
from routing import balanced_routing

# DTensor's advice on a norm reduced over two mesh dimensions (the step's clipping under FSDP x
# TP) is for the run, not the estimate: it would be printed for every traced layout
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

NO_BOS = -1  # no token id: under block-causal masks each sequence is one document (the mask path, not its values)


@dataclasses.dataclass
class RankMemory:
    """Bytes one rank holds at the step's peak, by owner; `comm`: bytes per step by (kind, mesh dim)."""

    params: int
    grads: int
    optimizer: int
    buffers: int  # model buffers (RoPE table)
    activations: int  # what forward keeps for backward, at its end (with the loss): their most, gathered weights included
    peak: int  # the step's peak (forward/backward or the optimizer step), all owners
    at_peak: dict[str, int]  # the peak by owner (see _owners): params, grads so far, ..., comm_buffers, activations
    comm: dict[tuple[str, str], int]
    traced_activations: bool = True  # False: a pipeline stage; activations 0 and `peak` the optimizer step's
    phase_peaks: dict[str, int] = dataclasses.field(default_factory=dict)  # "forward_backward", "optimizer"
    calls: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)  # collectives per step, as comm
    groups: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # mesh dim -> the rank's group


def _parts(plan: JobPlan, meshes: Meshes) -> list[torch.nn.Module]:
    """This rank's model parts on the meta device, converted and parallelised as the trainer does."""
    with torch.device("meta"):
        model = plan.spec.build(plan.model_args)
    convert(model, plan)
    if plan.pipeline is None:
        return [parallelize(model, plan, meshes)]
    pp_rank = meshes.pp.get_local_rank()
    stages = pp.stage_ids(pp_rank, plan.dims.pp, len(plan.pipeline.parts), plan.pipeline.schedule)
    return [parallelize(pp.keep_only(model, plan.pipeline.parts[s], "layers"), plan, meshes) for s in stages]


_session: dict | None = None  # shared_meshes()' open session, once it traced: {"key": (world, rank, dims), "meshes": Meshes}


@contextlib.contextmanager
def shared_meshes():
    """Traces inside share one fake process group and its meshes for as long as their world size,
    rank and parallel dims stay the same (the cuts of one model, its AC modes and local batches):
    DTensor's sharding propagation and redistribution caches, which hold the meshes, then carry
    from one trace to the next instead of being rebuilt (about a quarter of a debug model's trace).
    Each trace builds its own model, as a trainer building several models over one mesh would.
    Nested sessions are the outermost one."""
    global _session
    if _session is not None:
        yield
        return
    _session = {}
    try:
        yield
    finally:
        if _session:
            _release()
        _session = None


def _release() -> None:
    """Ends the fake process group of a trace (or a session) and DTensor's caches that hold its meshes."""
    dist.destroy_process_group()
    # DTensor caches sharding propagation and redistribution plans by mesh equality, holding
    # the mesh: the next trace's equal mesh would reuse this one's process groups, gone now
    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()


def _meshes(plan: JobPlan, rank: int) -> Meshes:
    """The meshes of the plan's dims for `rank`, over a new fake process group, or the
    shared_meshes() session's where they match (the session's released where they do not)."""
    key = plan.world_size, rank, plan.dims
    if _session:
        if _session["key"] == key:
            return _session["meshes"]
        _session.clear()
        _release()
    dist.init_process_group("fake", rank=rank, world_size=plan.world_size, store=FakeStore())
    try:
        meshes = build_meshes(plan.dims, "cpu")
    except BaseException:
        _release()
        raise
    if _session is not None:
        _session.update(key=key, meshes=meshes)
    return meshes


def trace_rank(plan: JobPlan, rank: int) -> RankMemory:
    """One rank's memory and communication for one steady-state step (optimizer state present)."""
    device, attention, plan = plan.device, plan.attention, traced_on_cpu(plan)
    world = plan.world_size
    meshes = _meshes(plan, rank) if world > 1 else Meshes.single()
    try:
        parts = _parts(plan, meshes)
        if device == "cuda":
            for part in parts:
                fused_rms_norms(part)
                flex_attentions(part, attention)
        with balanced_routing(), flex_kept(), _strided_flags_folded_once(), FakeTensorMode(allow_non_fake_inputs=True), \
                LiveBytes() as live, Collectives(group_dims(meshes), live.key) as comm, _offload_to_host(live):
            for part in parts:
                part.to_empty(device="cpu")
            optimizers = build_optimizers(parts, plan.optimizer).all
            params = [p for part in parts for p in part.parameters()]
            for p in params:  # a first step creates AdamW's state, as in every step after it
                p.grad = torch.zeros_like(p)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            live.reset_peak()
            comm.bytes.clear()
            comm.calls.clear()
            states = lambda: [v for o in optimizers for st in o.state.values() for v in st.values()]  # noqa: E731
            buffers = [b for part in parts for b in part.buffers()]
            if plan.pipeline is not None:  # model state and the optimizer step, with gradients of the params' size
                grads = [torch.zeros_like(p) for p in params]
                for p, g in zip(params, grads):
                    p.grad = g
                for optimizer in optimizers:
                    optimizer.step()
                at_peak = _owners(live, live.peak_sizes, params, grads, states(), buffers, set())
                return RankMemory(**_state(live, params, grads, states(), buffers), activations=0, peak=live.peak,
                                  at_peak=at_peak, comm={}, traced_activations=False)
            grads, forward_end, (backward_peak, backward_sizes) = _step(plan, parts, optimizers, meshes, comm, live)
            # what forward keeps, collectives' results included (selective AC "op"'s reduce-scatters,
            # expert parallel's all-to-alls that backward reads)
            at_forward_end = _owners(live, forward_end, params, grads, states(), buffers, set())
            phases = {"forward_backward": backward_peak, "optimizer": live.peak}
            at_peak = backward_sizes if backward_peak >= live.peak else live.peak_sizes
            return RankMemory(**_state(live, params, grads, states(), buffers), activations=at_forward_end["activations"],
                              peak=max(phases.values()), phase_peaks=phases,
                              at_peak=_owners(live, at_peak, params, grads, states(), buffers, comm.buffers),
                              comm=dict(comm.bytes), calls=dict(comm.calls), groups=group_ranks(meshes))
    finally:
        if world > 1 and _session is None:
            _release()


def _state(live: LiveBytes, params, grads, states, buffers) -> dict[str, int]:
    """Model state bytes, each kind whole (the gradients as the step completed them)."""
    kinds = {"params": params, "grads": grads, "optimizer": states, "buffers": buffers}
    return {name: live.bytes_of(tensors, live.sizes) for name, tensors in kinds.items()}


def _owners(live: LiveBytes, sizes: dict[int, int], params, grads, states, buffers, comm_keys: set[int]) -> dict[str, int]:
    """A snapshot of live storages split by owner, each storage counted once, in this order:
    parameters, gradients, optimizer state, buffers, collective buffers, and the rest."""
    owned, left = {}, dict(sizes)
    for name, tensors in (("params", params), ("grads", grads), ("optimizer", states), ("buffers", buffers)):
        keys = {live.key(st) for t in tensors for st in get_untyped_storages(t)} & left.keys()
        owned[name] = sum(left.pop(k) for k in keys)
    owned["comm_buffers"] = sum(left.pop(k) for k in comm_keys & left.keys())
    owned["activations"] = sum(left.values())
    return owned


@contextlib.contextmanager
def _strided_flags_folded_once():
    """Torch 2.13's sharding propagation of a foreach op (AdamW's step, the clipping) folds the
    _StridedShard flags of all the op's arguments again for each of its tensors
    (`_propagate_use_strided_shard_flag`, per child strategy): quadratic in the parameters, a fifth
    of Llama 3 405B's whole trace. The fold reads only the flags of the arguments holding a
    _StridedShard, in order, where a run of equal flags counts as one flag (and its fix-ups set
    flags to its result, which leaves the result as it was), so each op's runs are found once and
    folded for every child: the same result."""
    fold = getattr(_sharding_prop, "_propagate_use_strided_shard_flag", None)
    if fold is None:  # torch 2.11
        yield
        return
    last: list = [lambda: None, None]  # a weak reference to the op's schema, its runs

    def once(op_strategy, op_schema):
        if last[0]() is not op_schema:  # (weak: a schema's arguments may hold tensors, which LiveBytes counts)
            strided = [s for s in op_schema.args_spec if any(isinstance(p, _StridedShard) for p in s.placements)]
            runs = [s for i, s in enumerate(strided) if i == 0 or
                    s.use_strided_shard_as_shard_order != strided[i - 1].use_strided_shard_as_shard_order]
            last[:] = weakref.ref(op_schema), types.SimpleNamespace(args_spec=tuple(runs))
        return fold(op_strategy, last[1])

    with mock.patch.object(_sharding_prop, "_propagate_use_strided_shard_flag", once):
        yield


@contextlib.contextmanager
def _offload_to_host(live: LiveBytes):
    """Activation offload (mode offload) under the trace: on a CPU its host copies would be
    counted like the accelerator's memory, and the copies back would be the copies themselves.
    Here the copies out are left uncounted and each copy back is a new, counted tensor."""
    to_host, back = offload.copy_to_host, offload.copy_back

    def copy_to_host(t):
        with live.uncounted():
            return to_host(t)

    def copy_back(packed):
        host = packed[1]
        uncounted = all(live.key(s) is None for s in get_untyped_storages(host))  # a copy, not a parameter
        return host.clone() if uncounted else back(packed)

    offload.copy_to_host, offload.copy_back = copy_to_host, copy_back
    try:
        yield
    finally:
        offload.copy_to_host, offload.copy_back = to_host, back


def _step(plan: JobPlan, parts, optimizers, meshes: Meshes, comm: Collectives,
          live: LiveBytes) -> tuple[list[torch.Tensor], dict[int, int], tuple[int, dict[int, int]]]:
    """make_train_step's work without its data-dependent checks (a fake norm has no value).
    With accumulation, the first micro-batch (no gradient sync) stands for all but the last:
    its collectives are counted that many times. The trainer's own step function: each cp rank on
    its share of the sequences, block-causal masks as planned. Returns the gradients (before they
    are dropped), the live storages at the end of the last forward (the loss computed), and the
    peak before the optimizer step with its storages (`live`'s peak is then the optimizer step's)."""
    part = parts[0]
    forward_end = {}

    mean_loss = build_loss(plan)  # the whole logits' or the chunked loss, as the plan says
    if isinstance(mean_loss, ChunkedCrossEntropy):
        mean_loss.bind(parts)

    def loss_fn(logits, labels):
        loss = mean_loss(logits, labels)
        forward_end.clear()
        forward_end.update(live.sizes)
        return loss

    forward_backward = step_functions(parts, None, loss_fn, plan, meshes, bos_id=NO_BOS)[0]
    sync = gradient_sync(parts, plan)
    batch = plan.batch
    tokens = torch.zeros(batch.local, batch.seq_len, dtype=torch.long)
    if batch.accumulation > 1:
        sync(False)
        forward_backward(tokens, tokens)
        for counts in (comm.bytes, comm.calls):
            for key in list(counts):
                counts[key] *= batch.accumulation - 1
    sync(True)
    forward_backward(tokens, tokens)
    params = list(part.parameters())
    fsdp.clip_grad_norm_(params, plan.optimizer.max_norm, pp_mesh=meshes.pp, error_if_nonfinite=False)
    backward = live.peak, dict(live.peak_sizes)
    live.reset_peak()
    for optimizer in optimizers:
        optimizer.step()
    grads = [p.grad for p in params if p.grad is not None]
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    return grads, forward_end, backward


def layer_period(a) -> tuple[int, int]:
    """(d, p): the model's first d layers differ from the rest (DeepSeek's dense ones,
    ``n_dense_layers``), which repeat every p layers. A layer's kind is which of the args' layer
    index sets hold it (the fields ``*_layers`` holding layer indices: GPT-OSS's and Qwen3's
    ``window_layers``, Llama 4's ``moe_layers``, ``nope_layers``, ``chunked_layers``): GPT-OSS's
    windows alternate (p = 2), Llama 4's MoE and NoPE layers repeat every 2 and 4 layers (p = 4)."""
    sets = [value for f in dataclasses.fields(a) if f.name.endswith("_layers")
            and isinstance(value := getattr(a, f.name), tuple)]
    d = getattr(a, "n_dense_layers", 0)
    kinds = [tuple(i in layers for layers in sets) for i in range(d, a.n_layers)]
    return d, next((p for p in range(1, len(kinds)) if kinds[p:] == kinds[:-p]), max(1, len(kinds)))


def trace_by_blocks(plan: JobPlan, rank: int) -> RankMemory:
    """trace_rank of a deep model from shallow traces (extended_from_cuts). A model no deeper than
    its three shallowest cuts together (or too shallow for three) is traced whole: exact, and one
    trace of no more blocks (the debug flavors' 6 against 2 + 3 + 4)."""
    depths = _cut_depths(plan.model_args)
    if plan.pipeline is not None or len(depths) < 3 or sum(depths[:3]) >= plan.model_args.n_layers:
        return trace_rank(plan, rank)
    return extended_from_cuts(plan, rank)


def _cut_depths(a) -> range:
    """The depths extended_from_cuts may cut the model to, shallowest first."""
    d, p = layer_period(a)
    first = d + 2 + (a.n_layers - d - 2) % p
    return range(first, min(first + MAX_CUTS * p, a.n_layers), p)


def extended_from_cuts(plan: JobPlan, rank: int) -> RankMemory:
    """trace_rank from shallow traces (trace_by_blocks' for a deep model): with `d` leading blocks that
    differ from the rest and the rest repeating every `p` blocks (layer_period), the model cut to c,
    c + p, c + 2p, ... blocks (c the first depth from d + 2 on a whole number of periods short of
    n_layers, so that every cut ends as the model does), each quantity (bytes by owner, each phase's
    peak, collective bytes and calls) extended linearly from the last two cuts to all n_layers:
    every further period adds the same parameters, shards, activations and collectives. A phase's
    peak is the tallest of several moments, each linear in the blocks, so it bends where another
    moment takes over (the loss's, or a block's backward with FSDP's gathered weights beside it) and
    bends only upwards, until the moment holding every block's activations leads: cuts are added
    until two successive steps of every phase peak agree (SLOPE_AGREEMENT) and the forward-backward
    peak's step is at least a period's model state and activations, else the whole model is traced.
    Two cuts were not enough: Llama 3 405B at FSDP 128 x TP 4, local 2, full AC came out at 97.7 GiB
    from d + 2 and d + 3 against the whole trace's 35.7, and in float8 at 23.4 from d + 3 and d + 4
    against 35.8; at d + 1 the only uniform block is also the last (DeepSeek 16B's peak 8 % low).
    Seconds where the whole model takes a minute (671B: 8 s for three cuts against 33)."""
    a = plan.model_args
    depths = _cut_depths(a)
    cuts = []
    with shared_meshes():
        for n in depths:
            cuts.append(trace_rank(dataclasses.replace(plan, model_args=dataclasses.replace(a, n_layers=n)), rank))
            if len(cuts) >= 3 and _steps_agree(*cuts[-3:]):
                break
        else:
            return trace_rank(plan, rank)
    one, two = cuts[-2:]
    more = (a.n_layers - depths[len(cuts) - 2]) // depths.step  # periods from `one` to the whole model

    def extend(x: dict) -> dict:
        y = getattr(two, x)
        return {k: v + (y.get(k, 0) - v) * more for k, v in getattr(one, x).items()} | \
            {k: v * more for k, v in y.items() if k not in getattr(one, x)}

    state = {k: getattr(one, k) + (getattr(two, k) - getattr(one, k)) * more
             for k in ("params", "grads", "optimizer", "buffers", "activations")}
    phases = extend("phase_peaks")  # (the owners at the peak are not extended: each trace's may be another phase's)
    return RankMemory(**state, peak=max(phases.values()), at_peak={}, comm=extend("comm"),
                      phase_peaks=phases, calls=extend("calls"), groups=one.groups)


MAX_CUTS = 6  # shallow traces before extended_from_cuts traces the whole model instead
SLOPE_AGREEMENT = 0.01  # two successive per-block steps of a phase peak agreeing this closely: extended


def _steps_agree(a: RankMemory, b: RankMemory, c: RankMemory) -> bool:
    """Whether every phase peak grew by the same bytes (within SLOPE_AGREEMENT) from cut a to b and
    b to c, and the forward-backward one by a step's (a period's) model state and activations at least."""
    step = {k: c.phase_peaks[k] - b.phase_peaks[k] for k in c.phase_peaks}
    block = sum(getattr(c, k) - getattr(b, k) for k in ("params", "optimizer", "buffers", "activations"))
    return (all(abs(step[k] - (b.phase_peaks[k] - a.phase_peaks[k])) <= SLOPE_AGREEMENT * abs(step[k]) for k in step)
            and step["forward_backward"] >= (1 - SLOPE_AGREEMENT) * block)


def rank_roles(plan: JobPlan) -> list[tuple[int, list[int]]]:
    """(a representative rank, the ranks it stands for): ranks differ only by pipeline stage, since
    every data- and tensor-parallel rank of a stage holds same-sized shards (FSDP pads its shards
    to equal sizes), so one rank per pp rank is traced."""
    per_stage = plan.world_size // plan.dims.pp
    return [(s * per_stage, list(range(s * per_stage, (s + 1) * per_stage))) for s in range(plan.dims.pp)]
