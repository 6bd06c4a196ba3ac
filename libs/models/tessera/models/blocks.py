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

import tessera.models.moe.grouped_mm  # noqa: F401  (registers tessera::grouped_mm, which selective AC keeps)

AC_MODES = ("none", "full", "selective", "memory_budget", "offload")
_CHECKPOINT_DEFAULTS = {"early_stop": True, "determinism_check": "default", "debug": False}

# Outputs kept by selective AC: recomputing matmuls (the experts' grouped ones too) and attention
# dominates backward cost; the rest is cheap.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._grouped_mm.default,
    torch.ops.tessera.grouped_mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}


_PROFILER_OPS = {torch.ops.profiler._record_function_enter_new.default, torch.ops.profiler._record_function_exit.default,
                 torch.ops.profiler._record_function_exit._RecordFunction}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


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


def _rereadable_contexts(policy_fn):
    """create_selective_checkpoint_contexts whose cached outputs both backward passes of a split
    backward can read; the two modes share one cache, swapped for rows of _KeepEntries."""
    forward_mode, recompute_mode = create_selective_checkpoint_contexts(policy_fn)
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
) -> None:
    """Wrap blocks of ``model.layers`` so backward recomputes their activations instead of
    keeping them, trading compute for memory.

    mode (one of ``AC_MODES``): "none" leaves the model as it is, and so do "memory_budget"
    (compile's partitioner chooses what to recompute: ``apply_compile(memory_budget=...)``) and
    "offload" (nothing recomputed, the saved tensors moved to host: ``offload_activations``); "full" recomputes every block;
    "selective" with option "op" wraps every block but keeps the outputs of matmuls and attention
    (the costly ops) and recomputes only the cheap ones (norms, activations, elementwise), and
    with an integer option N (2 or "2") fully checkpoints every N-th block (as torchtitan: the
    N-th, 2N-th, ... of ``model.layers``, indices N-1, 2N-1, ...) and leaves the others alone. ``option`` only matters for
    "selective". ValueError naming the culprit for an unknown mode or option.

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
        contexts["context_fn"] = functools.partial(make_contexts, _save_matmuls)
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
