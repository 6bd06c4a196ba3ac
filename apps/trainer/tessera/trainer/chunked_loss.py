"""The loss that projects the final hidden states to the vocabulary chunk by chunk
(training.loss_chunk_size), so that no micro-batch's whole logits ever exist, forward or backward.

At 128k vocabularies the logits are a step's largest tensors (Llama 3 8B at seq 8192: 8192 x
128,256 in bf16, then their fp32 upcast, log-softmax and gradient). Here the model's ``output``
passes the final norm's output through (``HiddenOutput``: same parameter, same state-dict name),
and the loss runs the projection and the cross-entropy per chunk of tokens under activation
checkpointing: forward keeps each chunk's hidden states only, backward recomputes one chunk's
logits at a time. The price is one more forward of the output projection (~2 % of an 8B step's
FLOPs, more on small models).

Layouts: under tensor parallel the hidden states come out gathered (a Replicate DTensor) and
each chunk's logits are split on vocab (loss parallel) or gathered; FSDP keeps the projection's
weights gathered from its forward to its backward (``apply_fsdp(keep_output_gathered=True)``),
as the loss reads them after the model's forward; a pipeline computes it on its last stage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.utils.checkpoint import checkpoint


class HiddenOutput(nn.Linear):
    """The output projection deferred to the loss: forward hands the hidden states on, the loss
    calls ``project`` on chunks of them."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # a copy, not the input itself: FSDP takes a module's output that is a view of its input
        # (what its own forward hooks return) for an in-place risk and warns on every step
        return hidden.clone()

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight, self.bias)


def defer_output(model: nn.Module) -> None:
    """Swaps ``model.output`` (a plain nn.Linear; the job plan refuses a converted one) for a
    HiddenOutput holding the same Parameters, so tied embeddings stay tied."""
    output = model.output
    if type(output) is not nn.Linear:
        raise TypeError(f"the chunked loss defers a plain nn.Linear output projection, not {type(output).__name__}")
    deferred = HiddenOutput(output.in_features, output.out_features, bias=output.bias is not None, device="meta")
    deferred.weight, deferred.bias = output.weight, output.bias
    model.output = deferred


def hidden_output_style(layouts) -> ColwiseParallel:
    """tessera.tp's ``vocab_output`` role for a HiddenOutput: the weight split on vocab as
    before; its forward's output, the hidden states, gathered on every rank (a Replicate DTensor),
    so that each chunk's projection gives that chunk's vocab-split logits."""
    return ColwiseParallel(input_layouts=layouts.between_blocks, output_layouts=Replicate(), use_local_output=False)


class ChunkedCrossEntropy:
    """(hidden states [B, T, dim], labels [B, T]) -> the mean next-token loss that
    step.cross_entropy gives of their logits, with at most ``chunk_size`` tokens' logits alive.
    ``bind`` hands it the model part whose HiddenOutput it projects with (the last pipeline stage).
    The mean is over every label: Tessera's batches hold no ignored positions."""

    def __init__(self, chunk_size: int, gather_logits: bool, compile_backend: str | None = None):
        self.chunk_size, self.gather_logits = chunk_size, gather_logits
        self.output: HiddenOutput | None = None
        self._chunk = torch.compile(self._chunk_loss, backend=compile_backend) if compile_backend else self._chunk_loss

    def bind(self, parts: Sequence[nn.Module]) -> None:
        outputs = [part.output for part in parts if isinstance(getattr(part, "output", None), HiddenOutput)]
        self.output = outputs[0] if outputs else None

    def _chunk_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.output.project(hidden)
        if self.gather_logits and isinstance(logits, DTensor):  # tensor parallel without loss parallel
            logits = logits.full_tensor()
        return F.cross_entropy(logits.float(), labels, reduction="sum")

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden, labels = hidden.flatten(0, 1), labels.flatten()
        total = None
        for h, y in zip(hidden.split(self.chunk_size), labels.split(self.chunk_size)):
            loss = checkpoint(self._chunk, h, y, use_reentrant=False)
            total = loss if total is None else total + loss
        return total / labels.numel()
