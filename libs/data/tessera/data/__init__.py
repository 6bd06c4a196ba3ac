"""Tessera data: Llama 3 style tokenizer, text datasets and packed, sharded, resumable batches."""

from tessera.data.datasets import TextDataset, load_dataset
from tessera.data.loader import PackedLoader, build_dataloader
from tessera.data.peers import Peers, distributed_peers
from tessera.data.tokenizer import (
    LLAMA3_SPECIAL_TOKENS,
    LLAMA3_SPLIT_PATTERN,
    Tokenizer,
    load_tokenizer,
    read_ranks,
    write_ranks,
)

__all__ = [
    "LLAMA3_SPECIAL_TOKENS",
    "LLAMA3_SPLIT_PATTERN",
    "PackedLoader",
    "Peers",
    "TextDataset",
    "Tokenizer",
    "build_dataloader",
    "distributed_peers",
    "load_dataset",
    "load_tokenizer",
    "read_ranks",
    "write_ranks",
]
