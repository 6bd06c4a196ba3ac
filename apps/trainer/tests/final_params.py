"""The trainer's parameters after its last step, captured for parity tests: as the run closes its
checkpointer (every rank does, so the collective gathers can), each rank records the full
tensors of the model state it holds; under pipeline parallel each rank holds other keys."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from tessera.trainer.checkpointing import Checkpointer

# Final parameters of two layouts agree within ADAMW_ATOL after a few AdamW steps at the default
# lr (8e-4). AdamW divides each gradient element by its own size plus eps (1e-8), so a rounding
# difference d in an element near zero moves its update by up to lr * d / eps; reductions summed
# in another order (other layouts, other CPUs) differ by d ~ 1e-9 on these tiny models, a tenth
# of a step (4.0e-5 measured: qwen3 tiny under CP 2, on an AVX-512 machine). A wrong gradient
# moves weights by whole steps, and changes the losses and grad norms the tests compare at 1e-5.
ADAMW_ATOL = 8e-5  # lr / 10


@contextlib.contextmanager
def final_params() -> Iterator[dict[str, torch.Tensor]]:
    params, close = {}, Checkpointer.close

    def gather_then_close(self, after_failure=False):
        log = logging.getLogger("torch.distributed.tensor._redistribute")
        was, log.disabled = log.disabled, True  # its notes on gathering FSDP x TP weights are about this gather
        try:
            for key, value in self.states["model"].state_dict().items():
                params[key] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        finally:
            log.disabled = was
        close(self, after_failure)

    Checkpointer.close = gather_then_close
    try:
        yield params
    finally:
        Checkpointer.close = close


def assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float, what: str) -> None:
    assert got.keys() == want.keys(), what
    worst, name = max(((got[key] - value).abs().max().item(), key) for key, value in want.items())
    assert worst <= atol, f"{what}: parameters differ by up to {worst} ({name})"
