"""Held-out documents: a validation set carved from a training dataset, never trained on.

`split_held_out` keeps the last ceil(fraction * documents) documents of a dataset (in its file
order: the same split on every rank and in every run, found without reading any text or
token) out of the training part. The two parts are datasets like any other, so the training
stream, its shuffling and its resume state (a global position over the training part) work
unchanged. Text datasets and token shards of the same source split alike, as the shards keep
the text's document order.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

from tessera.data.datasets import TextDataset
from tessera.data.columnar import ColumnarDataset
from tessera.data.shards import ShardDataset, documents_between

HELD_OUT_FRACTION = 0.01  # of the documents; at least one

Dataset = Union[TextDataset, ShardDataset, ColumnarDataset, Sequence[str]]


def split_held_out(dataset: Dataset, fraction: float = HELD_OUT_FRACTION) -> tuple[Dataset, Dataset]:
    """(training part, held-out part) of `dataset`: the held-out part is its last
    ceil(fraction * documents) documents, at least one. Each part's `source` says what it is."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"held-out fraction must be within (0, 1), got {fraction!r}")
    n = len(dataset)
    k = math.ceil(n * fraction)
    name = getattr(dataset, "source", "dataset")
    if k >= n:
        raise ValueError(f"dataset {name} has {_documents(n)}: too few to hold out {fraction:.0%} for validation "
                         "and train on the rest")
    training, held_out = f"{name} without its last {_documents(k)} (held out)", f"{name}'s last {_documents(k)} (held out)"
    if isinstance(dataset, ShardDataset):
        return documents_between(dataset, 0, n - k, training), documents_between(dataset, n - k, n, held_out)
    if isinstance(dataset, TextDataset):
        return TextDataset(training, dataset.documents[: n - k]), TextDataset(held_out, dataset.documents[n - k :])
    if isinstance(dataset, ColumnarDataset):
        return dataset.rows(0, n - k, training), dataset.rows(n - k, n, held_out)
    return dataset[: n - k], dataset[n - k :]


def _documents(n: int) -> str:
    return f"{n} document{'' if n == 1 else 's'}"
