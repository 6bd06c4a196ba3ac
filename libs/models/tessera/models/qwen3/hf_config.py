"""Qwen3 args to and from a Hugging Face ``Qwen3Config`` / ``Qwen3MoeConfig`` (the dict in
``config.json``), transformers 4 (``rope_theta`` on top) or 5 (``rope_parameters``) layout.

Keys a config.json leaves out take transformers' defaults; each field is read under its
transformers 4 and 5 names (Qwen3-MoE's ``num_experts`` is ``num_local_experts`` in 5). Sliding
windows (``use_sliding_window``, ``sliding_window``) are on the layers ``layer_types`` names
"sliding_attention", else on those from ``max_window_layers`` on (Qwen3) or on every layer
(Qwen3-MoE), as transformers 5 places them. What these models cannot express (RoPE scaling,
biases, dense layers between MoE ones) is refused. The MoE balance settings are training choices
no config.json holds: they keep ``MoEArgs``' defaults (auxiliary-loss-free balancing, as the
flavors).
"""

from tessera.models.hf_config import compare_configs, config_value, refuse_unsupported, rope_section
from tessera.models.moe import MoEArgs
from tessera.models.qwen3.args import Qwen3Args

# (config.json key, attribute) compared by check_config; max_position_embeddings is not: the
# trainer sets the positions it trains on, and weights do not depend on it.
_COMPARED = (
    ("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
    ("num_key_value_heads", "n_kv_heads"), ("head_dim", "head_dim"), ("intermediate_size", "hidden_dim"),
    ("vocab_size", "vocab_size"), ("rms_norm_eps", "norm_eps"), ("rope_theta", "rope_theta"),
    ("tie_word_embeddings", "tie_embeddings"), ("num_experts", "moe.n_experts"),
    ("num_experts_per_tok", "moe.top_k"), ("moe_intermediate_size", "moe.hidden_dim"),
    ("norm_topk_prob", "moe.route_norm"), ("sliding_window", "sliding_window"), ("layer_types", "window_layers"),
)
_SUPPORTED = {"hidden_act": "silu", "attention_bias": False}
_WINDOW_LAYER, _GLOBAL_LAYER = "sliding_attention", "full_attention"
# transformers' num_key_value_heads where config.json leaves it out (null: one per head)
_KV_HEADS = {"qwen3": 32, "qwen3_moe": 4}
# transformers 5's names of fields whose transformers 4 name this reader uses
_RENAMED = {"num_experts": "num_local_experts"}


def _value(config: dict, key: str, kind: type, source: str, **default):
    """config_value under the transformers 4 name or, missing that, its transformers 5 one."""
    if config.get(key) is None and config.get(_RENAMED.get(key)) is not None:
        key = _RENAMED[key]
    return config_value(config, key, kind, source, **default)


def _window(config: dict, n_layers: int, source: str) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, window_layers) as transformers 5 reads them."""
    if not config_value(config, "use_sliding_window", bool, source, default=False) or (
            "sliding_window" in config and config["sliding_window"] is None):  # transformers: no window then
        return None, ()
    window = config_value(config, "sliding_window", int, source, default=4096)
    kinds = config.get("layer_types")
    if config["model_type"] == "qwen3_moe" or kinds is None:
        first = 0 if config["model_type"] == "qwen3_moe" else config.get("max_window_layers", 28)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ValueError(f"{source}: max_window_layers {first!r} is not a layer index")
        layers = tuple(range(first, n_layers))
        return (window, layers) if layers else (None, ())
    if not isinstance(kinds, list) or len(kinds) != n_layers or not set(kinds) <= {_WINDOW_LAYER, _GLOBAL_LAYER}:
        raise ValueError(f"{source}: layer_types must list {n_layers} of {_WINDOW_LAYER!r} / {_GLOBAL_LAYER!r}, "
                         f"got {kinds!r}")
    layers = tuple(i for i, kind in enumerate(kinds) if kind == _WINDOW_LAYER)
    return (window, layers) if layers else (None, ())


def _moe(config: dict, source: str) -> MoEArgs | None:
    if config["model_type"] != "qwen3_moe":
        return None
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise ValueError(f"{source}: dense layers between MoE layers (decoder_sparse_step, mlp_only_layers) "
                         "are not supported")
    fields = dict(
        n_experts=_value(config, "num_experts", int, source),
        top_k=config_value(config, "num_experts_per_tok", int, source),
        hidden_dim=config_value(config, "moe_intermediate_size", int, source),
        route_norm=config_value(config, "norm_topk_prob", bool, source, default=False),
    )
    try:
        return MoEArgs(score_func="softmax", **fields)
    except ValueError as e:  # more experts per token than experts
        raise ValueError(f"{source}: {e}") from None


def args_from_config(config: dict, source: str = "config.json") -> Qwen3Args:
    """The Qwen3Args of a Qwen3 or Qwen3-MoE config dict; ``source`` starts every error message."""
    refuse_unsupported(config, source, ("qwen3", "qwen3_moe"), _SUPPORTED)
    name, params, theta = rope_section(config, source)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{source}: {name}.rope_type {rope_type!r} is not supported, only 'default'")
    dim = config_value(config, "hidden_size", int, source)
    n_heads = config_value(config, "num_attention_heads", int, source)
    # Qwen3Config's head_dim defaults to 128; Qwen3MoeConfig has none and uses hidden_size / heads
    head_dim = 128 if config["model_type"] == "qwen3" else dim // n_heads
    moe = _moe(config, source)
    n_layers = config_value(config, "num_hidden_layers", int, source)
    window, window_layers = _window(config, n_layers, source)
    try:
        return Qwen3Args(
            vocab_size=config_value(config, "vocab_size", int, source),
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=config_value(config, "num_key_value_heads", int, source,
                                    default=n_heads if "num_key_value_heads" in config else _KV_HEADS[config["model_type"]]),
            head_dim=config_value(config, "head_dim", int, source, default=head_dim),
            hidden_dim=config_value(config, "intermediate_size", int, source),
            moe=moe,
            norm_eps=config_value(config, "rms_norm_eps", float, source, default=1e-6),
            rope_theta=theta,
            max_seq_len=config_value(config, "max_position_embeddings", int, source, default=32768),
            tie_embeddings=config_value(config, "tie_word_embeddings", bool, source, default=False),
            sliding_window=window,
            window_layers=window_layers,
        )
    except ValueError as e:  # shapes that do not fit together
        raise ValueError(f"{source}: {e}") from None


def config_from_args(args: Qwen3Args, *, dtype: str | None = None, bos_token_id=None, eos_token_id=None) -> dict:
    """A Qwen3Config (dense) or Qwen3MoeConfig dict for ``args``, with fields both transformers 4
    and 5 read; what Qwen3-MoE cannot express (shared experts, sigmoid scores, expert groups, a
    route scale, windows on some layers only) is a ValueError."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM" if args.moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if args.moe else "qwen3",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "use_sliding_window": bool(args.window_layers),
        "sliding_window": args.sliding_window,
    }
    if args.moe is None:
        # layer_types is what transformers 5 reads; max_window_layers (transformers 4) holds where
        # the windows are a suffix of the layers
        suffix = args.window_layers == tuple(range(args.n_layers - len(args.window_layers), args.n_layers))
        config |= {"max_window_layers": args.n_layers - len(args.window_layers) if suffix else args.n_layers,
                   "layer_types": [_WINDOW_LAYER if i in args.window_layers else _GLOBAL_LAYER
                                   for i in range(args.n_layers)]}
    elif args.window_layers not in ((), tuple(range(args.n_layers))):
        raise ValueError(f"Qwen3-MoE's config.json cannot put sliding windows on some layers only: {args.window_layers}")
    if args.moe:
        moe = args.moe
        if (moe.n_shared_experts, moe.score_func, moe.n_groups, moe.route_scale) != (0, "softmax", 1, 1.0):
            raise ValueError(f"Qwen3-MoE's config.json cannot express this routing: {moe}")
        config |= {"num_experts": moe.n_experts, "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.hidden_dim,
                   "norm_topk_prob": moe.route_norm, "decoder_sparse_step": 1, "mlp_only_layers": []}
    extra = {"torch_dtype": dtype, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    return config | {key: value for key, value in extra.items() if value is not None}


def check_config(args: Qwen3Args, config: dict, source: str, target: str) -> None:
    """``config`` describes the architecture of ``args`` (called ``target``): the first difference
    is a ValueError naming the config.json key and both values."""
    compare_configs(args_from_config(config, source), args, _COMPARED, source, target)
