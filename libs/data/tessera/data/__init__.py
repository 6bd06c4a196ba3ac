"""Tessera data: tokenizers (Llama 3 tokenizer.model, Hugging Face tokenizer.json, SentencePiece), text datasets, token shards, mixtures and packed,
sharded, exactly resumable (and prefetched) batches."""

from tessera.data.columnar import ColumnarDataset
from tessera.data.datasets import TextDataset, iter_documents, load_dataset
from tessera.data.held_out import HELD_OUT_FRACTION, split_held_out
from tessera.data.hf_tokenizer import hf_tokenizer_config, hf_tokenizer_files, write_hf_tokenizer
from tessera.data.loader import PackedLoader, build_dataloader
from tessera.data.mixture import parse_mixture
from tessera.data.peers import Peers, distributed_peers
from tessera.data.prefetch import Prefetcher
from tessera.data.pretokenize import pretokenize
from tessera.data.sentencepiece_tokenizer import SentencePieceTokenizer
from tessera.data.shards import ShardDataset, open_shards
from tessera.data.tokenizer import (
    LLAMA3_SPECIAL_TOKENS,
    LLAMA3_SPLIT_PATTERN,
    Tokenizer,
    load_tokenizer,
    read_ranks,
    tokenizer_file,
    write_ranks,
)

__all__ = [
    "ColumnarDataset",
    "HELD_OUT_FRACTION",
    "LLAMA3_SPECIAL_TOKENS",
    "LLAMA3_SPLIT_PATTERN",
    "PackedLoader",
    "Peers",
    "Prefetcher",
    "SentencePieceTokenizer",
    "ShardDataset",
    "TextDataset",
    "Tokenizer",
    "build_dataloader",
    "distributed_peers",
    "hf_tokenizer_config",
    "hf_tokenizer_files",
    "iter_documents",
    "load_dataset",
    "load_tokenizer",
    "open_shards",
    "parse_mixture",
    "pretokenize",
    "read_ranks",
    "split_held_out",
    "tokenizer_file",
    "write_hf_tokenizer",
    "write_ranks",
]
