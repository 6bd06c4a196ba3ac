"""The measured side of the accuracy checks: a real training step of the trainer on CPU (its own
model build, parallelism, step and AdamW), with the same live-bytes counter the estimate uses, and
the bytes of the real sharded parameters, gradients and optimizer states of this rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tessera.mesh import Meshes, build_meshes
from tessera.trainer.config import load_config
from tessera.trainer.parallelize import build_parallel_model
from tessera.trainer.plan import make_plan
from tessera.trainer.step import build_loss, make_train_step, step_functions
from tessera.trainer.optimizer import build_optimizers

from live_bytes import LiveBytes
from traced import NO_BOS


def local_bytes(tensors) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's local shard)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def measure_rank(rank: int, world_size: int, argv: list[str]) -> dict[str, int]:
    """Two real steps of the config `argv` on this rank (run_on_ranks' signature); the second
    step's peak live bytes (optimizer state already there), and the real bytes of this rank's
    parameters, gradients (as the optimizers step them: the step drops them after) and optimizer state."""
    plan = make_plan(load_config(argv), world_size, "cpu")
    torch.manual_seed(0)
    with LiveBytes() as live:
        meshes = build_meshes(plan.dims, "cpu") if dist.is_initialized() else Meshes.single()
        loss_fn = build_loss(plan)
        model = build_parallel_model(plan, meshes, loss_fn)
        optimizers = build_optimizers(model.parts, plan.optimizer)
        forward_backward = step_functions(model.parts, model.pipeline, loss_fn, plan, meshes, bos_id=NO_BOS)[0]
        step = make_train_step(model.parts, optimizers.all, optimizers.scheduler, forward_backward, plan, pp_mesh=meshes.pp)
        grads = {}  # optimizer -> the bytes of the gradients it steps
        for optimizer in optimizers.all:
            optimizer.register_step_pre_hook(lambda o, args, kwargs: grads.update({o: local_bytes(
                p.grad for group in o.param_groups for p in group["params"] if p.grad is not None)}))
        vocab, batch = plan.model_args.vocab_size, plan.batch

        def batches():
            while True:
                yield torch.randint(vocab, (batch.local, batch.seq_len)), torch.randint(vocab, (batch.local, batch.seq_len))

        data = batches()
        step(data)
        live.reset_peak()
        step(data)
        peak = live.peak
    return {
        "params": local_bytes(p for part in model.parts for p in part.parameters()),
        "grads": sum(grads.values()),
        "optimizer": local_bytes(v for o in optimizers.all for s in o.state.values() for v in s.values()),
        "peak": peak,
    }
