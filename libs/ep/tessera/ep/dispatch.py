"""The token exchange of expert parallelism, as functions of (rows, counts, process group).

Each of the ``ep`` ranks holds ``L = E / ep`` consecutive experts and routes its own tokens to
all E of them. Forward, per layer:

1. all-to-all of the counts [E] (equal splits of L): every rank learns how many rows it will
   receive from each rank for each of its local experts;
2. one host read of the send and receive split sizes (the only host sync per layer: the
   variable-split all-to-all needs them as Python ints; backward reuses them);
3. all-to-all of the rows with those splits (autograd-aware: its backward is the reverse
   all-to-all of the gradients);
4. a stable sort of the received rows by local expert (they arrive grouped by source rank, then
   by expert), so the local experts get them grouped as the seam wants;
5. after the experts: the inverse permutation and the reverse all-to-all, giving back the
   caller's rows in the caller's order.

Gloo (torch 2.13) runs variable-split ``all_to_all_single`` as NCCL does, so both use one path.

The host read is the dropless exchange's price: ``all_to_all_single`` takes its split sizes as
Python ints on every backend (torch 2.13 has no device-side splits), and a layer's counts are
known only after the previous layer ran, so it is one read per MoE layer per forward. With a
capacity per expert (the MoE layer's capacity-factor dispatch: x holds E groups of C rows) the
splits are equal and known from the shapes: ``dispatch_equal`` / ``combine_equal`` exchange
without counts, without a host read, and compile whole.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd


@dataclass(frozen=True)
class Exchange:
    """How one forward's rows travel: ``send`` rows to each rank (its split of the caller's
    rows), ``recv`` rows from each rank, ``order`` the received row each grouped row comes from,
    ``local_counts`` [L] rows per local expert."""

    send: list[int]
    recv: list[int]
    order: torch.Tensor
    local_counts: torch.Tensor


def plan_exchange(counts: torch.Tensor, group: dist.ProcessGroup) -> Exchange:
    """counts [E] long: this rank's rows per global expert (rows sorted by expert)."""
    ep = dist.get_world_size(group)
    with torch.no_grad():
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # [ep * L]: from rank s, for local expert l
        by_source = received.view(ep, -1)
        send, recv = torch.stack([counts.view(ep, -1).sum(1), by_source.sum(1)]).tolist()  # the host sync
        local = torch.arange(received.numel(), device=counts.device) % by_source.shape[1]
        expert_of_row = torch.repeat_interleave(local, received, output_size=sum(recv))
        order = torch.argsort(expert_of_row, stable=True)
    return Exchange(send, recv, order, by_source.sum(0))


def dispatch(x: torch.Tensor, exchange: Exchange, group: dist.ProcessGroup) -> torch.Tensor:
    """x [N, dim] sorted by global expert -> the rows this rank's experts serve, grouped by
    local expert ([sum(recv), dim])."""
    received = all_to_all_single_autograd(x.contiguous(), exchange.recv, exchange.send, group)
    return received[exchange.order]


def combine(out: torch.Tensor, exchange: Exchange, group: dist.ProcessGroup) -> torch.Tensor:
    """The local experts' output, grouped as ``dispatch`` returned it -> [N, dim] rows in the
    order the caller passed them to ``dispatch``."""
    by_source = torch.zeros_like(out).index_copy(0, exchange.order, out)
    return all_to_all_single_autograd(by_source, exchange.send, exchange.recv, group)


def dispatch_equal(x: torch.Tensor, n_local: int, group: dist.ProcessGroup) -> torch.Tensor:
    """x [E * C, dim]: C rows for each of the E global experts (rank r's experts are
    [r * n_local, (r + 1) * n_local)) -> [n_local * ep * C, dim]: this rank's experts' rows from
    every rank, grouped by local expert (ep * C rows each). Equal splits: no counts, no host read."""
    ep = dist.get_world_size(group)
    received = all_to_all_single_autograd(x.contiguous(), None, None, group)  # [ep (source), n_local, C, dim]
    return received.view(ep, n_local, -1, x.shape[-1]).transpose(0, 1).reshape(-1, x.shape[-1])


def combine_equal(out: torch.Tensor, n_local: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The local experts' output as ``dispatch_equal`` grouped it -> [E * C, dim] in the caller's
    layout."""
    ep = dist.get_world_size(group)
    by_source = out.view(n_local, ep, -1, out.shape[-1]).transpose(0, 1).reshape(-1, out.shape[-1])
    return all_to_all_single_autograd(by_source, None, None, group)
