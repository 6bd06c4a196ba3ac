"""Llama ``ModelArgs`` to and from a Hugging Face ``LlamaConfig`` (the dict in ``config.json``).

transformers 4 writes ``rope_theta`` at the top level and Llama 3.1 scaling as ``rope_scaling``
({"rope_type" (or "type"): "llama3", factor, low_freq_factor, high_freq_factor,
original_max_position_embeddings}); transformers 5 writes both into ``rope_parameters``. Both are
read. Exports use the transformers 4 form, which transformers 5 reads as well (the reverse does
not hold). Keys a config.json leaves out take LlamaConfig's defaults. What this Llama cannot
express (biases, another activation or RoPE type, a head_dim other than hidden_size /
num_attention_heads) is refused, never approximated.
"""

import dataclasses

from tessera.models.hf_config import compare_configs, config_value, refuse_unsupported, rope_section
from tessera.models.llama.args import ModelArgs, RopeScaling

# (config.json key, ModelArgs attribute) compared by check_config; max_position_embeddings is
# not: the trainer sets the positions it trains on, and weights do not depend on it.
_COMPARED = (
    ("hidden_size", "dim"),
    ("num_hidden_layers", "n_layers"),
    ("num_attention_heads", "n_heads"),
    ("num_key_value_heads", "kv_heads"),
    ("intermediate_size", "ffn_hidden_dim"),
    ("vocab_size", "vocab_size"),
    ("rms_norm_eps", "norm_eps"),
    ("rope_theta", "rope_theta"),
    ("rope_scaling", "rope_scaling"),
    ("tie_word_embeddings", "tie_embeddings"),
)


def _rope(config: dict, source: str) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (transformers 4)."""
    name, params, theta = rope_section(config, source)
    prefix = f"{name}."
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"{source}: {name}.rope_type {rope_type!r} is not supported, only 'default' or 'llama3'")
    scaling = RopeScaling(
        factor=config_value(params, "factor", float, source, prefix=prefix),
        low_freq_factor=config_value(params, "low_freq_factor", float, source, prefix=prefix),
        high_freq_factor=config_value(params, "high_freq_factor", float, source, prefix=prefix),
        original_max_position_embeddings=config_value(params, "original_max_position_embeddings", int, source, prefix=prefix),
    )
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ValueError(f"{source}: {name}.high_freq_factor {scaling.high_freq_factor} must exceed "
                         f"low_freq_factor {scaling.low_freq_factor}")
    return theta, scaling


def args_from_config(config: dict, source: str = "config.json") -> ModelArgs:
    """The ModelArgs of a LlamaConfig dict; ``source`` (the file) starts every error message.
    ``max_seq_len`` is max_position_embeddings and ``ffn_dim`` is intermediate_size, exactly."""
    refuse_unsupported(config, source, ("llama",), {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False})
    dim = config_value(config, "hidden_size", int, source)
    n_heads = config_value(config, "num_attention_heads", int, source)
    head_dim = config_value(config, "head_dim", int, source, default=None)
    if head_dim is not None and head_dim * n_heads != dim:
        raise ValueError(f"{source}: head_dim {head_dim} is not supported: Tessera's Llama uses hidden_size / "
                         f"num_attention_heads = {dim} / {n_heads}")
    theta, scaling = _rope(config, source)
    fields = dict(
        dim=dim,
        n_layers=config_value(config, "num_hidden_layers", int, source),
        n_heads=n_heads,
        n_kv_heads=config_value(config, "num_key_value_heads", int, source, default=n_heads),
        vocab_size=config_value(config, "vocab_size", int, source),
        ffn_dim=config_value(config, "intermediate_size", int, source),
        norm_eps=config_value(config, "rms_norm_eps", float, source, default=1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=config_value(config, "max_position_embeddings", int, source, default=2048),
        tie_embeddings=config_value(config, "tie_word_embeddings", bool, source, default=False),
    )
    try:
        return ModelArgs(**fields)
    except ValueError as e:  # shapes that do not fit together (heads not dividing hidden_size, ...)
        raise ValueError(f"{source}: {e}") from None


def config_from_args(args: ModelArgs, *, dtype: str | None = None, bos_token_id=None, eos_token_id=None) -> dict:
    """A LlamaConfig dict for ``args``, which ``transformers.AutoModelForCausalLM.from_pretrained``
    opens beside the weights; ``dtype`` ("float32", "bfloat16", ...) is the weights' and the
    token ids are written when known (an int, or a list for several end tokens)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None if args.rope_scaling is None else {"rope_type": "llama3", **dataclasses.asdict(args.rope_scaling)},
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
    }
    extra = {"torch_dtype": dtype, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    return config | {key: value for key, value in extra.items() if value is not None}


def check_config(args: ModelArgs, config: dict, source: str, target: str) -> None:
    """``config`` describes the architecture of ``args`` (called ``target`` in messages): the
    first difference is a ValueError naming the config.json key and both values."""
    compare_configs(args_from_config(config, source), args, _COMPARED, source, target)
