"""Routed experts: E SwiGLU MLPs run over tokens grouped by expert.

The seam expert parallelism relies on: ``GroupedExperts.forward(x, num_tokens_per_expert)`` takes
the routed tokens sorted by expert, x [N, dim] whose first ``num_tokens_per_expert[0]`` rows go
to expert 0, the next to expert 1, ... (``num_tokens_per_expert`` [E] long, summing to N), and
returns [N, dim] row for row. Weights: w1, w3 [E, hidden, dim] and w2 [E, dim, hidden], each
expert's matrices laid out as ``nn.Linear`` weights (out, in), so Hugging Face's per-expert
``gate_proj``/``up_proj``/``down_proj`` stack into them unchanged. The number of experts is read
from ``w1.shape[0]``, so a module holding a shard of dim 0 (its local experts) works as is.

Low-precision expert GEMMs (tessera.float8.convert_grouped_mm) wrap the weights in a tensor
subclass that takes over ``torch._grouped_mm``: only the grouped-matmul path reaches it (the loop
indexes the weights, which unwraps them), and it needs each expert's group of rows to start at a
multiple of its block, which it sets as the module's ``token_group_alignment``.
"""

import torch
import torch.nn.functional as F
from torch import nn


def grouped_mm_supported(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` serves these operands: bfloat16 (the only dtype its CUDA
    kernel and its meta function take, so compile works), on CUDA from compute capability 9.0 or
    on CPU, with 16-byte aligned rows (dim and hidden multiples of 8)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16 or w1.dtype != torch.bfloat16:
        return False
    if x.device.type == "cuda":
        on_device = torch.cuda.get_device_capability(x.device) >= (9, 0)
    else:
        on_device = x.device.type == "cpu"
    return on_device and x.shape[-1] % 8 == 0 and w1.shape[1] % 8 == 0


def experts_loop(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 w3: torch.Tensor) -> torch.Tensor:
    """Reference path, any device and dtype: one SwiGLU per expert over its slice of rows (reads
    the counts on the host: a device sync on a GPU)."""
    outputs = [
        F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e])
        for e, rows in enumerate(x.split(num_tokens_per_expert.tolist()))
    ]
    return torch.cat(outputs)


def _pad_groups(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, align: int):
    """x with each expert's group of rows starting at a multiple of ``align`` (zero rows between):
    (padded [N + E * align rounded up to a multiple of align, dim] (MXFP8 scales the weight
    gradient's operands over blocks of rows of the whole buffer), end offset of each group
    (int32), row of each x row in padded). Sizes are static and the counts stay on the device."""
    n, experts = x.shape[0], num_tokens_per_expert.shape[0]
    counts = num_tokens_per_expert.long()
    padded_counts = (counts + align - 1) // align * align
    ends = padded_counts.cumsum(0)
    shift = (ends - padded_counts) - (counts.cumsum(0) - counts)  # padded start - unpadded start
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=n)
    rows = torch.arange(n, device=x.device) + shift[expert_of_row]
    padded = x.new_zeros(-(-(n + experts * align) // align) * align, x.shape[1]).index_copy(0, rows, x)
    return padded, ends.to(torch.int32), rows


def experts_grouped_mm(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                       w3: torch.Tensor, align: int = 0) -> torch.Tensor:
    """The experts as three grouped matmuls (``torch._grouped_mm``: x [rows, k] times
    [E, k, n] per group of rows given by end offsets). Groups are padded to 16-byte boundaries,
    which the backward's weight-gradient matmul (grouped along rows) needs, or to ``align`` rows
    where that is more."""
    padded, offsets, rows = _pad_groups(x, num_tokens_per_expert, max(align, 16 // x.element_size()))
    gate = torch._grouped_mm(padded, w1.transpose(-2, -1), offs=offsets)
    up = torch._grouped_mm(padded, w3.transpose(-2, -1), offs=offsets)
    out = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)
    return out[rows]


def run_experts(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor, align: int = 0) -> torch.Tensor:
    """x [N, dim] grouped by expert -> [N, dim] with plain weight tensors (e.g. an expert-parallel
    rank's local shards): grouped matmuls (groups aligned to ``align`` rows) where
    ``grouped_mm_supported``, else the loop."""
    if grouped_mm_supported(x, w1):
        return experts_grouped_mm(x, num_tokens_per_expert, w1, w2, w3, align)
    return experts_loop(x, num_tokens_per_expert, w1, w2, w3)


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

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [N, dim] grouped by expert, num_tokens_per_expert [E] -> [N, dim] (``run_experts``)."""
        return run_experts(x, num_tokens_per_expert, self.w1, self.w2, self.w3, self.token_group_alignment)
