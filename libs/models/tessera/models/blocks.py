"""Per-block transforms of a decoder: activation checkpointing and torch.compile.

They act on any model whose transformer blocks are the children of ``model.layers`` (an
``nn.ModuleDict``; a pipeline stage may hold only some of them) and replace each chosen block in
place under its own name, so the wrappers sit inside whatever is applied later (FSDP per block).
"""

import functools
from collections import defaultdict

import torch
import torch._functorch.config
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

AC_MODES = ("none", "full", "selective", "memory_budget", "offload")
_CHECKPOINT_DEFAULTS = {"early_stop": True, "determinism_check": "default", "debug": False}

# Outputs selective AC "op" keeps, after torchtitan's op-level policy (its models' parallelize.py;
# CPU's flash kernel added, the all-to-all kept for every family): the attention kernels', the
# collectives ending a sequence-parallel or expert-parallel exchange, amax (float8's scales), and
# every second matmul of a block (_op_policy); the rest, cheap elementwise ops and the other
# matmuls, is recomputed. The blocked kernel's attention off the CPU flash kernel (context
# parallel's all-gather exchange on GPUs, MLA's narrower values) is plain matmuls: recomputed.
_SAVED_OPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_attention_math.default,
    torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
    torch._higher_order_ops.flex_attention,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops.aten.max.default,
    torch._higher_order_ops.inductor_compiled_code,
}
# torchtitan's activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns default: the MoE
# router's matmul is recomputed (it is small), and not counted among the block's matmuls.
FORCE_RECOMPUTE_DEFAULT = ("moe.router.gate",)


_PROFILER_OPS = {torch.ops.profiler._record_function_enter_new.default, torch.ops.profiler._record_function_exit.default,
                 torch.ops.profiler._record_function_exit._RecordFunction}


def _op_policy(recompute_shapes: frozenset):
    """A fresh policy per block call: it keeps the 1st, 3rd, 5th ... matmul (counted apart in
    forward and in recompute, so both passes agree) and recomputes the others, and any matmul
    whose weight operand has one of `recompute_shapes` ((in, out) features)."""
    matmuls = {False: 0, True: 0}  # by ctx.is_recompute

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op is torch.ops.aten.mm.default:
            if tuple(args[1].shape) in recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            matmuls[ctx.is_recompute] += 1
            keep = matmuls[ctx.is_recompute] % 2 == 1
        else:
            keep = op in _SAVED_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    policy.rewind = lambda: matmuls.update({True: 0})  # a recomputation starts (_rewinding)
    return policy


def force_recompute_shapes(model: nn.Module, fqns: tuple[str, ...]) -> frozenset:
    """(in, out) features of the linears whose names contain one of `fqns`, as torchtitan matches
    them (none: a pipeline stage may hold no router); ValueError naming a match that is not a linear."""
    shapes = set()
    for name, module in model.named_modules():
        if any(fqn in name for fqn in fqns):
            if not isinstance(module, nn.Linear):
                raise ValueError(f"{name} is a {type(module).__name__}, not a Linear: its matmuls cannot be "
                                 "forced to recompute")
            shapes.add((module.in_features, module.out_features))
    return frozenset(shapes)


class _KeepEntries(dict):
    """One op's row of a selective-checkpoint cache that keeps each entry once written.

    torch 2.13's recompute mode (torch.utils.checkpoint._CachedTorchDispatchMode) marks an entry
    consumed by overwriting it, so a second backward through the block fails ("backward an extra
    time"). Split-backward pipeline schedules run two: input gradients, then weight gradients from
    the same graph (torch.utils.checkpoint.GraphExecGroup, which recomputes once, refuses them: both
    passes unpack the matmul nodes' saved tensors). Ignoring the overwrite lets both passes read the
    cached outputs; the cache lives in the checkpoint's frame, so it is freed with the block's graph.
    Guarded by libs/models/tests/test_blocks.py (torch's cache still refuses, this one still reads twice).
    """

    def __setitem__(self, key, value):
        self.setdefault(key, value)


class _RereadRow(list):
    """torch 2.11's row of the cache: forward appends, a recomputation pops from the front (so a
    second backward found it empty). Here the entries stay, read from the front again by each
    recomputation (_rewinding)."""

    read = 0

    def pop(self, index=0):
        self.read += 1
        return self[self.read - 1]


@functools.cache
def _rewinding(mode_type: type) -> type:
    """torch 2.11's recompute mode, which asks the policy again as it recomputes: each
    recomputation starts the policy's matmul count and the rows' reads afresh, so both passes of
    a split backward decide and read as forward did (2.13 replays forward's decisions itself)."""

    class Rewinding(mode_type):
        def __enter__(self):
            self.policy_fn.rewind()
            for row in self.storage.values():
                row.read = 0
            return super().__enter__()

    return Rewinding


def _rereadable_contexts(policy_fn):
    """create_selective_checkpoint_contexts whose cached outputs both backward passes of a split
    backward can read; the two modes share one cache, swapped for rows of _KeepEntries (torch
    2.13) or _RereadRow (2.11, whose rows are lists)."""
    forward_mode, recompute_mode = create_selective_checkpoint_contexts(policy_fn)
    if forward_mode.storage.default_factory is list:
        forward_mode.storage = recompute_mode.storage = defaultdict(_RereadRow)
        recompute_mode.__class__ = _rewinding(type(recompute_mode))
    else:
        forward_mode.storage = recompute_mode.storage = defaultdict(_KeepEntries)
    return forward_mode, recompute_mode


def _every_n(option: str | int) -> int:
    """N of an every-N-th-block option (2 or "2"); ValueError naming anything else."""
    if (isinstance(option, int) or (isinstance(option, str) and option.isdigit())) and int(option) >= 1:
        return int(option)
    raise ValueError(f"selective activation checkpointing option {option!r} is not 'op' or a positive int")


def apply_activation_checkpointing(
    model: nn.Module, mode: str, option: str | int = "op", *, preserve_rng_state: bool = False,
    early_stop: bool = True, determinism_check: str = "default", debug: bool = False, split_backward: bool = False,
    force_recompute_fqns: tuple[str, ...] = FORCE_RECOMPUTE_DEFAULT,
) -> None:
    """Wrap blocks of ``model.layers`` so backward recomputes their activations instead of
    keeping them, trading compute for memory.

    mode (one of ``AC_MODES``): "none" leaves the model as it is, and so do "memory_budget"
    (compile's partitioner chooses what to recompute: ``apply_compile(memory_budget=...)``) and
    "offload" (nothing recomputed, the saved tensors moved to host: ``offload_activations``); "full" recomputes every block;
    "selective" with option "op" wraps every block and keeps what torchtitan's op-level policy
    keeps: attention's outputs, every second matmul's (the 1st, 3rd, ... of each block: wq, wv,
    w1, w2 of a Llama block), sequence- and expert-parallel exchanges' results and amax, while
    the other matmuls and the cheap ops (norms, activations, elementwise) are recomputed; the
    matmuls of the linears named by ``force_recompute_fqns`` (torchtitan's
    per_op_sac_force_recompute_mm_shapes_by_fqns, the MoE router by default) are always
    recomputed, by shape as torchtitan matches them. "selective" with an integer option N (2 or
    "2") fully checkpoints every N-th block (as torchtitan: the N-th, 2N-th, ... of
    ``model.layers``, indices N-1, 2N-1, ...) and leaves the others alone. ``option`` only matters
    for "selective". ValueError naming the culprit for an unknown mode or option.

    The keywords are torch.utils.checkpoint's: RNG state matters only to blocks with dropout
    (saving it costs every forward); early_stop ends a recomputation once it has produced what
    backward needs; determinism_check "default" compares the recomputed tensors' metadata;
    debug records the recomputed ops for a mismatch report. split_backward: backward runs twice
    through each block (pipeline schedules that compute input then weight gradients), so selective
    "op" keeps its cached outputs until the block's graph is freed rather than dropping each once read.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is not one of {AC_MODES}")
    if mode in ("none", "memory_budget", "offload"):
        return
    # A context_fn only for selective-op: torch.compile (2.13) fails on a checkpoint given any
    # context_fn it cannot trace, the default noop one passed explicitly included.
    # torch's defaults are left implicit, like context_fn below, so torch.compile sees the plain call
    contexts = {key: value for key, value in (("early_stop", early_stop), ("determinism_check", determinism_check),
                                              ("debug", debug)) if value != _CHECKPOINT_DEFAULTS[key]}
    every_n = 1
    if mode == "selective" and option == "op":
        make_contexts = _rereadable_contexts if split_backward else create_selective_checkpoint_contexts
        shapes = force_recompute_shapes(model, force_recompute_fqns)
        contexts["context_fn"] = lambda: make_contexts(_op_policy(shapes))
        # profiler marks are bookkeeping, not computation: hooks inside a block (FSDP on its experts)
        # place a different number of them in forward and recomputation, which SAC would count
        SAC_IGNORED_OPS.update(_PROFILER_OPS)
    elif mode == "selective":
        every_n = _every_n(option)
    for index, (name, block) in enumerate(model.layers.named_children()):
        if (index + 1) % every_n == 0:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=preserve_rng_state, **contexts)
            model.layers.register_module(name, wrapped)


def apply_compile(model: nn.Module, backend: str = "inductor", *, memory_budget: float | None = None,
                  pareto_dir: str | None = None, fullgraph: bool = True) -> None:
    """Compile each block of ``model.layers`` on its own (``fullgraph=True``): the blocks are
    identical, so one graph is compiled and reused for all, and hooks that FSDP puts around each
    block (all-gather before, reshard after) stay outside the compiled regions.

    ``fullgraph=False`` where a block holds a module with FSDP hooks of its own (expert-parallel
    experts sharded over their own mesh): dynamo cannot trace FSDP2's hooks (torch 2.13 runs them
    under ``torch._dynamo.disable``), so the block breaks there: the code before and after the
    experts' call compiles as graphs of its own, and the experts' forward (the expert-parallel
    exchange with it) as a frame of its own, whole where its shapes are static.

    ``memory_budget`` (0 to 1): the blocks' activation memory kept, as a fraction between
    recomputing everything the partitioner may (0) and its default choice (1): the min-cut
    partitioner picks what backward recomputes (``torch._functorch.config.activation_memory_budget``,
    torchtitan's activation_checkpoint.mode "memory_budget"). ``pareto_dir``: where it also plots
    the memory/recompute Pareto front of each graph (an SVG per rank and graph). Both hold for
    these blocks' compilation only, not for the process."""
    if memory_budget is not None:
        backend = _with_budget(backend, memory_budget, pareto_dir)
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, fullgraph=fullgraph, backend=backend))


def _with_budget(backend: str, memory_budget: float, pareto_dir: str | None):
    """The backend, compiling under the partitioner's memory budget: the forward/backward split is
    made when dynamo hands the backend its graph, so the setting is patched around that call."""
    compiler = torch._dynamo.lookup_backend(backend)
    settings = {"activation_memory_budget": memory_budget}
    if pareto_dir is not None:
        settings |= {"visualize_memory_budget_pareto": True, "memory_budget_pareto_dir": pareto_dir}

    def compile_under_budget(graph, example_inputs):
        with torch._functorch.config.patch(**settings):
            return compiler(graph, example_inputs)

    return compile_under_budget
