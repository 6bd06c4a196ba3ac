"""Apply a tensor-parallel plan (module-path pattern -> role) with torch's ``parallelize_module``.

Megatron-style layout: each block's colwise linears (q/k/v, w1/w3) split their output features
over the TP ranks and the rowwise linears (wo, w2) their input features, so a block needs one
collective forward and one backward. With sequence parallelism the activations between blocks
(embedding output, norms, residual stream) are split on the sequence dimension instead of
replicated: the all-reduce becomes an all-gather before and a reduce-scatter after each block.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

ROLES = frozenset({"vocab_embedding", "vocab_output", "norm", "block_input", "colwise", "rowwise"})


def _style_for_role(role: str, sequence_parallel: bool, loss_parallel: bool) -> ParallelStyle | None:
    """The ParallelStyle a role gets; None where the module stays as it is (a norm without SP)."""
    # Layout of the hidden state between blocks: split on the sequence under SP, else whole.
    between_blocks = Shard(1) if sequence_parallel else Replicate()
    if role == "vocab_embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks)
    if role == "vocab_output":
        # Loss parallel keeps the logits split on vocab (a DTensor) so the full logits never exist.
        return ColwiseParallel(
            input_layouts=between_blocks,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if role == "norm":
        return SequenceParallel() if sequence_parallel else None
    if role == "block_input":
        # The block gets a Replicate DTensor (use_local_output=False), so the gradients its
        # colwise linears send back accumulate as one Partial DTensor: one reduce-scatter (SP)
        # or all-reduce per block in backward instead of one per linear.
        return PrepareModuleInput(input_layouts=(between_blocks,), desired_input_layouts=(Replicate(),))
    if role == "colwise":
        return ColwiseParallel()
    if role == "rowwise":
        return RowwiseParallel(output_layouts=between_blocks)
    raise ValueError(f"unknown tensor-parallel role {role!r}; known roles: {sorted(ROLES)}")


def _matches(pattern: list[str], path: list[str]) -> bool:
    return len(pattern) == len(path) and all(p in ("*", name) for p, name in zip(pattern, path))


def resolve_plan(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """Expands ``plan`` to {module path: role} over ``model``'s modules.

    ``*`` matches exactly one path component. An unknown role, a pattern matching no module, or
    a module matched by two patterns is a ValueError naming the culprit.
    """
    paths = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    claimed_by: dict[str, str] = {}
    for pattern, role in plan.items():
        if role not in ROLES:
            raise ValueError(
                f"tensor-parallel plan entry {pattern!r}: unknown role {role!r}; known roles: {sorted(ROLES)}"
            )
        parts = pattern.split(".")
        hits = [path for path in paths if _matches(parts, path.split("."))]
        if not hits:
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
) -> nn.Module:
    """Shards ``model`` in place over the 1-D ``tp_mesh`` following ``plan``; returns it.

    The plan is checked against the model before anything changes; tied parameters whose roles
    give them different layouts show only after sharding (ValueError). Under ``loss_parallel``
    the model returns logits as a DTensor split on vocab: compute the loss and run backward
    inside ``loss_parallel_context(True)``. Weights are taken from the mesh's first rank.
    """
    resolved = resolve_plan(model, plan)
    tied = _shared_parameters(model)
    for path, role in resolved.items():
        style = _style_for_role(role, sequence_parallel, loss_parallel)
        if style is not None:
            parallelize_module(model.get_submodule(path), tp_mesh, style)
    _tie_again(tied)
    return model
