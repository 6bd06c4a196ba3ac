"""Every schedule, and PP x FSDP, against the same model trained in one process (same seed, same
global batch): losses, gradient norms, final parameters and buffers agree to fp32 rounding (1e-5)."""

import csv

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tessera.mesh.testing import run_on_ranks
from tessera.pp import SCHEDULES, build_pipeline, even_split, model_parts_names, stage_count

VOCAB, DIM, LAYERS, BATCH, SEQ, STEPS, MICROBATCHES = 32, 16, 4, 8, 6, 2, 4
TOL = 1e-5


class Block(nn.Module):
    """``seen`` sums the block's inputs, as running statistics or an MoE router's token counts
    update a buffer in forward: it must end as in one process, whatever the schedule runs."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.ff = nn.Linear(DIM, DIM)
        self.register_buffer("seen", torch.zeros(DIM))

    def forward(self, x):
        with torch.no_grad():
            self.seen += x.sum((0, 1))
        return x + self.ff(torch.tanh(self.norm(x)))


class TinyLM(nn.Module):
    """Follows tessera.pp's conventions: inputs, a `layers` ModuleDict, outputs; None-tolerant."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def reference():
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, norms = [], []
    for batch in batches():
        loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach() for k, v in model.state_dict().items()}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(mesh, schedule, dp_rank=0, dp=1, fsdp_mesh=None, reshard=False, csv_file=None):
    torch.manual_seed(0)
    model = TinyLM()
    inputs, n_layers, outputs = model_parts_names(model)
    parts = even_split(stage_count(mesh.size(), schedule, n_layers), n_layers, inputs=inputs, outputs=outputs)

    def parallelize(part):
        if fsdp_mesh is not None:
            for block in part.layers.values():
                fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=reshard)
            fully_shard(part, mesh=fsdp_mesh, reshard_after_forward=reshard)
        return part

    pipe = build_pipeline(model, mesh, "cpu", parts=parts, schedule=schedule, n_microbatches=MICROBATCHES,
                          loss_fn=loss_fn, parallelize=parallelize, schedule_csv=csv_file)
    params = [p for part in pipe.parts for p in part.parameters()]
    opt = torch.optim.SGD(params, lr=0.5)
    losses, norms = [], []
    for batch in batches():
        local = batch.chunk(dp)[dp_rank]
        loss = pipe.run(local[:, :-1], local[:, 1:])
        # the loss lives on the last stage's rank; every rank reports the global mean
        total = torch.zeros(()) if loss is None else loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dp)
        squares = sum((_full(p.grad) ** 2).sum() for p in params if p.grad is not None)
        squares = torch.as_tensor(squares, dtype=torch.float32)
        dist.all_reduce(squares, group=mesh.get_group())  # full grads: each stage's own, once per pp rank
        norms.append(squares.sqrt().item())
        opt.step()
        opt.zero_grad()
    state = {k: _full(v).detach() for part in pipe.parts for k, v in part.state_dict().items()}
    if fsdp_mesh is not None:  # each data-parallel rank saw its share of the batch
        for key in [k for k in state if k.endswith(".seen")]:
            dist.all_reduce(state[key], group=fsdp_mesh.get_group())
    return losses, norms, state


def _every_schedule(rank, world_size, csv_file):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    results = {name: _train(mesh, name) for name in SCHEDULES}
    results["csv"] = _train(mesh, "1F1B", csv_file=csv_file)
    return results


def _with_fsdp(rank, world_size, reshard):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    dp_rank = mesh["dp_shard"].get_local_rank()
    return {name: _train(mesh["pp"], name, dp_rank, 2, mesh["dp_shard"], reshard)
            for name in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")}


def _check(results_by_rank, expected):
    ref_losses, ref_norms, ref_state = expected
    names = results_by_rank[0].keys()
    for name in names:
        state = {}
        for rank_results in results_by_rank:
            losses, norms, part_state = rank_results[name]
            assert losses == pytest.approx(ref_losses, rel=TOL), name
            assert norms == pytest.approx(ref_norms, rel=TOL), name
            state.update(part_state)
        assert state.keys() == ref_state.keys(), name  # names survive the cut
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value, rtol=TOL, atol=TOL, msg=f"{name} {key}")


def test_every_schedule_matches_one_process(tmp_path):
    # a hand-written 1F1B for 2 ranks, 4 micro-batches (F: forward, B: full backward)
    rows = [["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
            ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]]
    csv_file = tmp_path / "1f1b.csv"
    with open(csv_file, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    _check(run_on_ranks(_every_schedule, 2, str(csv_file)), reference())


def test_pp2_x_fsdp2_matches_one_process_without_reshard_after_forward():
    _check(run_on_ranks(_with_fsdp, 4, False), reference())
