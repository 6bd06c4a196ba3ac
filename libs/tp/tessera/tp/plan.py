"""Apply a tensor-parallel plan (module-path pattern -> role) with torch's ``parallelize_module``.

Megatron-style layout: each block's colwise linears (q/k/v, w1/w3) split their output features
over the TP ranks and the rowwise linears (wo, w2) their input features, so a block needs one
collective forward and one backward. With sequence parallelism the activations between blocks
(embedding output, norms, residual stream) are split on the sequence dimension instead of
replicated: the all-reduce becomes an all-gather before and a reduce-scatter after each block.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from tessera.tp.local import ColwiseFromShare, LocalShards, PartialRegion


@dataclass(frozen=True)
class Layouts:
    """What a role's style depends on: whether activations between blocks are split on the
    sequence (SP), and whether the logits stay split on vocab (loss parallel)."""

    sequence_parallel: bool
    loss_parallel: bool

    @property
    def between_blocks(self) -> Placement:
        """Layout of the hidden state between blocks: split on the sequence under SP, else whole."""
        return Shard(1) if self.sequence_parallel else Replicate()


# A role's ParallelStyle for given layouts; None leaves the module as it is (a norm without SP).
StyleFactory = Callable[[Layouts], "ParallelStyle | None"]


def _vocab_output(layouts: Layouts) -> ParallelStyle:
    # Loss parallel keeps the logits split on vocab (a DTensor) so the full logits never exist.
    return ColwiseParallel(
        input_layouts=layouts.between_blocks,
        output_layouts=Shard(-1) if layouts.loss_parallel else Replicate(),
        use_local_output=not layouts.loss_parallel,
    )


def _block_input(layouts: Layouts) -> ParallelStyle:
    # The block gets a Replicate DTensor (use_local_output=False), so the gradients its colwise
    # linears send back accumulate as one Partial DTensor: one reduce-scatter (SP) or all-reduce
    # per block in backward instead of one per linear.
    return PrepareModuleInput(input_layouts=(layouts.between_blocks,), desired_input_layouts=(Replicate(),))


# The roles tessera.tp knows and their styles: the one source of role names. Other libraries
# (float8, expert parallel) pass their own factories to apply_tp to override or add roles.
DEFAULT_STYLES: Mapping[str, StyleFactory] = MappingProxyType({
    "vocab_embedding": lambda layouts: RowwiseParallel(input_layouts=Replicate(), output_layouts=layouts.between_blocks),
    "vocab_output": _vocab_output,
    "norm": lambda layouts: SequenceParallel() if layouts.sequence_parallel else None,
    "block_input": _block_input,
    "colwise": lambda layouts: ColwiseFromShare(),
    "rowwise": lambda layouts: RowwiseParallel(output_layouts=layouts.between_blocks),
    # run on plain tensors on every rank (tessera.tp.local), parameters split on the dims the
    # module declares (tp_shard_dims) and replicated otherwise: a module on the block's
    # replicated input (MLA's latent projections and norms, a router), a norm over head_dim
    # applied to the local heads, attention sinks (one per head, declared on dim 0)
    "replicated": lambda layouts: LocalShards(),
    "head_norm": lambda layouts: LocalShards(),
    "local": lambda layouts: LocalShards(),
    # stacked experts, split on the hidden features they declare; a caller whose expert parallel
    # takes the experts whole (its ep group holding the tp ranks) gives this role None
    "experts": lambda layouts: LocalShards(),
    # a module run on the whole input whose output is a partial sum (an MoE layer), and the
    # colwise / rowwise linears inside it (their input a share, their output joining the sum);
    # not "colwise": a converter's colwise style would all-reduce the share's gradient
    "partial_region": lambda layouts: PartialRegion(layouts.between_blocks),
    "partial_colwise": lambda layouts: ColwiseFromShare(),
    "rowwise_partial": lambda layouts: RowwiseParallel(output_layouts=Partial()),
})
ROLES = frozenset(DEFAULT_STYLES)


def styles_with(overrides: Mapping[str, StyleFactory] | None) -> Mapping[str, StyleFactory]:
    """DEFAULT_STYLES with a caller's factories replacing or adding roles."""
    return {**DEFAULT_STYLES, **(overrides or {})}


def _matches(pattern: list[str], path: list[str]) -> bool:
    return len(pattern) == len(path) and all(p in ("*", name) for p, name in zip(pattern, path))


def resolve_plan(model: nn.Module, plan: Mapping[str, str], roles: Collection[str] = ROLES, *,
                 missing_ok: bool = False) -> dict[str, str]:
    """Expands ``plan`` to {module path: role} over ``model``'s modules.

    ``*`` matches exactly one path component. A role outside ``roles``, a pattern matching no
    module (unless ``missing_ok``: a pipeline stage holds only part of the model), or a module
    matched by two patterns is a ValueError naming the culprit.
    """
    paths = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    claimed_by: dict[str, str] = {}
    for pattern, role in plan.items():
        if role not in roles:
            raise ValueError(
                f"tensor-parallel plan entry {pattern!r}: unknown role {role!r}; known roles: {sorted(roles)}"
            )
        parts = pattern.split(".")
        hits = [path for path in paths if _matches(parts, path.split("."))]
        if not hits and not missing_ok:
            raise ValueError(f"tensor-parallel plan pattern {pattern!r} matches no module of {type(model).__name__}")
        for path in hits:
            if path in claimed_by:
                raise ValueError(f"module {path!r} is matched by plan patterns {claimed_by[path]!r} and {pattern!r}")
            claimed_by[path] = pattern
            resolved[path] = role
    return resolved


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str, str]]]:
    """Groups of (module, attribute, path) that hold one Parameter object (tied weights)."""
    groups: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            groups.setdefault(id(param), []).append((module, name, f"{path}.{name}" if path else name))
    return [group for group in groups.values() if len(group) > 1]


def _tie_again(groups: list[list[tuple[nn.Module, str, str]]]) -> None:
    """parallelize_module gives each module its own new Parameter, which unties shared weights
    (e.g. an embedding tied to the output projection): point every alias back at one of them."""
    for (first_module, first_name, first_path), *others in groups:
        param = getattr(first_module, first_name)
        for module, name, path in others:
            layouts = [getattr(p, "placements", "not sharded") for p in (param, getattr(module, name))]
            if layouts[0] != layouts[1]:
                raise ValueError(
                    f"tied parameters {first_path!r} and {path!r} get different tensor-parallel layouts "
                    f"({layouts[0]} vs {layouts[1]}); give both modules matching roles"
                )
            setattr(module, name, param)


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: Mapping[str, str],
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    styles: Mapping[str, StyleFactory] | None = None,
    missing_ok: bool = False,
) -> nn.Module:
    """Shards ``model`` in place over the 1-D ``tp_mesh`` following ``plan``; returns it.

    The plan is checked against the model before anything changes; tied parameters whose roles
    give them different layouts show only after sharding (ValueError). Under ``loss_parallel``
    the model returns logits as a DTensor split on vocab: compute the loss and run backward
    inside ``loss_parallel_context(True)``. Weights are taken from the mesh's first rank.
    ``styles`` (role -> StyleFactory) replaces or adds to DEFAULT_STYLES, e.g. float8 linears
    or expert-parallel modules from other libraries. ``missing_ok`` skips plan patterns that
    match nothing, for a pipeline stage holding part of the model.
    """
    factories = styles_with(styles)
    resolved = resolve_plan(model, plan, roles=factories.keys(), missing_ok=missing_ok)
    tied = _shared_parameters(model)
    layouts = Layouts(sequence_parallel, loss_parallel)
    for path, role in resolved.items():
        style = factories[role](layouts)
        if style is not None:
            parallelize_module(model.get_submodule(path), tp_mesh, style)
    _tie_again(tied)
    return model
