"""Model spec of the GPT-OSS family."""

from tessera.models.gpt_oss import hf_adapter, hf_config
from tessera.models.gpt_oss.args import GptOssArgs
from tessera.models.gpt_oss.flavors import gpt_oss_flavors
from tessera.models.gpt_oss.model import GptOss
from tessera.models.masks import AttentionMask, window_layer
from tessera.models.moe.balance import MOE_STEP_HOOKS
from tessera.models.moe.sharding import moe_tp_plan
from tessera.models.spec import ModelSpec

# The q/k/v projections' biases split with their heads (colwise), wo's stays whole (rowwise adds it
# once); the sinks split with the heads ("local": InnerAttention.tp_shard_dims); the MoE layer as
# tessera.models.moe.sharding lays it out, its experts on the dims GptOssExperts declares.
TP_PLAN = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "norm",
    "layers.*.attention": "block_input",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.attention.inner_attention": "local",
    "layers.*.ffn_norm": "norm",
    **moe_tp_plan("layers.*.moe", shared_experts=False),
    "norm": "norm",
    "output": "vocab_output",
}


def active_params(args: GptOssArgs) -> int:
    """Parameters a token's forward multiplies by or adds: all but the token embedding and the
    routed experts it is not sent to (the output projection counts)."""
    a, moe = args, args.moe
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    attention = a.dim * (q + 2 * kv) + (q + 2 * kv) + q * a.dim + a.dim + a.n_heads
    expert = a.dim * 2 * moe.hidden_dim + 2 * moe.hidden_dim + moe.hidden_dim * a.dim + a.dim
    block = attention + a.dim * moe.n_experts + moe.n_experts + moe.top_k * expert + 2 * a.dim
    return a.n_layers * block + a.dim + a.dim * a.vocab_size


def attention_keys(args: GptOssArgs, seq_len: int) -> int:
    """Keys per query summed over the layers: the whole sequence on full layers (the convention
    of every family: the causal mask not halved), at most ``sliding_window`` on window layers."""
    windowed = len(args.window_layers)
    return (args.n_layers - windowed) * seq_len + windowed * min(args.sliding_window, seq_len)


def flops_per_token(args: GptOssArgs, seq_len: int) -> float:
    """6 * active_params + 12 * n_heads * head_dim * (keys per query, summed over layers)."""
    return 6 * active_params(args) + 12 * args.n_heads * args.head_dim * attention_keys(args, seq_len)


def tp_divisible(args: GptOssArgs) -> dict[str, int]:
    # the routed experts split their hidden features under TP (torchtitan's expert TP)
    return {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "vocab_size": args.vocab_size,
            "moe.hidden_dim": args.moe.hidden_dim}


def attention_kinds(args: GptOssArgs) -> tuple[tuple[AttentionMask, bool], ...]:
    """Every layer has sinks; windows on some."""
    return tuple(dict.fromkeys((window_layer(i, args.sliding_window, args.window_layers), True)
                               for i in range(args.n_layers)))


def _n_experts(args: GptOssArgs) -> int:
    return args.moe.n_experts


gpt_oss_spec = ModelSpec(
    name="gpt_oss",
    flavors=gpt_oss_flavors,
    build=GptOss,
    flops_per_token=flops_per_token,
    tp_plan=TP_PLAN,
    tp_divisible=tp_divisible,
    hf_adapter=hf_adapter,
    hf_config=hf_config,
    step_hooks=MOE_STEP_HOOKS,
    n_experts=_n_experts,
    attention_kinds=attention_kinds,
)
