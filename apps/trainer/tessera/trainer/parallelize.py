"""The model a run trains, built in a fixed order — build, convert, parallelise, materialise —
because each stage wraps what the previous one produced:

1. build: the spec's model, whole on CPU, on the meta device on GPU;
2. convert: the plan's model converters swap modules (float8 linears) while the module tree is
   still plain, and a chunked loss defers the output projection to itself;
3. parallelise: under pipeline parallel the model is first cut into the stages this rank runs
   (tessera.pp), then each part gets tensor parallel (with the converters' styles), activation
   checkpointing and per-block compile, then FSDP/HSDP or DDP outermost;
4. materialise: a meta-built model gets storage and its initial weights, now sharded.

The result is a list of model parts (one, or one per local pipeline stage) whose parameter
names are the whole model's, so checkpoints load under any layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from tessera import cp, ep, fsdp, pp, tp
from tessera.mesh import Meshes
from tessera.models import apply_activation_checkpointing, apply_compile, inner_attentions, offload_activations
from tessera.trainer.chunked_loss import ChunkedCrossEntropy, defer_output
from tessera.trainer.plan import JobPlan
from tessera.trainer.step import LossFn, micro_batch_loss


def build_model(plan: JobPlan) -> nn.Module:
    """On CPU the full model is built and initialised before sharding, so every layout starts
    from the single-process weights (DTensor has no cross-rank RNG on CPU). On GPU it is built on
    the meta device and initialised after sharding, so no rank ever holds the whole model.
    Parameters are created in training.dtype (buffers such as RoPE tables pick their own)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(plan.precision.storage)
    try:
        with torch.device("meta") if plan.device != "cpu" else contextlib.nullcontext():
            return plan.spec.build(plan.model_args)
    finally:
        torch.set_default_dtype(previous)


def convert(model: nn.Module, plan: JobPlan) -> None:
    for converter in plan.converters:
        converter.convert(model)
    if plan.loss.chunk_size:  # the loss projects the hidden states (tessera.trainer.chunked_loss)
        defer_output(model)
    if plan.print_converted and (not dist.is_initialized() or dist.get_rank() == 0):
        print(model, flush=True)


def parallelize(model: nn.Module, plan: JobPlan, meshes: Meshes | None) -> nn.Module:
    """Applies the planned parallelisms and wrappers to the model or one pipeline stage of it."""
    dims = plan.dims
    if dims.tp_enabled:  # a family's plan covers all its flavors: a flavor (or a pipeline stage) holds some modules
        tp.apply_tp(
            model, meshes.tp, plan.spec.tp_plan, sequence_parallel=True, loss_parallel=plan.loss.parallel,
            styles=plan.tensor_parallel.styles, missing_ok=True,
        )
    for inner in inner_attentions(model):  # the planned kernel of each layer's mask
        inner.kernel = plan.attention.kernel(inner.mask, inner.sinks is not None)
    if dims.cp_enabled and len(model.layers):  # each attention: this rank's queries, every rank's keys
        cp.apply_cp(model, meshes.cp.get_group(), load_balance=plan.attention.cp_load_balance,
                    rotate_method=plan.attention.cp_rotate_method, gathered_kernel=plan.attention.cp_exchange == "gather")
    # a pipeline stage may hold only dense blocks (DeepSeek-V3's first ones) or none
    experts = ep.find_experts(model, required=False) if dims.ep_enabled else []
    # each rank its share of every layer's experts; FSDP then shards them over the ranks beside ep
    # (expert_tensor_parallel_degree 1: the ep group holds the tp ranks, each sending its share of the tokens)
    ep.apply_ep(experts, meshes.ep if experts else None, divide_grads_by_ep=True,
                split_rows_over=meshes.tp if dims.ep_spans_tp else None)
    ac = plan.checkpointing
    if ac.mode != "none":
        apply_activation_checkpointing(
            model, ac.mode, ac.selective_option, preserve_rng_state=ac.preserve_rng_state, early_stop=ac.early_stop,
            determinism_check=ac.determinism_check, debug=ac.debug,
            split_backward=plan.pipeline is not None and plan.pipeline.splits_backward,
            force_recompute_fqns=ac.force_recompute_fqns,
        )
    if plan.compile.blocks:
        if plan.tensor_parallel.async_tp:  # the plan checked CUDA, TP and compile
            tp.enable_async_tp(meshes.tp, plan.device, compile_enabled=True)
        # expert-parallel experts get FSDP hooks of their own inside the block, where dynamo breaks the graph
        apply_compile(model, backend=plan.compile.backend, memory_budget=ac.memory_budget, pareto_dir=ac.pareto_dir,
                      fullgraph=not (experts and dims.fsdp_enabled))
        if dims.tp_enabled:
            _copy_first_block_input(model)
    if ac.mode == "offload":  # hooks around the blocks, compiled or not
        offload_activations(model)
    if dims.fsdp_enabled:
        _ignore_fsdp_view_warnings(model, experts)
        fsdp.apply_fsdp(
            model, meshes.fsdp, param_dtype=plan.precision.param, reduce_dtype=plan.precision.reduce,
            reshard_after_forward=plan.fsdp.reshard_after_forward, cpu_offload=plan.fsdp.cpu_offload,
            keep_output_gathered=bool(plan.loss.chunk_size),
            own_meshes=[(module, meshes.expert_fsdp, _expert_placement(module, meshes)) for module in experts],
        )
    elif dims.dp_replicate > 1:
        fsdp.apply_ddp(model, meshes.dp_replicate)
    return model


def _ignore_fsdp_view_warnings(model: nn.Module, experts: list[nn.Module]) -> None:
    """torch 2.13's FSDP warns, once per module class on each rank, when a wrapped module returns
    a view, as an in-place op on it would skip the module's pre-backward hook (the all-gather
    before its backward). The views the families' modules return are TP's asynchronous outputs (the
    vocab-parallel embedding's AsyncCollectiveTensor), torchao's float8 matmuls reshaped back to
    3-D (the output projection's, and the model's logits with it) and the padded rows of experts
    whose rows the tp ranks split (tessera.ep). The families use them out of place, and a skipped
    hook would fail the tests that compare FSDP runs' gradients with one process's (FSDP x TP
    among them); any other module's view is still warned of."""
    names = {"Embedding", "Float8Linear", type(model).__name__, *(type(module).__name__ for module in experts)}
    classes = "|".join(re.escape(name) for name in sorted(names))
    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \(FSDP({classes})\) returned a view tensor",
                            category=UserWarning)


def _expert_placement(experts: nn.Module, meshes: Meshes):
    """FSDP shards the local experts on dim 0 while there are enough of them for its ranks; with
    fewer local experts than ranks, on dim 1 (each expert's rows), as every rank needs a shard."""
    local = next(experts.parameters()).to_local().shape[0]
    if meshes.expert_fsdp.size() <= local:
        return None
    return lambda param: Shard(1)


def _copy_first_block_input(model: nn.Module) -> None:
    """Measured (torch 2.13, CPU gloo): a compiled block fed the tensor-parallel embedding's
    output directly (the local view that DTensor's to_local returns) hands that view's backward a
    plain gradient where it expects a DTensor, and backward fails; a copy taken outside the
    compiled region keeps the two autograd graphs apart. Costs one activation copy per step."""
    blocks = list(model.layers.values())
    if blocks:
        blocks[0].register_forward_pre_hook(lambda module, args: (args[0].clone(), *args[1:]))


def init_seed(plan: JobPlan, meshes: Meshes | None) -> int | None:
    """The seed to initialise this rank's pipeline stages with, when they are initialised apart
    (meta-built, off CPU): debug.seed + the pipeline rank, as torchtitan, so stages on different
    pipeline ranks do not draw the same weights. None: nothing to reseed (on CPU the whole model
    was initialised before the cut)."""
    if plan.device == "cpu" or plan.pipeline is None or meshes is None or meshes.pp is None:
        return None
    return plan.seed + meshes.pp.get_local_rank()


def materialise(model: nn.Module, plan: JobPlan) -> None:
    """Allocates and initialises a meta-built model; FSDP-offloaded parameters live on CPU."""
    if plan.device != "cpu":
        model.to_empty(device="cpu" if plan.fsdp.cpu_offload else plan.device)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device(plan.device))


@dataclasses.dataclass
class ParallelModel:
    parts: list[nn.Module]  # the whole model, or this rank's pipeline stages in schedule order
    pipeline: pp.Pipeline | None  # runs the parts under pipeline parallel


def build_parallel_model(plan: JobPlan, meshes: Meshes | None, loss_fn: LossFn) -> ParallelModel:
    """`loss_fn` is the mean loss of one micro-batch; a pipeline computes it on its last stage."""
    model = build_model(plan)
    convert(model, plan)
    if plan.pipeline is None:
        parts, pipeline = [parallelize(model, plan, meshes)], None
    else:
        pipeline = pp.build_pipeline(
            model, meshes.pp, plan.device, parts=plan.pipeline.parts, schedule=plan.pipeline.schedule,
            n_microbatches=plan.pipeline.microbatches, loss_fn=micro_batch_loss(loss_fn, plan),
            parallelize=lambda part: parallelize(part, plan, meshes), schedule_csv=plan.pipeline.schedule_csv,
        )
        parts = pipeline.parts
        del model  # each part is a copy holding its own stage
    seed = init_seed(plan, meshes)
    if seed is not None:
        torch.manual_seed(seed)
    for part in parts:
        materialise(part, plan)
    if pipeline is not None:  # stages initialised apart (off CPU) hold differing copies of a shared module
        pipeline.copy_shared_weights()
    if isinstance(loss_fn, ChunkedCrossEntropy):
        loss_fn.bind(parts)
    return ParallelModel(parts, pipeline)
