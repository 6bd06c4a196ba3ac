"""GPT-OSS args to and from a Hugging Face ``GptOssConfig`` (the dict in ``config.json``), as
transformers 5 writes it (``rope_parameters`` holding ``rope_theta``) or as the released
checkpoints (transformers 4.55: ``rope_theta`` + ``rope_scaling``) do.

Keys a config.json leaves out take GptOssConfig's defaults (YaRN x32 over 4096 positions, theta
150000, window 128 on even layers). Window layers are those ``layer_types`` names
"sliding_attention". What the model cannot express (no attention biases, tied embeddings,
another activation, RoPE other than default or YaRN, YaRN's mscale / attention_factor) is
refused. The MoE balance settings are training choices no config.json holds: they keep
``MoEArgs``' defaults (auxiliary-loss-free balancing; ``router_aux_loss_coef`` is not read).
"""

from tessera.models.gpt_oss.args import GPT_OSS_ROUTING, GPT_OSS_YARN, GptOssArgs, alternating_windows
from tessera.models.hf_config import compare_configs, config_value, refuse_unsupported, rope_section, yarn_section
from tessera.models.moe import MoEArgs
from tessera.models.rotary import YarnScaling

# (config.json key, attribute) compared by check_config; max_position_embeddings is not: the
# trainer sets the positions it trains on, and weights do not depend on it.
_COMPARED = (
    ("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
    ("num_key_value_heads", "n_kv_heads"), ("head_dim", "head_dim"), ("vocab_size", "vocab_size"),
    ("num_local_experts", "moe.n_experts"), ("num_experts_per_tok", "moe.top_k"),
    ("intermediate_size", "moe.hidden_dim"), ("sliding_window", "sliding_window"), ("layer_types", "window_layers"),
    ("swiglu_limit", "swiglu_limit"), ("swiglu_alpha", "swiglu_alpha"), ("rms_norm_eps", "norm_eps"),
    ("rope_theta", "rope_theta"), ("rope_parameters", "yarn"),
)
_SUPPORTED = {"hidden_act": "silu", "attention_bias": True, "tie_word_embeddings": False}
_WINDOW_LAYER, _FULL_LAYER = "sliding_attention", "full_attention"
_DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta


def _rope(config: dict, source: str) -> tuple[float, YarnScaling | None]:
    if config.get("rope_parameters") is None and not config.get("rope_scaling"):  # GptOssConfig's YaRN
        return config_value(config, "rope_theta", float, source, default=_DEFAULT_THETA), GPT_OSS_YARN
    name, params, theta = rope_section(config, source, _DEFAULT_THETA)
    return theta, yarn_section(name, params, source, "GPT-OSS's YaRN scales by factor alone")


def _window_layers(config: dict, n_layers: int, source: str) -> tuple[int, ...]:
    layer_types = config.get("layer_types")
    if layer_types is None:
        return alternating_windows(n_layers)
    if not isinstance(layer_types, list) or len(layer_types) != n_layers or not set(layer_types) <= {
            _WINDOW_LAYER, _FULL_LAYER}:
        raise ValueError(f"{source}: layer_types must list {n_layers} of {_WINDOW_LAYER!r} or {_FULL_LAYER!r}, "
                         f"not {layer_types!r}")
    return tuple(i for i, kind in enumerate(layer_types) if kind == _WINDOW_LAYER)


def args_from_config(config: dict, source: str = "config.json") -> GptOssArgs:
    """The GptOssArgs of a GPT-OSS config dict; ``source`` starts every error message."""
    refuse_unsupported(config, source, ("gpt_oss",), _SUPPORTED)
    theta, yarn = _rope(config, source)
    n_layers = config_value(config, "num_hidden_layers", int, source)
    n_experts_key = "num_local_experts" if config.get("num_local_experts") is not None else "num_experts"
    try:
        moe = MoEArgs(n_experts=config_value(config, n_experts_key, int, source),
                      top_k=config_value(config, "num_experts_per_tok", int, source),
                      hidden_dim=config_value(config, "intermediate_size", int, source), **GPT_OSS_ROUTING)
        return GptOssArgs(
            vocab_size=config_value(config, "vocab_size", int, source),
            dim=config_value(config, "hidden_size", int, source),
            n_layers=n_layers,
            n_heads=config_value(config, "num_attention_heads", int, source),
            n_kv_heads=config_value(config, "num_key_value_heads", int, source),
            head_dim=config_value(config, "head_dim", int, source, default=64),
            moe=moe,
            sliding_window=config_value(config, "sliding_window", int, source, default=128),
            window_layers=_window_layers(config, n_layers, source),
            swiglu_limit=config_value(config, "swiglu_limit", float, source, default=7.0),
            swiglu_alpha=config_value(config, "swiglu_alpha", float, source, default=1.702),
            norm_eps=config_value(config, "rms_norm_eps", float, source, default=1e-5),
            rope_theta=theta,
            yarn=yarn,
            max_seq_len=config_value(config, "max_position_embeddings", int, source, default=131072),
        )
    except ValueError as e:  # shapes that do not fit together
        raise ValueError(f"{source}: {e}") from None


def config_from_args(args: GptOssArgs, *, dtype: str | None = None, bos_token_id=None, eos_token_id=None) -> dict:
    """A GptOssConfig dict in transformers 5's layout; routing GPT-OSS cannot express (shared
    experts, sigmoid scores, groups, a route scale, weights not renormalised, a gate without
    bias) is a ValueError."""
    moe = args.moe
    routing = (moe.score_func, moe.route_norm, moe.gate_bias, moe.n_shared_experts, moe.n_groups, moe.route_scale)
    if routing != ("softmax", True, True, 0, 1, 1.0):
        raise ValueError(f"GPT-OSS's config.json cannot express this routing: {moe}")
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn is not None:
        y = args.yarn
        if y.mscale != 1.0:
            raise ValueError(f"GPT-OSS's config.json cannot express YaRN's mscale {y.mscale}")
        rope = {"rope_type": "yarn", "rope_theta": args.rope_theta, "factor": y.factor, "beta_fast": y.beta_fast,
                "beta_slow": y.beta_slow, "truncate": y.truncate,
                "original_max_position_embeddings": y.original_max_position_embeddings}
    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": moe.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "num_local_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "sliding_window": args.sliding_window,
        "layer_types": [_WINDOW_LAYER if i in args.window_layers else _FULL_LAYER for i in range(args.n_layers)],
        "hidden_act": "silu",
        "swiglu_limit": args.swiglu_limit,
        "swiglu_alpha": args.swiglu_alpha,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope,
        "attention_bias": True,
        "tie_word_embeddings": False,
    }
    extra = {"torch_dtype": dtype, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    return config | {key: value for key, value in extra.items() if value is not None}


def check_config(args: GptOssArgs, config: dict, source: str, target: str) -> None:
    """``config`` describes the architecture of ``args`` (called ``target``): the first difference
    is a ValueError naming the config.json key and both values."""
    compare_configs(args_from_config(config, source), args, _COMPARED, source, target)
