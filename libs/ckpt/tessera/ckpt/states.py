"""Stateful wrappers: what a checkpoint holds for the model, the optimizers and per-rank state.

Model and optimizer state go through ``torch.distributed.checkpoint.state_dict`` so DCP can
reshard them (FSDP/TP DTensors, pipeline parts). Per-rank state (data loader position, RNG)
is one opaque bytes object per rank under a rank-unique key: DCP keeps only one copy of
entries that share a key, and a nested dict would be flattened into many entries whose sizes
must match at load time.
"""

from __future__ import annotations

import io
import random
import sys
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tessera.ckpt.dcp_io import safe_torch_load


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class ModelState:
    """The weights of all model parts (pipeline stages of this rank) as one dict.

    Keys are unique across parts because layers keep their global names.
    """

    def __init__(self, model_parts: list[nn.Module]) -> None:
        self.model_parts = list(model_parts)

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.model_parts:
            merged.update(get_model_state_dict(part))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Each part takes its own keys from the merged dict; that nothing is missing was
        # checked against the checkpoint before loading, so non-strict is safe here.
        for part in self.model_parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


_FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


class OptimizerState:
    """The optimizers of all model parts: per part an optimizer, or a list of them (Muon for the
    matrices and AdamW for the rest).

    Flattened keys ("state.<param fqn>.exp_avg", "param_groups.<param fqn>.lr") name
    parameters rather than optimizer-internal indices, so the state reshards and merges.
    """

    def __init__(self, model_parts: list[nn.Module],
                 optimizers: list[torch.optim.Optimizer | list[torch.optim.Optimizer]]) -> None:
        if len(model_parts) != len(optimizers):
            raise ValueError(f"OptimizerState needs the optimizers of each model part: {len(model_parts)} parts, "
                             f"{len(optimizers)} optimizers")
        self.model_parts = list(model_parts)
        self.optimizers = list(optimizers)

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, optimizer in zip(self.model_parts, self.optimizers):
            merged.update(get_optimizer_state_dict(part, optimizer, options=_FLAT_OPTIM))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, optimizer in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(part, optimizer, state_dict, options=_FLAT_OPTIM)


def encode_object(obj: Any, what: str) -> bytes:
    """torch.save bytes of ``obj``; refuses what weights_only loading could not read back."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    safe_torch_load(data, what)  # fail at save time, not at the resume that needs it
    return data


class RankLocalState:
    """State that differs per rank, e.g. ``RankLocalState(dataloader, f"dp_rank_{dp_rank}")``.

    ``obj.state_dict()`` may hold tensors, numbers, strings, None and lists/tuples/dicts of
    them (what ``torch.load(weights_only=True)`` reads). Ranks that share a key (tensor-parallel
    peers of one data-parallel rank) must hold equal state: DCP stores one copy per key.
    ``required=False`` lets a load where the checkpoint lacks this key (more ranks than were
    saved) keep the current state with a warning instead of failing.
    """

    def __init__(self, obj: Stateful, key: str, *, required: bool = True) -> None:
        if not key or "." in key:
            raise ValueError(f"RankLocalState key must be non-empty and contain no '.': {key!r}")
        self.obj = obj
        self.key = key
        self.required = required

    def state_dict(self) -> dict[str, Any]:
        return {self.key: encode_object(self.obj.state_dict(), f"state {self.key!r}")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(safe_torch_load(state_dict[self.key], f"state {self.key!r}"))


class _ProcessRNG:
    """This process's generators: Python, torch CPU, CUDA (if initialised), NumPy (if imported)."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        if "numpy" in sys.modules:
            name, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state(legacy=True)
            state["numpy"] = (name, keys.tolist(), pos, has_gauss, cached)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            # a state per GPU the saving process saw: a machine with fewer restores those it has
            # (torch fails on a device index beyond its own); one with more keeps the rest seeded
            torch.cuda.set_rng_state_all(state["cuda"][:torch.cuda.device_count()])
        if "numpy" in state and "numpy" in sys.modules:
            np = sys.modules["numpy"]
            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def rng_state(rank: int) -> RankLocalState:
    """RNG state of this process under key ``rank_<rank>`` (use the global rank).

    Not required on load: a run on more ranks than were saved keeps its seeded generators.
    """
    return RankLocalState(_ProcessRNG(), f"rank_{rank}", required=False)
