"""Model specs of the Llama 2 and Llama 3.x families."""

from tessera.models.llama import hf_adapter, hf_config
from tessera.models.llama.args import ModelArgs
from tessera.models.llama.flavors import llama2_flavors, llama3_flavors
from tessera.models.llama.model import Transformer
from tessera.models.spec import ModelSpec

TP_PLAN = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "norm",
    "layers.*.attention": "block_input",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "norm",
    "layers.*.feed_forward": "block_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.feed_forward.w3": "colwise",
    "norm": "norm",
    "output": "vocab_output",
}


def non_embedding_params(args: ModelArgs) -> int:
    """Parameters doing matmuls or norms per token: all but the token embedding. The output
    projection counts even when tied to the embedding, since its matmul still runs."""
    q_dim, kv_dim = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    attention = args.dim * (2 * q_dim + 2 * kv_dim)
    feed_forward = 3 * args.dim * args.ffn_hidden_dim
    norms = 2 * args.dim
    return args.n_layers * (attention + feed_forward + norms) + args.dim + args.dim * args.vocab_size


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N + 12 * n_layers * n_heads * head_dim * seq_len.

    N = ``non_embedding_params(args)``: each weight costs 2 FLOPs per token forward
    (multiply-add) and 4 backward (input and weight gradients). The second term is the
    attention matmuls (QK^T and scores @ V, 2 * 2 FLOPs per head feature and key, times 3
    for forward + backward), counted over the full sequence, ignoring the causal mask.
    """
    return 6 * non_embedding_params(args) + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def tp_divisible(args: ModelArgs) -> dict[str, int]:
    return {
        "n_heads": args.n_heads,
        "n_kv_heads": args.kv_heads,
        "vocab_size": args.vocab_size,
        "ffn_hidden_dim": args.ffn_hidden_dim,
    }


def _llama_spec(name: str, flavors: dict[str, ModelArgs]) -> ModelSpec:
    return ModelSpec(
        name=name,
        flavors=flavors,
        build=Transformer,
        flops_per_token=flops_per_token,
        tp_plan=TP_PLAN,
        tp_divisible=tp_divisible,
        hf_adapter=hf_adapter,
        hf_config=hf_config,
    )


llama2_spec = _llama_spec("llama2", llama2_flavors)
llama3_spec = _llama_spec("llama3", llama3_flavors)
