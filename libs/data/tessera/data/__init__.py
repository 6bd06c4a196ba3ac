"""Tessera data: byte-level BPE tokenizers (Llama 3 tokenizer.model, Hugging Face tokenizer.json), text datasets, token shards, mixtures and packed,
sharded, exactly resumable (and prefetched) batches."""

from tessera.data.datasets import TextDataset, iter_documents, load_dataset
from tessera.data.held_out import HELD_OUT_FRACTION, split_held_out
from tessera.data.hf_tokenizer import hf_tokenizer_files, write_hf_tokenizer
from tessera.data.loader import PackedLoader, build_dataloader
from tessera.data.mixture import parse_mixture
from tessera.data.parquet import ParquetDataset
from tessera.data.peers import Peers, distributed_peers
from tessera.data.prefetch import Prefetcher
from tessera.data.pretokenize import pretokenize
from tessera.data.shards import ShardDataset, open_shards
from tessera.data.tokenizer import (
    LLAMA3_SPECIAL_TOKENS,
    LLAMA3_SPLIT_PATTERN,
    Tokenizer,
    load_tokenizer,
    read_ranks,
    write_ranks,
)

__all__ = [
    "HELD_OUT_FRACTION",
    "LLAMA3_SPECIAL_TOKENS",
    "LLAMA3_SPLIT_PATTERN",
    "PackedLoader",
    "ParquetDataset",
    "Peers",
    "Prefetcher",
    "ShardDataset",
    "TextDataset",
    "Tokenizer",
    "build_dataloader",
    "distributed_peers",
    "hf_tokenizer_files",
    "iter_documents",
    "load_dataset",
    "load_tokenizer",
    "open_shards",
    "parse_mixture",
    "pretokenize",
    "read_ranks",
    "split_held_out",
    "write_hf_tokenizer",
    "write_ranks",
]
