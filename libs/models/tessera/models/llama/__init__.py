"""Llama 2 and Llama 3/3.1/3.2 decoder models."""

from tessera.models.llama.args import ModelArgs, RopeScaling
from tessera.models.llama.flavors import llama2_flavors, llama3_flavors
from tessera.models.llama.model import Attention, FeedForward, Transformer, TransformerBlock
from tessera.models.llama.rope import apply_rotary_emb, precompute_freqs_cis, rope_frequencies
from tessera.models.llama.spec import flops_per_token, llama2_spec, llama3_spec, non_embedding_params, tp_divisible

__all__ = [
    "Attention",
    "FeedForward",
    "ModelArgs",
    "RopeScaling",
    "Transformer",
    "TransformerBlock",
    "apply_rotary_emb",
    "flops_per_token",
    "llama2_flavors",
    "llama2_spec",
    "llama3_flavors",
    "llama3_spec",
    "non_embedding_params",
    "precompute_freqs_cis",
    "rope_frequencies",
    "tp_divisible",
]
