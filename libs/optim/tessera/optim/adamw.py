"""AdamW with its moments kept in another dtype than the parameters (bfloat16 halves the state):
torch's AdamW kernels keep them in the parameter's dtype. The arithmetic runs in the
parameter's dtype; only the stored moments are rounded."""

from __future__ import annotations

from typing import Iterable

import torch

from tessera.optim.stepping import closure_loss, local, local_grad


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments; its
    arguments and defaults, no amsgrad), one parameter at a time, with exp_avg and exp_avg_sq
    stored in state_dtype. With state_dtype equal to the parameters' it matches torch's
    for-loop AdamW to rounding. Plain or DTensor parameters (the update is elementwise: each
    rank steps its shard)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, state_dtype: torch.dtype = torch.bfloat16) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"AdamW needs lr, eps, weight_decay >= 0 and betas in [0, 1) (got {lr}, {eps}, "
                             f"{weight_decay}, {betas})")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, state_dtype=state_dtype))
        self.register_load_state_dict_post_hook(_moments_as_stored)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=group["state_dtype"])
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=group["state_dtype"])
                state["step"] += 1
                step = state["step"]  # a tensor throughout, so fake tensors (tools/estimate) trace the step
                param, grad = local(p), local_grad(p)
                stored_avg, stored_sq = local(state["exp_avg"]), local(state["exp_avg_sq"])
                exp_avg = stored_avg.to(param.dtype).lerp_(grad, 1 - beta1)
                exp_avg_sq = stored_sq.to(param.dtype).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                stored_avg.copy_(exp_avg)
                stored_sq.copy_(exp_avg_sq)
                param.mul_(1 - lr * group["weight_decay"])
                denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step).sqrt()).add_(eps)
                param.sub_(exp_avg.div(denom).mul_(lr / (1 - beta1 ** step)))
        return loss


def _moments_as_stored(optimizer: AdamW) -> None:
    """After loading: torch's Optimizer.load_state_dict casts state to the parameter's dtype;
    the moments go back to state_dtype."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(group["state_dtype"])
