"""The context the loss and its backward run in when logits stay split on vocab."""

from __future__ import annotations

import contextlib
from typing import ContextManager

from torch.distributed.tensor.parallel import loss_parallel


def loss_parallel_context(enabled: bool) -> ContextManager[None]:
    """``loss_parallel()`` when enabled, else a null context.

    Wrap both the cross-entropy and ``loss.backward()``: torch's parallel cross-entropy computes
    the softmax over vocab-sharded logits with small all-reduces, and its backward only works
    inside the same context.
    """
    return loss_parallel() if enabled else contextlib.nullcontext()
