"""Hugging Face config.json <-> DeepSeek and Qwen3 args: published configs give the flavors,
every flavor round-trips, and what the models cannot express is refused by name."""

import dataclasses

import pytest

from tessera.models import get_model_spec
from tessera.models.deepseek_v3 import hf_config as deepseek
from tessera.models.qwen3 import hf_config as qwen3

# DeepSeek-V3's published config.json, less the float8 quantization_config and the keys no model reads.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "aux_loss_alpha": 0.001, "bos_token_id": 0,
    "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "v_head_dim": 128, "vocab_size": 129280,
}
# DeepSeek-V2-Lite ("16B"): no query bottleneck, greedy softmax routing, YaRN mscale 0.707.
DEEPSEEK_V2_LITE = {
    **{key: value for key, value in DEEPSEEK_V3.items() if key != "num_nextn_predict_layers"}, "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "first_k_dense_replace": 1,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_group": 1, "topk_group": 1,
    "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_key_value_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "q_lora_rank": None,
    "routed_scaling_factor": 1.0, "scoring_func": "softmax", "topk_method": "greedy", "vocab_size": 102400,
    "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "mscale": 0.707, "mscale_all_dim": 0.707},
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_8B = {key: value for key, value in QWEN3_30B_A3B.items()
            if key not in ("decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "norm_topk_prob",
                           "num_experts", "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef")}
QWEN3_8B |= {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
             "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 36}


def _balance_as(args, flavor):
    """``args`` with the flavor's balance settings, which no config.json states."""
    if args.moe is None:
        return args
    balance = {key: getattr(flavor.moe, key) for key in ("bias_update_rate", "aux_loss_alpha")}
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, **balance))


@pytest.mark.parametrize("family, config, flavor", [
    ("deepseek_v3", DEEPSEEK_V3, "671B"), ("deepseek_v3", DEEPSEEK_V2_LITE, "16B"),
    ("qwen3", QWEN3_30B_A3B, "30B-A3B"), ("qwen3", QWEN3_8B, "8B"),
], ids=["deepseek_v3", "deepseek_v2_lite", "qwen3_moe", "qwen3"])
def test_published_configs_give_the_flavors(family, config, flavor):
    spec = get_model_spec(family)
    args = spec.hf_config.args_from_config(config, "config.json")
    # DeepSeek-V3's multi-token-prediction module, which torchtitan's flavor (and so Tessera's) leaves
    # out; YaRN applied at any length, as transformers applies a config's rope_scaling
    modules = {"num_mtp_layers": config.get("num_nextn_predict_layers", 0),
               "yarn_always": True} if family == "deepseek_v3" else {}
    assert _balance_as(args, spec.flavors[flavor]) == dataclasses.replace(spec.flavors[flavor], **modules)
    spec.hf_config.check_config(spec.flavors[flavor], config, "config.json", flavor)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3"])
def test_every_flavor_round_trips_through_config_json(family):
    spec = get_model_spec(family)
    for name, flavor in spec.flavors.items():
        config = spec.hf_config.config_from_args(flavor, dtype="bfloat16", bos_token_id=0, eos_token_id=[1, 2])
        assert config["torch_dtype"] == "bfloat16" and config["eos_token_id"] == [1, 2]
        # a flavor's YaRN, where it applies, is applied at any length once written to a config.json
        yarn = {"yarn_always": flavor.yarn_active} if family == "deepseek_v3" else {}
        assert _balance_as(spec.hf_config.args_from_config(config, name), flavor) == dataclasses.replace(flavor, **yarn), name


def test_deepseek_v2_group_limited_routing_and_v3_defaults():
    v2 = {**DEEPSEEK_V2_LITE, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}
    moe = deepseek.args_from_config(v2).moe
    assert (moe.score_func, moe.n_groups, moe.topk_groups, moe.group_score_top) == ("softmax", 8, 3, 1)
    bare = {key: value for key, value in DEEPSEEK_V3.items()  # transformers' own layout: no routing keys
            if key not in ("topk_method", "scoring_func", "norm_topk_prob", "routed_scaling_factor")}
    assert deepseek.args_from_config(bare).moe == deepseek.args_from_config(DEEPSEEK_V3).moe
    unstated = {key: value for key, value in DEEPSEEK_V3.items()  # transformers' defaults: 8 groups, 4 taken, ...
                if key not in ("n_group", "topk_group", "n_shared_experts", "first_k_dense_replace")}
    assert deepseek.args_from_config(unstated) == deepseek.args_from_config(DEEPSEEK_V3)
    v2 = deepseek.args_from_config({key: value for key, value in v2.items() if key != "n_shared_experts"})
    assert v2.moe.n_shared_experts == 2 and v2.n_dense_layers == 1


@pytest.mark.parametrize("module, config, error", [
    (deepseek, {**DEEPSEEK_V3, "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "mscale": 0.5}},
     r"rope_scaling.mscale 0.5 differs from mscale_all_dim 1.0"),
    (deepseek, {**DEEPSEEK_V3, "rope_scaling": {k: v for k, v in DEEPSEEK_V3["rope_scaling"].items() if k != "mscale"}},
     r"rope_scaling.mscale is missing"),
    (deepseek, {**DEEPSEEK_V3, "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "attention_factor": 2.0}},
     r"rope_scaling.attention_factor is not supported"),
    (deepseek, {**DEEPSEEK_V3, "topk_method": "random"}, r"topk_method 'random' is not supported"),
    (deepseek, {**DEEPSEEK_V3, "topk_method": ["greedy"]}, r"topk_method \['greedy'\] is not supported"),
    (deepseek, {**DEEPSEEK_V3, "num_nextn_predict_layers": "1"}, r"num_nextn_predict_layers '1' is not an integer"),
    (deepseek, {**DEEPSEEK_V3, "n_shared_experts": -1}, r"n_shared_experts -1 must be >= 0"),
    (deepseek, {**DEEPSEEK_V3, "scoring_func": "softmax"}, r"scoring_func 'softmax' does not go with topk_method 'noaux_tc'"),
    # each router as transformers implements it: DeepseekV3's is noaux_tc whatever topk_method says,
    # DeepseekV2's knows no noaux_tc and never renormalises
    (deepseek, {**DEEPSEEK_V3, "topk_method": "greedy", "scoring_func": "softmax"},
     r"topk_method 'greedy' is not supported for deepseek_v3, only \['noaux_tc'\]"),
    (deepseek, {**DEEPSEEK_V2_LITE, "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
     r"topk_method 'noaux_tc' is not supported for deepseek_v2"),
    (deepseek, {**DEEPSEEK_V2_LITE, "norm_topk_prob": True}, r"norm_topk_prob true is not supported for deepseek_v2"),
    (deepseek, {**DEEPSEEK_V3, "num_key_value_heads": 8}, r"num_key_value_heads 8 differs from num_attention_heads 128"),
    (deepseek, {**DEEPSEEK_V3, "moe_layer_freq": 2}, r"moe_layer_freq 2 is not supported, only 1"),
    (deepseek, {**DEEPSEEK_V3, "model_type": "llama"}, r"model_type 'llama' is not supported, only 'deepseek_v3' or 'deepseek_v2'"),
    (qwen3, {**QWEN3_30B_A3B, "mlp_only_layers": [3]}, r"dense layers between MoE layers"),
    (qwen3, {**QWEN3_8B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": -1},
     r"max_window_layers -1 is not a layer index"),
    (qwen3, {**QWEN3_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_scaling.rope_type 'yarn' is not supported"),
    (qwen3, {key: value for key, value in QWEN3_8B.items() if key != "hidden_size"}, r"hidden_size is missing"),
])
def test_what_the_models_cannot_express_is_refused(module, config, error):
    with pytest.raises(ValueError, match=f"^x/config.json: {error}"):
        module.args_from_config(config, "x/config.json")


def test_a_mismatching_flavor_names_the_first_field():
    qwen = get_model_spec("qwen3").flavors
    moe_config = {**QWEN3_30B_A3B, "hidden_size": 4096, "num_hidden_layers": 36, "num_key_value_heads": 8,
                  "intermediate_size": 12288}
    with pytest.raises(ValueError, match=r"^c: num_experts is 128 but 8B has moe.n_experts None$"):
        qwen3.check_config(qwen["8B"], moe_config, "c", "8B")
    v3 = get_model_spec("deepseek_v3").flavors["671B"]
    four_groups = dataclasses.replace(v3, moe=dataclasses.replace(v3.moe, n_groups=4))
    with pytest.raises(ValueError, match=r"^c: n_group is 8 but 671B has moe.n_groups 4$"):
        deepseek.check_config(four_groups, DEEPSEEK_V3, "c", "671B")
    shared = dataclasses.replace(qwen["tiny_moe"], moe=dataclasses.replace(qwen["tiny_moe"].moe, n_shared_experts=1))
    with pytest.raises(ValueError, match="Qwen3-MoE's config.json cannot express this routing"):
        qwen3.config_from_args(shared)
    v2 = get_model_spec("deepseek_v3").flavors["16B"]
    renormalised = dataclasses.replace(v2, moe=dataclasses.replace(v2.moe, route_norm=True))
    with pytest.raises(ValueError, match=r"no DeepSeek config.json expresses this routing \(softmax with route_norm\)"):
        deepseek.config_from_args(renormalised)


def test_deepseek_export_states_yarn_only_where_the_model_applies_it():
    """transformers applies a config's rope_scaling whatever the context length, a flavor only above
    the original 4096 positions (as torchtitan): a run trained at 4096 must export no YaRN, and a
    model read from a config.json with YaRN keeps it when fine-tuned at 4096."""
    flavor = get_model_spec("deepseek_v3").flavors["16B"]
    assert deepseek.config_from_args(flavor)["rope_scaling"]["type"] == "yarn"
    assert deepseek.config_from_args(dataclasses.replace(flavor, max_seq_len=4096))["rope_scaling"] is None
    fine_tuned = dataclasses.replace(deepseek.args_from_config(DEEPSEEK_V2_LITE), max_seq_len=4096)
    assert deepseek.config_from_args(fine_tuned)["rope_scaling"]["mscale_all_dim"] == 0.707


def test_yarn_is_compared_and_recorded_as_the_model_applies_it():
    """A flavor built for the original context applies no YaRN: a checkpoint whose config.json has
    it is refused rather than loaded into a different model, and records state the length the
    architecture has without switching YaRN on (with_context)."""
    flavor = get_model_spec("deepseek_v3").flavors["671B"]
    deepseek.check_config(flavor, DEEPSEEK_V3, "c", "671B")  # 163840 positions: YaRN on either way
    short = dataclasses.replace(flavor, max_seq_len=4096)
    with pytest.raises(ValueError, match=r"^c: rope_scaling applies YaRN at every length.* built for 4096; "):
        deepseek.check_config(short, DEEPSEEK_V3, "c", "671B")
    stated = short.with_context(163840)
    assert stated.max_seq_len == 163840 and not stated.yarn_active
    assert deepseek.config_from_args(stated)["rope_scaling"] is None
    assert flavor.with_context(4096).yarn_active and deepseek.config_from_args(flavor.with_context(4096))["rope_scaling"]
