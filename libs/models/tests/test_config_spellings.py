"""Every family's config reader takes a config.json as transformers 5 writes it and the same
model as transformers 4 wrote it, and reads the same architecture from both. Transformers 5's
config comes from its own config class; the transformers 4 spelling is derived field by field
from what transformers 4 wrote: ``rope_theta`` on top and the scaling in ``rope_scaling``
(``type`` beside ``rope_type``) instead of ``rope_parameters``, ``torch_dtype`` for ``dtype``,
Qwen3-MoE's ``num_experts`` for ``num_local_experts``, Qwen3's window layers as
``max_window_layers`` without ``layer_types``, Llama 4's ``no_rope_layers`` (1: RoPE) and
``moe_layers`` without ``layer_types``."""

import pytest
import transformers

from tessera.models import get_model_spec

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
SCALED = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
V5 = {  # case: (family, transformers 5's config)
    "llama3": ("llama3", transformers.LlamaConfig(**TINY, rope_parameters={"rope_theta": 500000.0, **SCALED})),
    "qwen3_windows": ("qwen3", transformers.Qwen3Config(**TINY, head_dim=8, use_sliding_window=True, sliding_window=4,
                                                        max_window_layers=2)),
    "qwen3_moe": ("qwen3", transformers.Qwen3MoeConfig(**TINY, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=24, norm_topk_prob=True)),
    "deepseek_v3": ("deepseek_v3", transformers.DeepseekV3Config(
        **{**TINY, "num_key_value_heads": 4}, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                                           "mscale_all_dim": 1.0, "original_max_position_embeddings": 16})),
    "gpt_oss": ("gpt_oss", transformers.GptOssConfig(
        **{**TINY, "intermediate_size": 24}, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096})),
    "llama4": ("llama4", transformers.Llama4TextConfig(
        **{**TINY, "intermediate_size": 16}, intermediate_size_mlp=48, head_dim=8, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=4, floor_scale=4, attn_scale=0.5,
        rope_parameters={"rope_theta": 500000.0, **SCALED})),
}


def transformers4(config: dict) -> dict:
    """``config`` (transformers 5's) spelled as transformers 4 wrote the same model."""
    old = {key: value for key, value in config.items() if key not in ("rope_parameters", "dtype")}
    params = dict(config.get("rope_parameters") or {})
    old["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type", "default")
    old["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, "rope_type": rope_type, **params}
    old["torch_dtype"] = config.get("dtype")
    model_type = config["model_type"]
    if model_type == "qwen3_moe":
        old["num_experts"] = old.pop("num_local_experts")
    if model_type == "qwen3":
        del old["layer_types"]  # max_window_layers says where the windows start
    if model_type == "llama4_text":
        kinds = old.pop("layer_types")
        old["no_rope_layers"] = [int(kind == "chunked_attention") for kind in kinds]
    return old


@pytest.mark.parametrize("case", V5)
def test_both_transformers_spellings_give_one_architecture(case):
    family, config = V5[case]
    reader = get_model_spec(family).hf_config
    v5 = config.to_dict()
    v4 = transformers4(v5)
    assert v4 != v5
    args = reader.args_from_config(v5, "v5")
    assert reader.args_from_config(v4, "v4") == args
    reader.check_config(args, v4, "v4", case)  # and each spelling describes the other's model
    reader.check_config(args, reader.config_from_args(args), "written", case)


# case: (family, transformers' config class, model_type, keys that class needs no default for)
UNSTATED = {
    "llama4": ("llama4", transformers.Llama4TextConfig, "llama4_text", {"intermediate_size_mlp": 48}),
    "qwen3": ("qwen3", transformers.Qwen3Config, "qwen3", {}),
    "qwen3_moe": ("qwen3", transformers.Qwen3MoeConfig, "qwen3_moe",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}),
}


@pytest.mark.parametrize("case", UNSTATED)
def test_head_shapes_a_config_json_leaves_out_are_transformers_defaults(case):
    """Without head_dim or num_key_value_heads, transformers builds its config class's defaults
    (Llama 4: 128 and 8; Qwen3: 32 key/value heads; Qwen3-MoE: 4), not hidden_size / heads."""
    family, config_class, model_type, needed = UNSTATED[case]
    config = {"model_type": model_type, "vocab_size": 64, "hidden_size": 128, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 64, **needed}
    theirs = config_class.from_dict(dict(config))
    head_dim = getattr(theirs, "head_dim", None) or 128 // 64  # Qwen3-MoE's attention: hidden_size / heads
    args = get_model_spec(family).hf_config.args_from_config(config, case)
    assert (args.head_dim, args.n_kv_heads) == (head_dim, theirs.num_key_value_heads)
