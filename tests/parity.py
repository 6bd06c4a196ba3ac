"""Shared harness of the cross-library parity tests: one shrunk debug Llama trained for K steps
in one process (the reference) and under a parallel layout on spawned gloo ranks.

Data: a fixed random global batch of token windows per step. Data-parallel rank r of d takes
rows r*b .. (r+1)*b-1 of it (b = global batch / d); tensor-parallel ranks of one data-parallel
rank share its rows. With equal local batches, the mean of the dp ranks' losses is the loss of
the global batch, so every layout should reproduce the reference's losses, grad norms and
weights up to floating-point reduction order.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tessera.fsdp import apply_ddp, apply_fsdp, clip_grad_norm_
from tessera.mesh import build_meshes, resolve_parallel_dims
from tessera.mesh.testing import run_on_ranks
from tessera.models import get_model_spec

SPEC = get_model_spec("llama3")
# 8 query / 4 KV heads (grouped-query attention), vocab 256 and FFN width 256 are all divisible
# by a TP degree of 4; head_dim 8.
ARGS = dataclasses.replace(
    SPEC.flavors["debugmodel"], dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=256, max_seq_len=32
)
STEPS, GLOBAL_BATCH, SEQ = 3, 8, 32
LR, MAX_NORM = 1e-3, 0.25  # the grad norms are ~0.5: clipping acts on every step


@dataclasses.dataclass(frozen=True)
class Layout:
    """One parallel configuration. ``data_parallel``: "fsdp" (HSDP when dp_replicate > 1),
    "ddp", or None (the dp degrees must then be 1)."""

    dp_shard: int = 1
    dp_replicate: int = 1
    tp: int = 1
    data_parallel: str | None = "fsdp"
    reshard_after_forward: str = "default"
    cpu_offload: bool = False
    param_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = True
    loss_parallel: bool = False
    micro_batches: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_shard * self.dp_replicate * self.tp


def build_model(args=ARGS) -> torch.nn.Module:
    torch.manual_seed(0)  # construction initialises the weights
    return SPEC.build(args)


def global_batches() -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), each [STEPS, GLOBAL_BATCH, SEQ]: labels are the inputs shifted by one."""
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(0, ARGS.vocab_size, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=g)
    return windows[..., :-1], windows[..., 1:]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss_context(loss_parallel: bool):
    if not loss_parallel:
        return contextlib.nullcontext()
    from tessera.tp import loss_parallel_context  # imported here: only the TP tests need tessera.tp

    return loss_parallel_context(True)


def train(model, *, dp_rank=0, dp_size=1, dp_group=None, loss_parallel=False, micro_batches=1) -> dict:
    """K AdamW steps with clipping. Returns per-step loss (mean over dp ranks) and grad norm
    (before clipping, from tessera.fsdp.clip_grad_norm_) and the full parameters."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    inputs, labels = global_batches()
    local = GLOBAL_BATCH // dp_size
    losses, norms = [], []
    for step in range(STEPS):
        rows = slice(dp_rank * local, (dp_rank + 1) * local)
        step_loss = torch.zeros(())
        for x, y in zip(inputs[step, rows].chunk(micro_batches), labels[step, rows].chunk(micro_batches)):
            logits = model(x)
            with _loss_context(loss_parallel):
                # loss scaled so that micro-batch gradients add up to the gradient of the mean
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / micro_batches
                loss.backward()
            step_loss += _full(loss).detach()
        norms.append(clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        if dp_group is not None:
            dist.all_reduce(step_loss, group=dp_group)
        losses.append(step_loss.item() / dp_size)
    # full_tensor() is a collective: every rank gathers
    params = {name: _full(p).detach().float() for name, p in model.named_parameters()}
    return {"loss": losses, "norm": norms, "params": params}


def reference() -> dict:
    return train(build_model())


def clipping_reference() -> dict:
    """reference(), checked to clip on every step, so the comparisons cover clipping too."""
    result = reference()
    assert min(result["norm"]) > MAX_NORM
    return result


def _dp_mesh(meshes):
    """FSDP's mesh: 2-D (dp_replicate, dp_shard) for HSDP, else the 1-D shard (or dp) mesh."""
    if "dp_replicate" in meshes and "dp_shard" in meshes:
        return meshes["world"]["dp_replicate", "dp_shard"]
    return meshes["dp_shard"] if "dp_shard" in meshes else meshes["dp"]


def _run_layout(layout: Layout) -> dict:
    dims = resolve_parallel_dims(dist.get_world_size(), dp_replicate=layout.dp_replicate,
                                 dp_shard=layout.dp_shard, tp=layout.tp)
    meshes = build_meshes(dims, "cpu")
    model = build_model()
    if layout.tp > 1:
        from tessera.tp import apply_tp  # imported here: only the TP tests need tessera.tp

        apply_tp(model, meshes["tp"], SPEC.tp_plan, sequence_parallel=layout.sequence_parallel,
                 loss_parallel=layout.loss_parallel)
    dp = meshes.get("dp")
    if layout.data_parallel == "fsdp":
        apply_fsdp(model, _dp_mesh(meshes), param_dtype=layout.param_dtype,
                   reshard_after_forward=layout.reshard_after_forward, cpu_offload=layout.cpu_offload)
    elif layout.data_parallel == "ddp":
        apply_ddp(model, dp)
    return train(
        model,
        dp_rank=dp.get_local_rank() if dp is not None else 0,
        dp_size=dp.size() if dp is not None else 1,
        dp_group=dp.get_group() if dp is not None else None,
        loss_parallel=layout.loss_parallel,
        micro_batches=layout.micro_batches,
    )


def _run_layouts(rank: int, world_size: int, layouts: dict[str, Layout]) -> dict[str, dict]:
    results = {}
    for name, layout in layouts.items():
        result = _run_layout(layout)
        if rank != 0:
            del result["params"]  # identical on every rank; rank 0's are enough
        results[name] = result
    return results


def run_layouts(layouts: dict[str, Layout]) -> dict[str, list[dict]]:
    """Runs several layouts of one world size in a single spawn (starting ranks costs seconds
    each). Returns {name: per-rank results}; only rank 0's result holds "params"."""
    sizes = {layout.world_size for layout in layouts.values()}
    if len(sizes) != 1:
        raise ValueError(f"layouts of one run need one world size, got {sorted(sizes)}")
    per_rank = run_on_ranks(_run_layouts, sizes.pop(), layouts)
    return {name: [ranks[name] for ranks in per_rank] for name in layouts}


def max_diffs(result: dict, ref: dict) -> tuple[float, float, float]:
    """(max rel loss diff, max rel grad-norm diff, max abs param diff or nan without params)."""
    rel = lambda a, b: max(abs(x - y) / abs(y) for x, y in zip(a, b))  # noqa: E731
    param = float("nan")
    if "params" in result:
        param = max((result["params"][n] - v).abs().max().item() for n, v in ref["params"].items())
    return rel(result["loss"], ref["loss"]), rel(result["norm"], ref["norm"]), param
