"""Model spec of the DeepSeek-V2/V3 family."""

import dataclasses

from torch import nn

from tessera.models.deepseek_v3 import hf_adapter, hf_config
from tessera.models.deepseek_v3.args import DeepSeekV3Args
from tessera.models.deepseek_v3.flavors import deepseek_v3_flavors
from tessera.models.deepseek_v3.model import DeepSeekV3
from tessera.models.moe.balance import MOE_STEP_HOOKS
from tessera.models.moe.sharding import moe_tp_plan
from tessera.models.spec import ModelSpec, RunLayout

# Patterns for every flavor: a flavor has either wq or wq_a/q_norm/wq_b. "replicated" (a module
# every TP rank runs whole on the block's replicated input, its weight gradients summed over the
# TP ranks) is tessera.tp's role; the MoE layers' entries (router, experts, shared experts) are the
# family's own (tessera.models.moe.sharding).
TP_PLAN = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "norm",
    "layers.*.attention": "block_input",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wq_a": "replicated",
    "layers.*.attention.q_norm": "replicated",
    "layers.*.attention.wq_b": "colwise",
    "layers.*.attention.wkv_a": "replicated",
    "layers.*.attention.kv_norm": "replicated",
    "layers.*.attention.wkv_b": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "norm",
    "layers.*.feed_forward": "block_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.feed_forward.w3": "colwise",
    **moe_tp_plan("layers.*.moe"),
    # multi-token prediction: its projection runs on the sequence shard with a replicated weight,
    # as a norm does (tessera.tp's role; the block hands its output on as the local shard)
    "layers.*.enorm": "norm",
    "layers.*.hnorm": "norm",
    "layers.*.eh_proj": "norm",
    "layers.*.mtp_norm": "norm",
    "norm": "norm",
    "output": "vocab_output",
}


def attention_params(args: DeepSeekV3Args) -> int:
    """Parameters of one MLA block (projections and the latent norms)."""
    a, qk = args, args.n_heads * args.qk_head_dim
    q = a.dim * qk if a.q_lora_rank == 0 else a.dim * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * qk
    kv = a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
    kv += a.kv_lora_rank * a.n_heads * (a.qk_nope_head_dim + a.v_head_dim)
    return q + kv + a.n_heads * a.v_head_dim * a.dim


def active_params(args: DeepSeekV3Args) -> int:
    """Parameters a token's forward multiplies by: all but the token embedding and the routed
    experts it is not sent to (the output projection counts), and each multi-token-prediction
    module's block, projection and norms with the output projection it runs again."""
    a, moe = args, args.moe
    expert = 3 * a.dim * moe.hidden_dim
    moe_layer = a.dim * moe.n_experts + (moe.n_shared_experts + moe.top_k) * expert
    blocks = a.n_layers + a.num_mtp_layers  # the modules' blocks are MoE blocks
    params = blocks * (attention_params(a) + 2 * a.dim)
    params += a.n_dense_layers * 3 * a.dim * a.inter_dim + (blocks - a.n_dense_layers) * moe_layer
    params += a.num_mtp_layers * (2 * a.dim * a.dim + 3 * a.dim + a.dim * a.vocab_size)
    return params + a.dim + a.dim * a.vocab_size


def flops_per_token(args: DeepSeekV3Args, seq_len: int) -> float:
    """6 * active_params + 6 * blocks * n_heads * (qk_head_dim + v_head_dim) * seq_len: 2 FLOPs
    per active weight forward, 4 backward; attention's QK^T (qk_head_dim wide) and scores @ V
    (v_head_dim wide) cost 2 FLOPs per feature and key, times 3 for forward + backward, over the
    full sequence (ignoring the causal mask), in the n_layers blocks and the MTP modules' blocks."""
    blocks = args.n_layers + args.num_mtp_layers
    attention = 6 * blocks * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len
    return 6 * active_params(args) + attention


def tp_divisible(args: DeepSeekV3Args) -> dict[str, int]:
    # the routed experts split their hidden features under TP (torchtitan's expert TP)
    quantities = {"n_heads": args.n_heads, "vocab_size": args.vocab_size, "inter_dim": args.inter_dim,
                  "moe.hidden_dim": args.moe.hidden_dim}
    if args.moe.n_shared_experts:
        quantities["shared_experts_hidden_dim"] = args.moe.n_shared_experts * args.moe.hidden_dim
    return quantities


def _n_experts(args) -> int:
    return args.moe.n_experts


def _mtp_layers(args) -> int:
    return args.num_mtp_layers


def set_mtp_scale(model: nn.Module, scale: float) -> None:
    model.mtp_scale = scale


def refusals(args: DeepSeekV3Args, layout: RunLayout) -> tuple[tuple[str, str], ...]:
    if layout.cp > 1 and args.num_mtp_layers:
        # as torchtitan's: each module reads the tokens after a position, which another rank's shard holds
        return (("context_parallel_degree > 1", "multi-token prediction's later tokens cross the "
                                                "context-parallel shards of a sequence"),)
    if layout.cp > 1 and args.qk_head_dim != args.v_head_dim:
        # seen on torch 2.13, CPU: torch's ring attention raises inside its kernel for value heads
        # narrower than the query/key heads
        return (("context_parallel_degree > 1", f"MLA's value heads ({args.v_head_dim}) differ from its "
                                                f"query/key heads ({args.qk_head_dim}), which context parallel "
                                                "attention cannot take"),)
    return ()


deepseek_v3_spec = ModelSpec(
    name="deepseek_v3",
    flavors=deepseek_v3_flavors,
    build=DeepSeekV3,
    flops_per_token=flops_per_token,
    tp_plan=TP_PLAN,
    tp_divisible=tp_divisible,
    hf_adapter=hf_adapter,
    hf_config=hf_config,
    step_hooks=dataclasses.replace(MOE_STEP_HOOKS, set_mtp_scale=set_mtp_scale),
    with_context=DeepSeekV3Args.with_context,
    refusals=refusals,
    n_experts=_n_experts,
    mtp_layers=_mtp_layers,
)
