"""Cutting a model into pipeline stages by module names."""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn


def model_parts_names(model: nn.Module, layers: str = "layers") -> tuple[list[str], int, list[str]]:
    """(inputs, number of blocks, outputs) of a model that follows the conventions in
    tessera.pp.stages: the direct children before and after its ``layers`` ModuleDict."""
    children = [name for name, _ in model.named_children()]
    if layers not in children or not isinstance(getattr(model, layers), nn.ModuleDict):
        raise ValueError(f"{type(model).__name__} has no nn.ModuleDict child {layers!r} to cut into pipeline stages")
    at = children.index(layers)
    return children[:at], len(getattr(model, layers)), children[at + 1:]


def keep_only(model: nn.Module, names: Sequence[str], layers: str = "layers") -> nn.Module:
    """A copy of `model` holding only the named modules (children and ``layers.<key>`` blocks).

    Dropped children become None and dropped blocks leave the ModuleDict, whose remaining keys
    are unchanged, so parameter names (and so checkpoints) are the same under every pipeline
    layout. The model's forward must accept that (see tessera.pp's README).
    """
    part = copy.deepcopy(model)
    keep = set(names)
    blocks = getattr(part, layers)
    for key in list(blocks.keys()):
        if f"{layers}.{key}" not in keep:
            del blocks[key]
    for name, _ in list(part.named_children()):
        if name != layers and name not in keep:
            setattr(part, name, None)
    return part
