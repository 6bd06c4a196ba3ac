"""Model spec of the Qwen3 family (dense and MoE flavors)."""

from tessera.models.moe import MoEArgs
from tessera.models.qwen3 import hf_adapter, hf_config
from tessera.models.qwen3.args import Qwen3Args
from tessera.models.qwen3.flavors import qwen3_flavors
from tessera.models.qwen3.model import Qwen3
from tessera.models.moe.balance import MOE_STEP_HOOKS
from tessera.models.moe.sharding import moe_tp_plan
from tessera.models.masks import window_layer
from tessera.models.spec import ModelSpec

# Patterns for every flavor: a dense flavor's blocks have feed_forward, an MoE flavor's moe.
# "head_norm" (q_norm/k_norm: one weight over head_dim applied to the local heads, its gradient
# summed over the TP ranks) is tessera.tp's role; the MoE layers' entries are the family's own
# (tessera.models.moe.sharding).
TP_PLAN = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "norm",
    "layers.*.attention": "block_input",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.q_norm": "head_norm",
    "layers.*.attention.k_norm": "head_norm",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "norm",
    "layers.*.feed_forward": "block_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.feed_forward.w3": "colwise",
    **moe_tp_plan("layers.*.moe", shared_experts=False),  # Qwen3's MoE has no shared experts
    "norm": "norm",
    "output": "vocab_output",
}


def _ffn_params(dim: int, hidden_dim: int, moe: MoEArgs | None) -> int:
    if moe is None:
        return 3 * dim * hidden_dim
    return dim * moe.n_experts + (moe.n_shared_experts + moe.top_k) * 3 * dim * moe.hidden_dim


def active_params(args: Qwen3Args) -> int:
    """Parameters a token's forward multiplies by: all but the token embedding and the routed
    experts it is not sent to (the output projection counts even when tied)."""
    a = args
    attention = a.dim * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim + a.n_heads * a.head_dim * a.dim + 2 * a.head_dim
    block = attention + _ffn_params(a.dim, a.hidden_dim, a.moe) + 2 * a.dim
    return a.n_layers * block + a.dim + a.dim * a.vocab_size


def flops_per_token(args: Qwen3Args, seq_len: int) -> float:
    """6 * active_params + 12 * n_heads * head_dim * (keys a query sees, summed over the layers),
    as Llama's with only the routed experts a token uses counted: seq_len keys (torchtitan's
    convention, causality ignored), a window layer's at most sliding_window."""
    keys = sum(min(seq_len, args.sliding_window) if i in args.window_layers else seq_len for i in range(args.n_layers))
    return 6 * active_params(args) + 12 * args.n_heads * args.head_dim * keys


def tp_divisible(args: Qwen3Args) -> dict[str, int]:
    quantities = {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "vocab_size": args.vocab_size}
    if args.moe is None:
        quantities["hidden_dim"] = args.hidden_dim
    else:  # the routed experts split their hidden features under TP (torchtitan's expert TP)
        quantities["moe.hidden_dim"] = args.moe.hidden_dim
    return quantities


def _n_experts(args) -> int:
    return args.moe.n_experts if args.moe is not None else 0


qwen3_spec = ModelSpec(
    name="qwen3",
    flavors=qwen3_flavors,
    build=Qwen3,
    flops_per_token=flops_per_token,
    tp_plan=TP_PLAN,
    tp_divisible=tp_divisible,
    hf_adapter=hf_adapter,
    hf_config=hf_config,
    step_hooks=MOE_STEP_HOOKS,
    n_experts=_n_experts,
    attention_kinds=lambda args: tuple(dict.fromkeys((window_layer(i, args.sliding_window, args.window_layers), False)
                                                    for i in range(args.n_layers))),
)
