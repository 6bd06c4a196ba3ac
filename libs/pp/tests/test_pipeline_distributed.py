"""Every schedule, and PP x FSDP, against the same model trained in one process (same seed, same
global batch): losses, gradient norms, final parameters and buffers agree to fp32 rounding (1e-5).
Each also with a model whose last stage applies the embedding again (shared_with_last_stage): its
copies' gradients sum (over accumulated passes too), the norm counts the weight once, and the
copies stay one weight."""

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


class SharedLM(TinyLM):
    """TinyLM whose output adds the tied projection by the embedding, which the last stage so
    holds a copy of."""

    shared_with_last_stage = ("tok_embeddings",)

    def forward(self, tokens):
        h = tokens if tokens.is_floating_point() else self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        if self.output is None:
            return h
        h = self.norm(h)
        return self.output(h) + F.linear(h, self.tok_embeddings.weight)


MODELS = {"untied": TinyLM, "shared": SharedLM}


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def reference(model_cls, passes=1):
    """``passes``: each step's batch in that many parts, their gradients accumulated."""
    torch.manual_seed(0)
    model = model_cls()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, norms = [], []
    for batch in batches():
        total = 0.0
        for part in batch.chunk(passes):
            loss = loss_fn(model(part[:, :-1]), part[:, 1:])
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
        opt.step()
        opt.zero_grad()
        losses.append(total / passes)
    return losses, norms, {k: v.detach() for k, v in model.state_dict().items()}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(mesh, model_cls, schedule, dp_rank=0, dp=1, fsdp_mesh=None, reshard=False, csv_file=None, passes=1):
    torch.manual_seed(0)
    model = model_cls()
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
    copies = {id(p) for p in pipe.shared_copies()}
    opt = torch.optim.SGD(params, lr=0.5)
    losses, norms = [], []
    for batch in batches():
        local = batch.chunk(dp)[dp_rank]
        total = torch.zeros(())
        for part in local.chunk(passes):  # gradients accumulate over the passes, a shared module's too
            loss = pipe.run(part[:, :-1], part[:, 1:])
            # the loss lives on the last stage's rank; every rank reports the global mean
            total += 0 if loss is None else loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / dp / passes)
        squares = sum((_full(p.grad) ** 2).sum() for p in params if p.grad is not None and id(p) not in copies)
        squares = torch.as_tensor(squares, dtype=torch.float32)
        dist.all_reduce(squares, group=mesh.get_group())  # full grads: each stage's own, once per pp rank
        norms.append(squares.sqrt().item())
        opt.step()
        opt.zero_grad()
    state = {}
    for part in pipe.parts:  # a shared module's copies are one weight: the last stage's must equal the first's
        for key, value in part.state_dict().items():
            if key in state:
                torch.testing.assert_close(_full(value), state[key], rtol=0, atol=0, msg=key)
            state[key] = _full(value).detach()
    if fsdp_mesh is not None:  # each data-parallel rank saw its share of the batch
        for key in [k for k in state if k.endswith(".seen")]:
            dist.all_reduce(state[key], group=fsdp_mesh.get_group())
    return losses, norms, state


def _every_schedule(rank, world_size, csv_file):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    results = {(model, name): _train(mesh, cls, name) for model, cls in MODELS.items() for name in SCHEDULES}
    results["untied", "csv"] = _train(mesh, TinyLM, "1F1B", csv_file=csv_file)
    results["shared", "1F1B", 2] = _train(mesh, SharedLM, "1F1B", passes=2)
    return results


def _with_fsdp(rank, world_size, reshard):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    dp_rank = mesh["dp_shard"].get_local_rank()
    return {(model, name): _train(mesh["pp"], cls, name, dp_rank, 2, mesh["dp_shard"], reshard)
            for model, cls in MODELS.items() for name in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")}


def _check(results_by_rank):
    expected = {}
    for name in results_by_rank[0]:
        model, passes = name[0], name[2] if len(name) > 2 else 1
        if (model, passes) not in expected:
            expected[model, passes] = reference(MODELS[model], passes)
        ref_losses, ref_norms, ref_state = expected[model, passes]
        state = {}
        for rank_results in results_by_rank:
            losses, norms, part_state = rank_results[name]
            assert losses == pytest.approx(ref_losses, rel=TOL), name
            assert norms == pytest.approx(ref_norms, rel=TOL), name
            for key, value in part_state.items():  # the two pp ranks' copies of a shared module: one weight
                if key in state:
                    torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=f"{name} {key}")
                state[key] = value
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
    _check(run_on_ranks(_every_schedule, 2, str(csv_file)))


def test_pp2_x_fsdp2_matches_one_process_without_reshard_after_forward():
    _check(run_on_ranks(_with_fsdp, 4, False))
