"""Activation offload: what each block saves for backward goes to host memory during forward and
comes back when backward needs it, so the accelerator holds one block's activations at a time
instead of every block's, at the price of two copies over the host link and no recompute.

It acts on the blocks of ``model.layers`` through forward hooks (no wrapper, so parameter names
and the compiled regions are unchanged): a block's pre-hook enters
``torch.autograd.graph.saved_tensors_hooks`` and its forward hook leaves it, so a compiled
block's saved tensors are offloaded too, from outside the compiled code. Parameters (and views
of them) stay: they are there for backward anyway. On CUDA the copy out runs on a side stream
into pinned memory and the copy back waits for it; on a CPU the "host" is the same memory, so
the copies only prove the round trip (tests) and save nothing.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

_SIDE_STREAMS: dict[torch.device, object] = {}


def offload_activations(model: nn.Module) -> list:
    """Offloads the saved activations of every block of ``model.layers``; returns the hook
    handles. Apply after compile (the hooks then sit outside each compiled block)."""
    handles = []
    for block in model.layers.values():
        state = _BlockOffload()
        handles.append(block.register_forward_pre_hook(state.enter))
        handles.append(block.register_forward_hook(state.leave, always_call=True))
    return handles


def copy_to_host(t: torch.Tensor) -> tuple:
    """(device, host copy, event the copy back waits for): the packed form of a saved tensor."""
    if t.device.type != "cuda":
        host = torch.empty_like(t, device="cpu")
        host.copy_(t)
        return t.device, host, None
    stream = _SIDE_STREAMS.get(t.device)
    if stream is None:
        stream = _SIDE_STREAMS[t.device] = torch.cuda.Stream(t.device)
    stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written by now
    with torch.cuda.stream(stream):
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        event = stream.record_event()
    t.record_stream(stream)  # its memory is not reused before the copy ends
    return t.device, host, event


def copy_back(packed: tuple) -> torch.Tensor:
    device, host, event = packed
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)
    return host.to(device, non_blocking=True)


class _BlockOffload:
    """One block's hooks. A tensor saved by several ops (a norm's output feeding q, k and v) is
    copied once per forward: the copies are keyed by the tensor, held weakly so that a freed
    tensor's reused id never finds another's copy."""

    def __init__(self) -> None:
        self._context = None
        self._copies: dict[int, tuple[weakref.ref, tuple]] = {}

    def enter(self, module, args) -> None:
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, copy_back)
        self._context.__enter__()

    def leave(self, module, args, output) -> None:
        self._context.__exit__(None, None, None)
        self._context = None
        self._copies.clear()

    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t.device, t, None  # copy_back hands it back as it is
        seen = self._copies.get(id(t))
        if seen is not None and seen[0]() is t:
            return seen[1]
        packed = copy_to_host(t)
        self._copies[id(t)] = (weakref.ref(t), packed)
        return packed

