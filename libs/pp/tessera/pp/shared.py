"""Input modules that the last stage runs as well (``model.shared_with_last_stage``), such as an
embedding that DeepSeek-V3's multi-token prediction applies again after the output head.

As Megatron-LM does with a shared embedding, the last stage holds a copy under the same name:
checkpoints see one tensor, whichever stage saves it. After each pass the copies' gradients are
summed (the gradient of the one shared weight) and every copy gets the sum, so identical copies
take identical optimizer steps; a gradient norm counts the last stage's copies out. The copies
exchange their gradients point to point (the first stage's and the last stage's pp ranks), or add
them where one rank holds both stages (V-shaped schedules).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def shared_modules(model: nn.Module, inputs: Sequence[str]) -> tuple[str, ...]:
    """``model.shared_with_last_stage`` (default: none), each one of the model's inputs."""
    shared = tuple(getattr(model, "shared_with_last_stage", ()))
    stray = [name for name in shared if name not in inputs]
    if stray:
        raise ValueError(f"{type(model).__name__}.shared_with_last_stage names {stray}, not among its inputs {list(inputs)}")
    return shared


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclasses.dataclass
class SharedCopies:
    """This pp rank's copies of the shared modules: in its first-stage part, its last-stage part
    (either may be None), and the pp rank holding the other copy when it is not this one."""

    names: tuple[str, ...]
    first: nn.Module | None
    last: nn.Module | None
    peer: int | None
    group: dist.ProcessGroup

    def _params(self, part: nn.Module | None) -> list[nn.Parameter]:
        if part is None:
            return []
        return [p for name in self.names for p in part.get_submodule(name).parameters()]

    def last_copies(self) -> list[nn.Parameter]:
        return self._params(self.last)

    @torch.no_grad()
    def _exchange(self, mine: list[torch.Tensor]) -> list[torch.Tensor]:
        """The peer's tensors of the same shapes, for ours."""
        theirs = [torch.empty_like(t) for t in mine]
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=self.peer) for t in mine]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=self.peer) for t in theirs]
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        return theirs

    @torch.no_grad()
    def copy_weights(self) -> None:
        """The last stage's copies take the first stage's values."""
        firsts, lasts = self._params(self.first), self._params(self.last)
        if firsts and lasts:
            for first, last in zip(firsts, lasts):
                _local(last).copy_(_local(first))
        elif firsts:
            self._exchange([_local(p).contiguous() for p in firsts])
        elif lasts:
            for last, value in zip(lasts, self._exchange([_local(p).contiguous() for p in lasts])):
                _local(last).copy_(value)

    def set_aside_grads(self) -> list[torch.Tensor | None]:
        """The gradients accumulated so far (earlier passes, already summed), leaving None."""
        params = self._params(self.first) + self._params(self.last)
        kept = [p.grad for p in params]
        for p in params:
            p.grad = None
        return kept

    @torch.no_grad()
    def sum_grads(self, kept: list[torch.Tensor | None]) -> None:
        """Every copy's gradient: first stage's + last stage's of this pass, plus ``kept``."""
        firsts, lasts = self._params(self.first), self._params(self.last)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in firsts + lasts]
        mine = [_local(g).contiguous() for g in grads]
        if firsts and lasts:
            sums = [a + b for a, b in zip(mine[:len(firsts)], mine[len(firsts):])]
            sums = sums + [s.clone() for s in sums]
        else:
            theirs = self._exchange(mine)
            sums = [a + b if firsts else b + a for a, b in zip(mine, theirs)]  # first stage's + last stage's
        for p, grad, total, before in zip(firsts + lasts, grads, sums, kept):
            _local(grad).copy_(total)
            p.grad = grad if before is None else before.add_(grad)
