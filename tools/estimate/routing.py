"""Balanced routing for the trace: the counts an MoE layer's data-dependent sizes come from.

Fake tensors have shapes but no values, and two places of an MoE step read values on the host:
the experts' loop path splits its rows by the per-expert counts, and expert parallel's exchange
sizes its all-to-all by them (`tessera.ep.dispatch.plan_exchange`). While `balanced_routing()` is
active, each layer's counts are the ones `debug.moe_force_load_balance` produces on a real run
(slot i of the N·K goes to expert i mod E, so every expert gets N·K/E), held as a real tensor
the host can read, and every ep rank is taken to route like this one (true of that round-robin
when the ranks hold equal batches). That is the load auxiliary-loss-free balancing steers
towards; a real imbalance adds its excess to the busiest rank's expert activations.

With the tensor-parallel ranks in the ep group (tessera.ep's `split_rows_over`) each sends its own
share of the rows, taken as routed evenly too. A real round-robin run sorts the slots by expert
before splitting them, so each share goes to fewer experts; every rank still receives as many rows
as it sends, which is what memory depends on.

The functions patched are module globals of the libraries (`tessera.models.moe.layer`'s
`expert_counts`, `tessera.ep.experts`' `plan_exchange` and `_row_share`); nothing else of their
code changes.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily

from tessera.ep.dispatch import Exchange
from tessera.ep.experts import _row_share as _ROW_SHARE


def round_robin_counts(slots: int, n_experts: int) -> list[int]:
    """Slots per expert when slot i goes to expert i mod E."""
    return [slots // n_experts + (e < slots % n_experts) for e in range(n_experts)]


class _Routed:
    """The counts the next exchange sends: a real tensor the host can read. Hooks between the MoE
    layer and its experts (FSDP's pre-forward) may turn the tensor passed along into a fake one,
    so the exchange reads them here; the layer's calls run in order (count, share, exchange)."""

    counts: torch.Tensor | None = None


def _balanced_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    with unset_fake_temporarily():
        _Routed.counts = torch.tensor(round_robin_counts(experts.numel(), n_experts), dtype=torch.long)
    return _Routed.counts


def _balanced_row_share(x: torch.Tensor, counts: torch.Tensor, rank: int, size: int):
    """tessera.ep's own share of the rows (tensor-parallel ranks joining ep), itself routed evenly
    over the experts."""
    with unset_fake_temporarily():
        share, _, (before, after) = _ROW_SHARE(torch.empty(x.shape[0], 0, device="meta"), _Routed.counts, rank, size)
        _Routed.counts = torch.tensor(round_robin_counts(share.shape[0], _Routed.counts.numel()), dtype=torch.long)
    return x[before:x.shape[0] - after], _Routed.counts, (before, after)


def _balanced_exchange(counts: torch.Tensor, group: dist.ProcessGroup) -> Exchange:
    """plan_exchange's result when every rank of the group sends the counts this rank sends. The
    counts' own all-to-all still runs (on fake tensors), so its bytes are counted."""
    dist.all_to_all_single(torch.empty(counts.shape, dtype=torch.long), torch.empty(counts.shape, dtype=torch.long),
                           group=group)
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    with unset_fake_temporarily():
        counts = _Routed.counts.view(ep, -1)
        mine = counts[rank]  # what each source sends this rank's local experts
        received = mine.repeat(ep)
        local = torch.arange(received.numel()) % mine.numel()
        expert_of_row = torch.repeat_interleave(local, received)
        return Exchange(send=counts.sum(1).tolist(), recv=[int(mine.sum())] * ep,
                        order=torch.argsort(expert_of_row, stable=True), local_counts=mine * ep)


@contextlib.contextmanager
def balanced_routing():
    with mock.patch("tessera.models.moe.layer.expert_counts", _balanced_counts), \
            mock.patch("tessera.ep.experts.plan_exchange", _balanced_exchange), \
            mock.patch("tessera.ep.experts._row_share", _balanced_row_share):
        yield
