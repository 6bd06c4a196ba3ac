"""Llama 4 args to and from a Hugging Face ``Llama4TextConfig`` (the dict in ``config.json``),
transformers 4 (``rope_theta`` + ``rope_scaling``) or 5 (``rope_parameters``) layout; a
multimodal ``Llama4Config`` is read through its ``text_config``.

Keys a config.json leaves out take transformers' defaults, and the per-layer lists resolve as
transformers does: ``moe_layers`` else every ``interleave_moe_layer_step``-th layer;
``no_rope_layers`` (1: RoPE, 0: NoPE; empty or missing: every ``no_rope_layer_interval``-th layer
NoPE); ``layer_types`` ("chunked_attention" / "full_attention") else the RoPE layers chunked
when ``attention_chunk_size`` is set. What the model cannot express (biases, other activations,
RoPE types other than default/llama3) is refused. The MoE balance settings are training
choices no config.json holds: they keep ``MoEArgs``' defaults (auxiliary-loss-free balancing).
"""

import dataclasses

from tessera.models.hf_config import compare_configs, config_value, refuse_unsupported, rope_section
from tessera.models.llama.args import RopeScaling
from tessera.models.llama4.args import Llama4Args, every
from tessera.models.moe import MoEArgs

# (config.json key, attribute) compared by check_config; max_position_embeddings is not: the
# trainer sets the positions it trains on, and weights do not depend on it.
_COMPARED = (
    ("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
    ("num_key_value_heads", "n_kv_heads"), ("head_dim", "head_dim"), ("intermediate_size_mlp", "hidden_dim"),
    ("vocab_size", "vocab_size"), ("rms_norm_eps", "norm_eps"), ("rope_theta", "rope_theta"),
    ("rope_scaling", "rope_scaling"), ("tie_word_embeddings", "tie_embeddings"),
    ("num_local_experts", "moe.n_experts"), ("num_experts_per_tok", "moe.top_k"),
    ("intermediate_size", "moe.hidden_dim"), ("moe_layers", "moe_layers"), ("no_rope_layers", "nope_layers"),
    ("layer_types", "chunked_layers"), ("attention_chunk_size", "attention_chunk_size"),
    ("use_qk_norm", "use_qk_norm"), ("attn_temperature_tuning", "attn_temperature_tuning"),
    ("floor_scale", "floor_scale"), ("attn_scale", "attn_scale"),
)
_SUPPORTED = {"hidden_act": "silu", "attention_bias": False}
_CHUNKED, _FULL = "chunked_attention", "full_attention"
_DEFAULT_THETA = 500000.0  # Llama4TextConfig.default_theta


def _layer_list(config: dict, key: str, source: str, allowed: tuple) -> list | None:
    """config[key], a list of ``allowed`` values per layer, or None when missing."""
    values = config.get(key)
    if values is not None and (not isinstance(values, list) or not all(v in allowed for v in values)):
        raise ValueError(f"{source}: {key} {values!r} is not a list of {' / '.join(map(repr, allowed))}")
    return values


def _rope(config: dict, source: str) -> tuple[float, RopeScaling | None]:
    name, params, theta = rope_section(config, source, _DEFAULT_THETA)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"{source}: {name}.rope_type {rope_type!r} is not supported, only 'default' or 'llama3'")
    fields = {field.name: config_value(params, field.name, field.type, source, prefix=f"{name}.")
              for field in dataclasses.fields(RopeScaling)}
    return theta, RopeScaling(**fields)


def _layers(config: dict, n_layers: int, source: str) -> dict:
    """moe_layers, nope_layers, chunked_layers and the chunk size, as transformers resolves them."""
    moe = config.get("moe_layers")
    if moe is None:
        moe = list(every(config_value(config, "interleave_moe_layer_step", int, source, default=1), n_layers))
    elif not isinstance(moe, list) or not all(isinstance(i, int) and 0 <= i < n_layers for i in moe):
        raise ValueError(f"{source}: moe_layers {moe!r} is not a list of layer indices below {n_layers}")
    uses_rope = _layer_list(config, "no_rope_layers", source, (0, 1))
    if not uses_rope:
        interval = config_value(config, "no_rope_layer_interval", int, source, default=4)
        uses_rope = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if len(uses_rope) < n_layers:
        raise ValueError(f"{source}: no_rope_layers has {len(uses_rope)} entries for {n_layers} layers")
    # transformers' default is 8192; a null chunk size (written out) means no chunked layers
    default_chunk = None if "attention_chunk_size" in config else 8192
    chunk = config_value(config, "attention_chunk_size", int, source, default=default_chunk)
    kinds = _layer_list(config, "layer_types", source, (_CHUNKED, _FULL))
    if kinds is None:
        kinds = [_CHUNKED if rope and chunk is not None else _FULL for rope in uses_rope[:n_layers]]
    elif len(kinds) != n_layers:
        raise ValueError(f"{source}: layer_types has {len(kinds)} entries for {n_layers} layers")
    chunked = tuple(i for i, kind in enumerate(kinds) if kind == _CHUNKED)
    if chunked and chunk is None:
        raise ValueError(f"{source}: layer_types has chunked_attention layers but attention_chunk_size is null")
    return dict(moe_layers=tuple(sorted(set(moe))), nope_layers=tuple(i for i in range(n_layers) if not uses_rope[i]),
                chunked_layers=chunked, attention_chunk_size=chunk if chunked else None)


def _temperature_tuning(config: dict, source: str) -> bool:
    """transformers 4's released configs write an int here (Scout: 4), which it reads as a truth value."""
    value = config.get("attn_temperature_tuning", True)
    if not isinstance(value, (bool, int)):
        raise ValueError(f"{source}: attn_temperature_tuning {value!r} is not true or false")
    return bool(value)


def args_from_config(config: dict, source: str = "config.json") -> Llama4Args:
    """The Llama4Args of a Llama4TextConfig dict (or a Llama4Config's text_config); ``source``
    starts every error message."""
    if config.get("model_type") == "llama4" and isinstance(config.get("text_config"), dict):
        config, source = {"model_type": "llama4_text", **config["text_config"]}, f"{source} text_config"
    refuse_unsupported(config, source, ("llama4_text",), _SUPPORTED)
    theta, scaling = _rope(config, source)
    dim = config_value(config, "hidden_size", int, source, default=5120)
    n_heads = config_value(config, "num_attention_heads", int, source, default=40)
    n_layers = config_value(config, "num_hidden_layers", int, source, default=48)
    try:
        moe = MoEArgs(n_experts=config_value(config, "num_local_experts", int, source, default=16),
                      top_k=config_value(config, "num_experts_per_tok", int, source, default=1),
                      hidden_dim=config_value(config, "intermediate_size", int, source, default=8192),
                      n_shared_experts=1, score_func="sigmoid", score_before_experts=True)
        return Llama4Args(
            vocab_size=config_value(config, "vocab_size", int, source, default=202048),
            dim=dim,
            n_heads=n_heads,
            # transformers' defaults are 8 and 128; a null (written out) means one per head and hidden_size / heads
            n_kv_heads=config_value(config, "num_key_value_heads", int, source,
                                    default=n_heads if "num_key_value_heads" in config else 8),
            head_dim=config_value(config, "head_dim", int, source, default=dim // n_heads if "head_dim" in config else 128),
            hidden_dim=config_value(config, "intermediate_size_mlp", int, source, default=16384),
            moe=moe,
            n_layers=n_layers,
            **_layers(config, n_layers, source),
            use_qk_norm=config_value(config, "use_qk_norm", bool, source, default=True),
            attn_temperature_tuning=_temperature_tuning(config, source),
            floor_scale=config_value(config, "floor_scale", int, source, default=8192),
            attn_scale=config_value(config, "attn_scale", float, source, default=0.1),
            norm_eps=config_value(config, "rms_norm_eps", float, source, default=1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_seq_len=config_value(config, "max_position_embeddings", int, source, default=131072),
            tie_embeddings=config_value(config, "tie_word_embeddings", bool, source, default=False),
        )
    except ValueError as e:  # shapes that do not fit together
        if str(e).startswith(source):
            raise
        raise ValueError(f"{source}: {e}") from None


def config_from_args(args: Llama4Args, *, dtype: str | None = None, bos_token_id=None, eos_token_id=None) -> dict:
    """A Llama4TextConfig dict for ``args`` (per-layer lists spelled out, RoPE in transformers 4's
    layout, which 5 reads too); routing Llama 4 cannot state is a ValueError."""
    moe = args.moe
    if (moe.n_shared_experts, moe.score_func, moe.route_norm, moe.route_scale, moe.n_groups, moe.score_before_experts,
            moe.gate_bias) != (1, "sigmoid", False, 1.0, 1, True, False):
        raise ValueError(f"Llama 4's config.json cannot express this routing: {moe}")
    config = {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "hidden_size": args.dim,
        "intermediate_size": moe.hidden_dim,
        "intermediate_size_mlp": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None if args.rope_scaling is None else {"rope_type": "llama3",
                                                                **dataclasses.asdict(args.rope_scaling)},
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "num_local_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_layers": list(args.moe_layers),
        "no_rope_layers": [int(i not in args.nope_layers) for i in range(args.n_layers)],
        "attention_chunk_size": args.attention_chunk_size,
        "layer_types": [_CHUNKED if i in args.chunked_layers else _FULL for i in range(args.n_layers)],
        "use_qk_norm": args.use_qk_norm,
        "attn_temperature_tuning": args.attn_temperature_tuning,
        "floor_scale": args.floor_scale,
        "attn_scale": args.attn_scale,
    }
    extra = {"torch_dtype": dtype, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    return config | {key: value for key, value in extra.items() if value is not None}


def check_config(args: Llama4Args, config: dict, source: str, target: str) -> None:
    """``config`` describes the architecture of ``args`` (called ``target``): the first difference
    is a ValueError naming the config.json key and both values."""
    compare_configs(args_from_config(config, source), args, _COMPARED, source, target)
