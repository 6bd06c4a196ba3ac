"""Model spec of the Llama 4 text family."""

from tessera.models.llama import spec as llama_spec
from tessera.models.llama4 import hf_adapter, hf_config
from tessera.models.llama4.args import Llama4Args
from tessera.models.llama4.flavors import llama4_flavors
from tessera.models.llama4.model import Llama4, layer_mask
from tessera.models.moe.balance import MOE_STEP_HOOKS
from tessera.models.moe.sharding import moe_tp_plan
from tessera.models.spec import ModelSpec

# Llama's roles plus the MoE layers' own (tessera.models.moe.sharding); the q/k norm has no
# weight and works per head, so it needs no entry.
TP_PLAN = {**llama_spec.TP_PLAN, **moe_tp_plan("layers.*.moe")}


def active_params(args: Llama4Args) -> int:
    """Parameters a token's forward multiplies by: all but the token embedding and the routed
    experts it is not sent to (the output projection counts even when tied)."""
    a, moe = args, args.moe
    attention = a.dim * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim + a.n_heads * a.head_dim * a.dim
    moe_ffn = a.dim * moe.n_experts + (moe.n_shared_experts + moe.top_k) * 3 * a.dim * moe.hidden_dim
    n_moe = len(a.moe_layers)
    ffn = n_moe * moe_ffn + (a.n_layers - n_moe) * 3 * a.dim * a.hidden_dim
    return a.n_layers * (attention + 2 * a.dim) + ffn + a.dim + a.dim * a.vocab_size


def flops_per_token(args: Llama4Args, seq_len: int) -> float:
    """6 * active_params + 12 * n_heads * head_dim * (keys a query sees, summed over the layers):
    seq_len keys on a global layer (torchtitan's convention, causality ignored), at most
    attention_chunk_size on a chunked one."""
    chunk = args.attention_chunk_size
    keys = sum(min(seq_len, chunk) if i in args.chunked_layers else seq_len for i in range(args.n_layers))
    return 6 * active_params(args) + 12 * args.n_heads * args.head_dim * keys


def tp_divisible(args: Llama4Args) -> dict[str, int]:
    # the routed experts split their hidden features under TP; the shared expert is as wide
    return {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "vocab_size": args.vocab_size,
            "hidden_dim": args.hidden_dim, "moe.hidden_dim": args.moe.hidden_dim}


def _n_experts(args: Llama4Args) -> int:
    return args.moe.n_experts if args.moe_layers else 0


llama4_spec = ModelSpec(
    name="llama4",
    flavors=llama4_flavors,
    build=Llama4,
    flops_per_token=flops_per_token,
    tp_plan=TP_PLAN,
    tp_divisible=tp_divisible,
    hf_adapter=hf_adapter,
    hf_config=hf_config,
    step_hooks=MOE_STEP_HOOKS,
    n_experts=_n_experts,
    attention_kinds=lambda args: tuple(dict.fromkeys((layer_mask(args, i), False) for i in range(args.n_layers))),
)
