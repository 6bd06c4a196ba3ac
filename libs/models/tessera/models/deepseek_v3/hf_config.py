"""DeepSeek args to and from a Hugging Face ``DeepseekV3Config`` or ``DeepseekV2Config`` (the dict
in ``config.json``, as DeepSeek publishes it or transformers writes it).

Routing comes from ``topk_method``: "noaux_tc" (V3: sigmoid scores, correction bias, groups
ranked by their best two experts), "group_limited_greedy" (V2: softmax, groups ranked by their
best expert) or "greedy" (V2-Lite: softmax, no groups), each only under the model_type whose
transformers router implements it; V2's ``norm_topk_prob`` true is refused, as transformers'
DeepseekV2 ignores it (DeepSeek's own code honours it). YaRN comes from ``rope_scaling`` and
applies at any length, as transformers applies it (``yarn_always``); ``mscale`` and
``mscale_all_dim`` are both required and equal, as every DeepSeek config has them (YarnScaling's
mscale: transformers would scale the rotary features themselves otherwise). Shape keys are
required; others take transformers' defaults. The MoE balance settings are training choices no
config.json states: they keep ``MoEArgs``' defaults. ``num_nextn_predict_layers`` is
``num_mtp_layers``, the multi-token prediction modules (none when missing; DeepSeek's configs
state 1 with its weights; transformers writes its default 1 but saves no such weights:
``fit_to_weights`` leaves out the modules a folder's weights lack). A model without modules
loads a checkpoint with them as before (the adapter skips their weights), so ``check_config``
compares the count only for a model with some.
"""

import dataclasses

from tessera.models.deepseek_v3.args import DeepSeekV3Args, YarnScaling
from tessera.models.hf_config import compare_configs, config_value, refuse_unsupported, rope_section, yarn_section
from tessera.models.moe import MoEArgs

# (config.json key, attribute) compared by check_config; max_position_embeddings is not: the
# trainer sets the positions it trains on, and weights do not depend on it.
_COMPARED = (
    ("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("first_k_dense_replace", "n_dense_layers"),
    ("num_attention_heads", "n_heads"), ("intermediate_size", "inter_dim"), ("vocab_size", "vocab_size"),
    ("q_lora_rank", "q_lora_rank"), ("kv_lora_rank", "kv_lora_rank"), ("qk_nope_head_dim", "qk_nope_head_dim"),
    ("qk_rope_head_dim", "qk_rope_head_dim"), ("v_head_dim", "v_head_dim"), ("rms_norm_eps", "norm_eps"),
    ("rope_theta", "rope_theta"), ("rope_scaling", "yarn"), ("n_routed_experts", "moe.n_experts"),
    ("num_experts_per_tok", "moe.top_k"), ("moe_intermediate_size", "moe.hidden_dim"),
    ("n_shared_experts", "moe.n_shared_experts"), ("scoring_func", "moe.score_func"),
    ("norm_topk_prob", "moe.route_norm"), ("routed_scaling_factor", "moe.route_scale"),
    ("n_group", "moe.n_groups"), ("topk_group", "moe.topk_groups"), ("topk_method", "moe.group_score_top"),
    ("num_nextn_predict_layers", "num_mtp_layers"),
)
_SUPPORTED = {"hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "rope_interleave": True,
              "moe_layer_freq": 1}
# topk_method -> (the model_type whose transformers router implements it, score function, a group's
# score: the sum of its best n experts' scores); DeepseekV3's router does noaux_tc whatever the key says
_ROUTING = {"noaux_tc": ("deepseek_v3", "sigmoid", 2), "group_limited_greedy": ("deepseek_v2", "softmax", 1),
            "greedy": ("deepseek_v2", "softmax", 1)}
_DEFAULTS = {  # transformers' defaults per model_type (V2's null expert groups: one group)
    "deepseek_v3": {"topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 8,
                    "topk_group": 4, "n_shared_experts": 1, "first_k_dense_replace": 3},
    "deepseek_v2": {"topk_method": "greedy", "norm_topk_prob": False, "routed_scaling_factor": 1.0, "n_group": 1,
                    "topk_group": 1, "n_shared_experts": 2, "first_k_dense_replace": 0},
}


def _moe(config: dict, source: str) -> MoEArgs:
    model_type = config["model_type"]
    defaults = _DEFAULTS[model_type]
    method = config.get("topk_method") or defaults["topk_method"]
    methods = sorted(name for name, routing in _ROUTING.items() if routing[0] == model_type)
    if method not in methods:
        raise ValueError(f"{source}: topk_method {method!r} is not supported for {model_type}, only {methods}")
    _, score_func, group_score_top = _ROUTING[method]
    scoring = config.get("scoring_func", score_func)
    if scoring != score_func:
        raise ValueError(f"{source}: scoring_func {scoring!r} does not go with topk_method {method!r}")
    route_norm = config_value(config, "norm_topk_prob", bool, source, default=defaults["norm_topk_prob"])
    if route_norm and model_type == "deepseek_v2":
        raise ValueError(f"{source}: norm_topk_prob true is not supported for deepseek_v2: transformers' DeepseekV2 "
                         "does not renormalise the chosen experts' weights")
    grouped = method != "greedy"
    n_groups = config_value(config, "n_group", int, source, default=defaults["n_group"]) if grouped else 1
    fields = dict(
        n_experts=config_value(config, "n_routed_experts", int, source),
        top_k=config_value(config, "num_experts_per_tok", int, source),
        hidden_dim=config_value(config, "moe_intermediate_size", int, source),
        n_shared_experts=config_value(config, "n_shared_experts", int, source, default=defaults["n_shared_experts"],
                                      zero=True),
        score_func=score_func,
        route_norm=route_norm,
        route_scale=config_value(config, "routed_scaling_factor", float, source, default=defaults["routed_scaling_factor"]),
        n_groups=n_groups,
        topk_groups=config_value(config, "topk_group", int, source, default=defaults["topk_group"]) if grouped else 1,
        group_score_top=group_score_top if n_groups > 1 else MoEArgs.group_score_top,
    )
    try:
        return MoEArgs(**fields)
    except ValueError as e:  # MoEArgs' own checks, which do not know the file
        raise ValueError(f"{source}: {e}") from None


def _yarn(config: dict, source: str) -> tuple[float, YarnScaling | None]:
    name, params, theta = rope_section(config, source)
    yarn = yarn_section(name, params, source, "DeepSeek's YaRN scales the softmax by mscale_all_dim alone",
                        extra=("mscale", "mscale_all_dim"))
    if yarn is None:
        return theta, None
    mscale = config_value(params, "mscale", float, source, prefix=f"{name}.")
    mscale_all_dim = config_value(params, "mscale_all_dim", float, source, prefix=f"{name}.")
    if mscale != mscale_all_dim:
        raise ValueError(f"{source}: {name}.mscale {mscale} differs from mscale_all_dim {mscale_all_dim}; "
                         "only equal values are supported")
    return theta, dataclasses.replace(yarn, mscale=mscale_all_dim)


def args_from_config(config: dict, source: str = "config.json") -> DeepSeekV3Args:
    """The DeepSeekV3Args of a DeepSeek-V3 or -V2 config dict; ``source`` starts every error message."""
    refuse_unsupported(config, source, ("deepseek_v3", "deepseek_v2"), _SUPPORTED)
    n_heads = config_value(config, "num_attention_heads", int, source)
    if config_value(config, "num_key_value_heads", int, source, default=n_heads) != n_heads:
        raise ValueError(f"{source}: num_key_value_heads {config['num_key_value_heads']} differs from "
                         f"num_attention_heads {n_heads}; multi-head latent attention has one per head")
    theta, yarn = _yarn(config, source)
    moe, defaults = _moe(config, source), _DEFAULTS[config["model_type"]]
    fields = dict(
        vocab_size=config_value(config, "vocab_size", int, source),
        dim=config_value(config, "hidden_size", int, source),
        n_layers=config_value(config, "num_hidden_layers", int, source),
        n_dense_layers=config_value(config, "first_k_dense_replace", int, source,
                                    default=defaults["first_k_dense_replace"], zero=True),
        n_heads=n_heads,
        inter_dim=config_value(config, "intermediate_size", int, source),
        moe=moe,
        q_lora_rank=config_value(config, "q_lora_rank", int, source, default=0),  # null: no query bottleneck
        kv_lora_rank=config_value(config, "kv_lora_rank", int, source),
        qk_nope_head_dim=config_value(config, "qk_nope_head_dim", int, source),
        qk_rope_head_dim=config_value(config, "qk_rope_head_dim", int, source),
        v_head_dim=config_value(config, "v_head_dim", int, source),
        norm_eps=config_value(config, "rms_norm_eps", float, source, default=1e-6),
        rope_theta=theta,
        yarn=yarn,
        max_seq_len=config_value(config, "max_position_embeddings", int, source, default=4096),
        # none when missing: transformers writes 1 but saves no such weights (module docstring)
        num_mtp_layers=config_value(config, "num_nextn_predict_layers", int, source, default=0, zero=True),
        yarn_always=yarn is not None,  # as transformers applies rope_scaling, at any length
    )
    try:
        return DeepSeekV3Args(**fields)
    except ValueError as e:  # the args' own checks, which do not know the file
        raise ValueError(f"{source}: {e}") from None


def _topk_method(moe: MoEArgs) -> str:
    """The topk_method of this routing; one no DeepSeek config names (softmax weights
    renormalised: transformers' DeepseekV2 ignores norm_topk_prob) is a ValueError."""
    if moe.score_func == "softmax" and moe.route_norm:
        raise ValueError(f"no DeepSeek config.json expresses this routing (softmax with route_norm): {moe}")
    if moe.score_func == "sigmoid" and (moe.n_groups == 1 or moe.group_score_top == 2):
        return "noaux_tc"
    if moe.score_func == "softmax" and moe.n_groups == 1:
        return "greedy"
    if moe.score_func == "softmax" and moe.group_score_top == 1:
        return "group_limited_greedy"
    raise ValueError(f"no DeepSeek config.json expresses this routing: {moe}")


def config_from_args(args: DeepSeekV3Args, *, dtype: str | None = None, bos_token_id=None, eos_token_id=None) -> dict:
    """A DeepseekV3Config dict for sigmoid routing, else a DeepseekV2Config one (the adapter's
    weight format follows the same rule: V2's has no router bias)."""
    moe, v3 = args.moe, args.moe.score_func == "sigmoid"
    # YaRN only where the model applies it (max_seq_len beyond the original context): transformers
    # applies a config's rope_scaling whatever max_position_embeddings says
    yarn = None if not args.yarn_active else {
        "type": "yarn", "rope_type": "yarn", **dataclasses.asdict(args.yarn), "mscale_all_dim": args.yarn.mscale}
    config = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.inter_dim,
        "moe_intermediate_size": moe.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "first_k_dense_replace": args.n_dense_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_shared_experts": moe.n_shared_experts,
        "n_routed_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "topk_method": _topk_method(moe),
        "scoring_func": moe.score_func,
        "n_group": moe.n_groups,
        "topk_group": moe.topk_groups,
        "norm_topk_prob": moe.route_norm,
        "routed_scaling_factor": moe.route_scale,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": yarn,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "num_nextn_predict_layers": args.num_mtp_layers,
    }
    extra = {"torch_dtype": dtype, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    return config | {key: value for key, value in extra.items() if value is not None}


def fit_to_weights(args: DeepSeekV3Args, names: set[str]) -> DeepSeekV3Args:
    """``args`` without the multi-token-prediction modules when a folder of weights (tensor
    ``names``) holds none of them: transformers writes ``num_nextn_predict_layers`` 1 in every
    DeepSeek-V3 config.json it saves, and no module's weights."""
    first = f"model.layers.{args.n_layers}."
    if args.num_mtp_layers and not any(name.startswith(first) for name in names):
        return dataclasses.replace(args, num_mtp_layers=0)
    return args


def check_config(args: DeepSeekV3Args, config: dict, source: str, target: str) -> None:
    """``config`` describes the architecture of ``args`` (called ``target``): the first difference
    is a ValueError naming the config.json key and both values. YaRN is compared as the model
    applies it: a flavor built for a context within the original one applies none."""
    found = args_from_config(config, source)
    if not args.num_mtp_layers:  # the adapter skips the checkpoint's modules
        found = dataclasses.replace(found, num_mtp_layers=0)
    if found.yarn is not None and not args.yarn_active:
        raise ValueError(f"{source}: rope_scaling applies YaRN at every length, as transformers does, but {target} "
                         f"applies it only above {found.yarn.original_max_position_embeddings} positions and is "
                         f"built for {args.max_seq_len}; model.flavor from_hf_config keeps the checkpoint's YaRN")
    compare_configs(found, args.with_context(args.max_seq_len), _COMPARED, source, target)
