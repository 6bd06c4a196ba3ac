"""Validation: the mean loss over validation.steps batches from the start of the validation set
(read again from its start where it holds fewer, as torchtitan's loader re-loops), forward only,
on every rank."""

from __future__ import annotations

import torch

import torch.distributed as dist

from tessera.data import Prefetcher, build_dataloader, distributed_peers
from tessera.trainer.config import user_input
from tessera.trainer.metrics import all_reduce_scalar
from tessera.trainer.parallelize import ParallelModel
from tessera.trainer.plan import JobPlan, validation_shape


@torch.no_grad()
def validate(model: ParallelModel, loss, dataset, plan: JobPlan, tokenizer, dp_rank: int, loss_mesh, peers) -> float:
    """Mean loss over validation.steps batches from the start of the validation set; `loss`:
    (inputs, labels) -> a batch's mean loss (step.evaluation_loss)."""
    config, section = plan.config, plan.config.validation
    batch_size, seq_len = validation_shape(config)
    loader = build_dataloader(dataset, tokenizer, seq_len, batch_size, dp_rank, plan.dims.dp,
                              infinite=section.steps != -1, peers=peers)
    workers = section.dataloader.num_workers
    if workers:
        loader = Prefetcher(loader, workers * (section.dataloader.prefetch_factor or 2),
                            pin_memory=section.dataloader.pin_memory and plan.device == "cuda")
    for part in model.parts:
        part.eval()
    total, count = torch.zeros(()), 0
    for inputs, labels in loader:
        total += loss(inputs.to(plan.device), labels.to(plan.device)).cpu()
        count += 1
        if count == section.steps:
            break
    for part in model.parts:
        part.train()
    if isinstance(loader, Prefetcher):
        loader.close()
    if count == 0:
        raise ValueError(f"validation dataset {dataset.source} is too small for one batch")
    return all_reduce_scalar(total / count, loss_mesh)


def validation_runner(model: ParallelModel, loss, dataset, plan: JobPlan, tokenizer, dp_rank: int, loss_mesh, peers,
                      logger, say: bool):
    """step -> {"step", "validation_loss"}: validates, prints and logs the loss. A prefetching
    validation loader exchanges tokens on a gloo group of its own, made here once."""
    if plan.config.validation.dataloader.num_workers and peers is not None:
        peers = distributed_peers(dist.new_group(backend="gloo"))

    def run(step: int) -> dict:
        with user_input():
            val_loss = validate(model, loss, dataset, plan, tokenizer, dp_rank, loss_mesh, peers)
        if say:
            print(f"validate step {step}: loss {val_loss:.4f}", flush=True)
        logger.scalars(step, {"validation_loss": val_loss})
        return {"step": step, "validation_loss": val_loss}

    return run
