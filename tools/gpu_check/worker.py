"""What runs inside the processes gpu_check launches (one plain process, or torchrun's ranks):
a list of jobs run one after another in one process group, because starting ranks costs more
than these small runs. A job that raises is recorded and the next one runs; rank 0 rewrites the
results file after every job, so a crash or timeout still leaves what finished.

  worker.py JOBS_JSON RESULTS_JSON   (jobs: [{"name", "kind": "train" | "init_stats", "argv"}])
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from tessera.mesh import Meshes, build_meshes, destroy_distributed, device_type, init_distributed
from tessera.trainer.config import load_config
from tessera.trainer.faults import die_with_launcher
from tessera.trainer.parallelize import build_parallel_model
from tessera.trainer.plan import make_plan
from tessera.trainer.step import build_loss
from tessera.trainer.train import train


def train_job(argv: list[str], world_size: int) -> dict:
    """The trainer's own run: per logged step (loss, grad norm)."""
    return {"history": [(h["loss"], h["grad_norm"]) for h in train(load_config(argv)) if "loss" in h]}


def init_stats_job(argv: list[str], world_size: int) -> dict:
    """The trainer's model as built for this layout (on GPU: meta device, initialised after
    sharding) against the same init code run on whole CPU tensors: per-parameter std ratio,
    exact norm weights and buffers, and whether any two shards of a parameter hold equal values
    (every rank drawing the same random stream would make them so)."""
    config = load_config(argv)
    device = device_type()
    plan = make_plan(config, world_size, device)
    meshes = build_meshes(plan.dims, device) if dist.is_initialized() else Meshes.single()
    torch.manual_seed(config.debug.seed)
    model = build_parallel_model(plan, meshes, build_loss(plan)).parts[0]
    intended = plan.spec.build(plan.model_args)  # CPU: whole tensors, the intended statistics
    intended_params, intended_buffers = dict(intended.named_parameters()), dict(intended.named_buffers())
    worst, constant_off, identical, pairs = 0.0, [], [], 0
    for name, param in model.named_parameters():
        full = (param.full_tensor() if isinstance(param, DTensor) else param).detach().float().cpu()
        want = intended_params[name].detach().float()
        if want.std() == 0:  # norm weights: a constant, exactly
            if not torch.equal(full, want):
                constant_off.append(name)
            continue
        worst = max(worst, abs(full.std().item() / want.std().item() - 1))
        for mesh_dim, placement in enumerate(param.placements if isinstance(param, DTensor) else ()):
            if isinstance(placement, Shard):
                chunks = full.chunk(param.device_mesh.size(mesh_dim), dim=placement.dim)
                for i in range(len(chunks)):
                    for j in range(i + 1, len(chunks)):
                        pairs += 1
                        if chunks[i].shape == chunks[j].shape and torch.equal(chunks[i], chunks[j]):
                            identical.append(name)
    buffers_off = [name for name, buffer in model.named_buffers()
                   if name in intended_buffers and not torch.allclose(buffer.cpu(), intended_buffers[name], atol=1e-5)]
    return {"std_worst": worst, "constant_off": constant_off, "buffers_off": buffers_off,
            "identical": sorted(set(identical)), "shard_pairs": pairs}


def ring_kernel_job(argv: list[str], world_size: int) -> dict:
    """torch's ring attention (tessera.cp.RingAttention) on one rank, through the device's flash
    kernel (CUDA: bf16; CPU: fp32) and its backward, against SDPA in fp64: the kernel calls CPU
    CI cannot reach on CUDA. Relative error of the output and of dQ, dK, dV (GQA 2:1)."""
    from tessera.cp import RingAttention

    device = device_type()
    if not dist.is_initialized():  # this job runs alone in its process
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                **({"device_id": torch.device("cuda", 0)} if device == "cuda" else {}))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 256, 64, generator=g) for h in (8, 4, 4))
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ours = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(
        ref[0], ref[1].repeat_interleave(2, 1), ref[2].repeat_interleave(2, 1), is_causal=True)
    got = RingAttention(dist.group.WORLD, "alltoall").attend(*ours)
    grad = torch.randn(want.shape, generator=g)
    want.backward(grad.double())
    got.backward(grad.to(device, dtype))
    rel = lambda a, b: ((a.double().cpu() - b).norm() / b.norm()).item()  # noqa: E731
    return {"errors": [rel(got.detach(), want.detach()), *(rel(o.grad, r.grad) for o, r in zip(ours, ref))]}


def grouped_mm_op_job(argv: list[str], world_size: int) -> dict:
    """tessera.float8's float8 rowwise grouped GEMMs (torch._scaled_grouped_mm: CUDA only) on a
    GroupedExperts module against the same module in bf16: relative error of the output and of
    the input and weight gradients (uneven groups, one empty)."""
    from torch import nn

    from tessera.float8 import GroupedMMOptions, convert_grouped_mm
    from tessera.models.moe import GroupedExperts

    counts = torch.tensor([0, 200, 37, 130, 270, 100, 120, 80], device="cuda")
    x = torch.randn(int(counts.sum()), 256, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    results = []
    for converted in (False, True):
        torch.manual_seed(0)
        experts = GroupedExperts(256, 512, 8).to("cuda", torch.bfloat16)
        experts.init_weights(0.02)
        if converted:
            convert_grouped_mm(nn.ModuleDict({"experts": experts}), GroupedMMOptions("fp8_rowwise"))
        inputs = x.clone().requires_grad_()
        out = experts(inputs, counts)
        out.float().square().sum().backward()
        results.append([t.float() for t in (out.detach(), inputs.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad)])
    return {"errors": [((got - want).norm() / want.norm()).item() for got, want in zip(results[1], results[0])]}


KINDS = {"train": train_job, "init_stats": init_stats_job, "ring_kernel": ring_kernel_job, "grouped_mm_op": grouped_mm_op_job}


def main(jobs_path: str, results_path: str) -> int:
    die_with_launcher()  # a torchrun that gpu_check had to kill takes its ranks along, off the GPU
    jobs = json.loads(Path(jobs_path).read_text())
    info = init_distributed(device_type())
    results = {}
    for job in jobs:
        try:
            results[job["name"]] = KINDS[job["kind"]](job["argv"], info.world_size)
        except Exception as e:  # recorded; the next job still runs
            first_line = (str(e).strip().splitlines() or [""])[0]
            results[job["name"]] = {"error": f"{type(e).__name__}: {first_line}"[:300]}
        if info.rank == 0:
            Path(results_path).write_text(json.dumps(results))
    if dist.is_initialized():
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
