"""DeepSeek-V3's complementary sequence-wise balance loss (section 2.1.2, eq. 17-20), and how its
gradient reaches the router without passing through the training loss.

The MoE layer does not return the loss: it attaches it to its output with ``attach_aux_loss``, an
identity whose backward also sends ``scale`` as the loss's gradient. Whatever backward runs
through the layer (each micro-batch of gradient accumulation, each pipeline stage's backward,
activation-checkpoint recomputation included) so adds ``scale * d(loss)/d(params)`` to the
gradients, exactly as if ``scale * loss`` had been added to the training loss. ``scale`` must be
the factor the trainer applies to the training loss before its backward (1 / the micro-batches
of a step), set with ``tessera.models.moe.set_aux_loss_scale``.
"""

import torch


def sequence_balance_loss(scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """sum_i f_i * P_i averaged over sequences, without alpha. scores [B, T, E]: the affinities
    s_{i,t} (before any bias); experts [B, T, K]: the experts each token was sent to.

    f_i = E / (K T) * (tokens of the sequence sent to expert i) (1 for every i when balanced);
    P_i = mean over the sequence's tokens of s_{i,t} / sum_j s_{j,t}. Only P carries a gradient.
    A "sequence" is a row of what the layer is given (a packed window; under context parallel a
    rank's share of it).
    """
    batch, seq_len, top_k = experts.shape
    n_experts = scores.shape[-1]
    counts = torch.zeros(batch, n_experts, device=scores.device, dtype=scores.dtype)
    counts.scatter_add_(1, experts.reshape(batch, -1), torch.ones_like(experts.reshape(batch, -1), dtype=scores.dtype))
    f = counts * n_experts / (top_k * seq_len)
    p = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=1)
    return (f * p).sum(dim=-1).mean()


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(loss)  # a scalar; its gradient takes its kind (a DTensor under loss parallel)
        # the same values without a copy, and not an autograd view: FSDP warns when a module returns one
        return out.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        loss, = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def attach_aux_loss(out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``out`` unchanged; backward through it also backpropagates ``scale * loss``."""
    return _AttachAuxLoss.apply(out, loss, scale)
