"""The run's data: datasets and mixtures, the held-out validation split, the training loader
(shuffled, prefetched) and the token exchange between ranks."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from tessera.data import (
    HELD_OUT_FRACTION, Prefetcher, build_dataloader, distributed_peers, load_dataset, parse_mixture, split_held_out,
)
from tessera.trainer.config import user_input
from tessera.trainer.plan import JobPlan


def tokenising_peers():
    """Every rank walks the same token stream: each tokenises a share of the documents and they
    swap the tokens, over gloo (CPU memory) even when training runs on NCCL."""
    return distributed_peers(None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo"))


def _same_source(a: str | None, b: str | None) -> bool:
    """Two dataset sources (None: the embedded corpus) name the same data."""
    return a == b or (a is not None and b is not None and Path(a).resolve() == Path(b).resolve())


def datasets(plan: JobPlan, say: bool) -> tuple[list, tuple[float, ...] | None, object]:
    """The training datasets, their mixture weights (None: one dataset) and the validation set
    (None: validation off). Validating on a training dataset holds its last documents out of
    training (tessera.data.split_held_out); another validation dataset is used whole."""
    config, field = plan.config, plan.config.training.dataset_text_field
    sources, weights = [plan.dataset], None
    if config.training.dataset_mixture:
        sources, weights = zip(*parse_mixture(config.training.dataset_mixture))
    datasets = [load_dataset(source, text_field=field) for source in sources]
    if not config.validation.enable:
        return datasets, weights, None
    shared = [i for i, source in enumerate(sources) if _same_source(source, plan.validation_dataset)]
    if shared:
        note = f"held-out {HELD_OUT_FRACTION:.0%} of {datasets[shared[0]].source}"
        for i in shared:
            datasets[i], validation = split_held_out(datasets[i])
        note += f" ({len(validation)} documents), excluded from training"
    else:
        validation = load_dataset(plan.validation_dataset, text_field=field)
        note = f"{validation.source} ({len(validation)} documents), apart from the training data"
    if say:
        print(f"validation: {note}", flush=True)
    return datasets, weights, validation


def training_loader(plan: JobPlan, datasets: list, weights, tokenizer, dp_rank: int, dp: int, peers):
    """The training batches: one dataset or a mixture, shuffled unless training.shuffle is off,
    prepared ahead by a background thread when training.dataloader.num_workers > 0. That
    thread's exchanges run on a gloo group of their own, apart from the main thread's."""
    training = plan.config.training
    dataset = datasets[0] if weights is None else datasets
    workers = training.dataloader.num_workers
    if workers and peers is not None:
        peers = distributed_peers(dist.new_group(backend="gloo"))
    loader = build_dataloader(
        dataset, tokenizer, training.seq_len, training.local_batch_size, dp_rank, dp, peers=peers, weights=weights,
        seed=plan.seed, shuffle=training.shuffle, shuffle_buffer=training.shuffle_buffer,
    )
    if not workers:
        return loader
    depth = workers * (training.dataloader.prefetch_factor or 2)
    return Prefetcher(loader, depth, pin_memory=training.dataloader.pin_memory and plan.device == "cuda")


def user_batches(loader):
    """The loader's batches; a fault of the data found only while reading it (a text shorter
    than one sequence) is the user's input and reported as such."""
    while True:
        with user_input():
            batch = next(loader)
        yield batch


def finish_loader(loader, training, say: bool) -> None:
    """At the run's end: the mixture's realised shares said, and the prefetch thread stopped
    before the process group goes (collective-safe, see tessera.data.prefetch)."""
    if training.dataset_mixture and say:
        shares = ", ".join(f"{name} {share:.3f}" for name, share in loader.realised_proportions().items())
        print(f"data: realised mixture {shares} (weights {training.dataset_mixture})", flush=True)
    if isinstance(loader, Prefetcher):
        loader.close()


def data_source(plan: JobPlan) -> str:
    training = plan.config.training
    if training.dataset_mixture:
        return "mixture " + ", ".join(training.dataset_mixture)
    return plan.dataset or "the embedded corpus"
