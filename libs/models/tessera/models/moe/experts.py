"""Routed experts: E SwiGLU MLPs run over tokens grouped by expert.

The seam expert parallelism relies on: ``GroupedExperts.forward(x, num_tokens_per_expert)`` takes
the routed tokens sorted by expert, x [N, dim] whose first ``num_tokens_per_expert[0]`` rows go
to expert 0, the next to expert 1, ... (``num_tokens_per_expert`` [E] long, summing to N), and
returns [N, dim] row for row; ``num_tokens_per_expert`` None means E equal groups (a static
capacity per expert, the MoE layer's capacity-factor dispatch). Weights: w1, w3 [E, hidden, dim]
and w2 [E, dim, hidden], each expert's matrices laid out as ``nn.Linear`` weights (out, in), so
Hugging Face's per-expert ``gate_proj``/``up_proj``/``down_proj`` stack into them unchanged. The
number of experts is read from ``w1.shape[0]``, so a module holding a shard of dim 0 (its local
experts) works as is.

No loop over experts on any device and in any dtype: counts given, grouped matmuls
(``grouped_mm``: torch's kernel, compiled too for every dtype; on CPU over the rows as they are,
on a GPU over groups padded to 16-byte offsets); equal groups, batched matmuls. Neither reads
the counts on the host.

Low-precision expert GEMMs (tessera.float8.convert_grouped_mm) wrap the weights in a tensor
subclass that takes over ``torch._grouped_mm``: only grouped matmuls reach it (equal groups take
them too when it is there), and it needs each expert's group of rows to start at a multiple of
its block, which it sets as the module's ``token_group_alignment``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.moe.grouped_mm import grouped_mm


def row_alignment(x: torch.Tensor, align: int = 0) -> int:
    """Rows each expert's group must start at a multiple of: ``align`` (a low-precision recipe's
    block, 0 for none), and on a GPU 16 bytes (the grouped weight-gradient GEMM's operands);
    CPU's grouped matmul takes any offsets."""
    if x.device.type != "cpu":
        align = max(align, 16 // x.element_size())
    return max(align, 1)


def pad_groups(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, align: int):
    """x with each expert's group of rows starting at a multiple of ``align`` rows (zero rows
    between): (padded [N + E * align rounded up to a multiple of align, dim] (MXFP8 scales the
    weight gradient's operands over blocks of rows of the whole buffer), end offset of each group
    (int32), row of each x row in padded). With ``align`` 1, x itself and None: no copy. Sizes
    are static and the counts stay on the device."""
    counts = num_tokens_per_expert.long()
    if align == 1:
        return x, counts.cumsum(0).to(torch.int32), None
    n, experts = x.shape[0], counts.shape[0]
    padded_counts = (counts + align - 1) // align * align
    ends = padded_counts.cumsum(0)
    shift = (ends - padded_counts) - (counts.cumsum(0) - counts)  # padded start - unpadded start
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=n)
    rows = torch.arange(n, device=x.device) + shift[expert_of_row]
    padded = x.new_zeros(-(-(n + experts * align) // align) * align, x.shape[1]).index_copy(0, rows, x)
    return padded, ends.to(torch.int32), rows


def equal_offsets(n_rows: int, n_experts: int, device: torch.device) -> torch.Tensor:
    """End offsets (int32) of ``n_experts`` equal groups of ``n_rows`` rows in all."""
    return torch.arange(1, n_experts + 1, device=device, dtype=torch.int32) * (n_rows // n_experts)


def swiglu_grouped_mm(x: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      w3: torch.Tensor) -> torch.Tensor:
    """The experts as three grouped matmuls (``tessera.models.moe.grouped_mm``: x [rows, k] times
    [E, k, n] per group of rows given by end offsets)."""
    gate = grouped_mm(x, w1.transpose(-2, -1), offsets)
    up = grouped_mm(x, w3.transpose(-2, -1), offsets)
    return grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offsets)


def experts_grouped_mm(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                       w3: torch.Tensor, align: int = 0) -> torch.Tensor:
    """x [N, dim] grouped by expert (any counts) -> [N, dim]: grouped matmuls over
    ``pad_groups``' layout where the device or ``align`` needs one, else over x as it is."""
    padded, offsets, rows = pad_groups(x, num_tokens_per_expert, row_alignment(x, align))
    out = swiglu_grouped_mm(padded, offsets, w1, w2, w3)
    return out if rows is None else out[rows]


def experts_bmm(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """x [E * C, dim]: C rows for each expert (a static capacity, empty slots zero) -> [E * C, dim],
    as three batched matmuls over [E, C, dim]: static shapes, any dtype and device."""
    rows = x.view(w1.shape[0], -1, x.shape[-1])
    hidden = F.silu(torch.bmm(rows, w1.transpose(-2, -1))) * torch.bmm(rows, w3.transpose(-2, -1))
    return torch.bmm(hidden, w2.transpose(-2, -1)).view(x.shape)


def run_experts(x: torch.Tensor, num_tokens_per_expert: torch.Tensor | None, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor, align: int = 0) -> torch.Tensor:
    """x [N, dim] grouped by expert -> [N, dim] with plain weight tensors (e.g. an expert-parallel
    rank's local shards). Counts given (dropless): grouped matmuls, groups aligned to ``align``
    rows. None: x holds E equal groups (a capacity per expert): batched matmuls, or grouped ones
    with static offsets where a low-precision recipe (``align`` > 0) takes over the grouped GEMM."""
    if num_tokens_per_expert is not None:
        return experts_grouped_mm(x, num_tokens_per_expert, w1, w2, w3, align)
    if align:
        return swiglu_grouped_mm(x, equal_offsets(x.shape[0], w1.shape[0], x.device), w1, w2, w3)
    return experts_bmm(x, w1, w2, w3)


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU MLPs, ``w2(silu(w1 x) * w3 x)`` each, as stacked weights."""

    token_group_alignment = 0  # rows each expert's group starts at a multiple of (module docstring)
    # tensor parallel splits every expert on its hidden features (torchtitan's expert TP):
    # w1/w3's output rows, w2's input columns (tessera.tp's LocalShards reads this)
    tp_shard_dims = {"w1": 1, "w2": 2, "w3": 1}

    def __init__(self, dim: int, hidden_dim: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor | None) -> torch.Tensor:
        """x [N, dim] grouped by expert, num_tokens_per_expert [E] (or None: E equal groups) ->
        [N, dim] (``run_experts``)."""
        return run_experts(x, num_tokens_per_expert, self.w1, self.w2, self.w3, self.token_group_alignment)
