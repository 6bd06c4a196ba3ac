"""Hugging Face adapters of DeepSeek-V3 and Qwen3: names, stacked experts, router bias, round trips."""

import dataclasses

import pytest
import torch

from tessera.models import get_model_spec
from tessera.models.deepseek_v3 import DeepSeekV3Args
from tessera.models.moe import MoEArgs
from tessera.models.qwen3 import Qwen3Args
from tessera.models.spec import hf_export_note

MOE = MoEArgs(n_experts=4, top_k=2, hidden_dim=8, n_shared_experts=1, score_func="sigmoid", route_norm=True)
DS = DeepSeekV3Args(vocab_size=40, dim=16, n_layers=3, n_dense_layers=1, n_heads=2, inter_dim=24, moe=MOE,
                    q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, max_seq_len=16)
QWEN = Qwen3Args(vocab_size=40, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=24, max_seq_len=16)
QWEN_MOE = dataclasses.replace(QWEN, moe=MoEArgs(n_experts=4, top_k=2, hidden_dim=8, route_norm=True))


def state_with_bias(family, args):
    torch.manual_seed(0)
    state = get_model_spec(family).build(args).state_dict()
    for key in state:
        if key.endswith("expert_bias"):
            state[key] = torch.randn_like(state[key])
    return state


def test_deepseek_v3_names_and_round_trip():
    adapter, state = get_model_spec("deepseek_v3").hf_adapter, state_with_bias("deepseek_v3", DS)
    hf = adapter.to_hf(state, DS)
    layer = "model.layers.1."
    assert {layer + name for name in (
        "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
        "mlp.experts.3.gate_proj.weight", "mlp.experts.0.down_proj.weight", "mlp.shared_experts.up_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight")} <= set(hf)
    assert "model.layers.0.mlp.gate_proj.weight" in hf and "lm_head.weight" in hf
    # Per-expert tensors are the stacked tensor's slices, nn.Linear layout (out, in).
    assert torch.equal(hf[layer + "mlp.experts.2.gate_proj.weight"], state["layers.1.moe.experts.w1"][2])
    assert hf[layer + "mlp.experts.2.down_proj.weight"].shape == (DS.dim, MOE.hidden_dim)
    assert len(hf) == len(state) + 2 * 3 * (MOE.n_experts - 1)  # 2 MoE layers, 3 weights, E tensors for 1
    back = adapter.from_hf(hf, DS)
    assert back.keys() == state.keys()
    for key in state:
        assert torch.equal(back[key], state[key]), key


def test_deepseek_v2_format_has_no_router_bias():
    args = dataclasses.replace(DS, q_lora_rank=0, moe=dataclasses.replace(MOE, score_func="softmax", route_norm=False))
    adapter, state = get_model_spec("deepseek_v3").hf_adapter, state_with_bias("deepseek_v3", args)
    hf = adapter.to_hf(state, args)
    assert "model.layers.1.self_attn.q_proj.weight" in hf
    assert not any("e_score_correction_bias" in key for key in hf)
    back = adapter.from_hf(hf, args)
    assert back.keys() == state.keys()
    assert torch.equal(back["layers.2.moe.expert_bias"], torch.zeros(MOE.n_experts))


def test_deepseek_v3_skips_multi_token_prediction_layer():
    adapter = get_model_spec("deepseek_v3").hf_adapter
    hf = adapter.to_hf(state_with_bias("deepseek_v3", DS), DS)
    hf["model.layers.3.eh_proj.weight"] = torch.zeros(16, 32)  # layer n_layers: DeepSeek-V3's MTP module
    hf["model.layers.3.self_attn.o_proj.weight"] = torch.zeros(16, 8)
    assert not any(key.startswith("layers.3.") for key in adapter.from_hf(hf, DS))


@pytest.mark.parametrize("args", [QWEN, QWEN_MOE, dataclasses.replace(QWEN, tie_embeddings=True)],
                         ids=["dense", "moe", "tied"])
def test_qwen3_names_and_round_trip(args):
    adapter, state = get_model_spec("qwen3").hf_adapter, state_with_bias("qwen3", args)
    hf = adapter.to_hf(state, args)
    assert {"model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
            "model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"} <= set(hf)
    assert ("lm_head.weight" in hf) != args.tie_embeddings
    if args.moe:
        assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.3.up_proj.weight"} <= set(hf)
        assert not any("bias" in key for key in hf)  # HF Qwen3-MoE's router has none
    back = adapter.from_hf(hf, args)
    assert back.keys() == state.keys()
    for key in state:
        expected = torch.zeros_like(state[key]) if key.endswith("expert_bias") else state[key]
        assert torch.equal(back[key], expected), key
    model = get_model_spec("qwen3").build(args)
    model.load_state_dict(back)  # strict: every key, right shapes


def test_an_export_that_drops_the_learned_router_bias_says_so():
    """Qwen3-MoE's HF format has no router bias: exporting a model balanced by it loses state the
    logits depend on, which the exporters print (hf_export_note); DeepSeek-V3 keeps the bias."""
    note = hf_export_note(get_model_spec("qwen3"), QWEN_MOE)
    assert note and "no router bias" in note and "\n" not in note
    unbiased = dataclasses.replace(QWEN_MOE, moe=dataclasses.replace(QWEN_MOE.moe, bias_update_rate=0.0))
    assert hf_export_note(get_model_spec("qwen3"), unbiased) is None
    assert hf_export_note(get_model_spec("qwen3"), QWEN) is None
    assert hf_export_note(get_model_spec("deepseek_v3"), DS) is None


def test_incomplete_experts_and_unknown_keys_are_named():
    adapter = get_model_spec("qwen3").hf_adapter
    hf = adapter.to_hf(state_with_bias("qwen3", QWEN_MOE), QWEN_MOE)
    one_expert = {"model.layers.0.mlp.experts.1.gate_proj.weight": hf["model.layers.0.mlp.experts.1.gate_proj.weight"]}
    with pytest.raises(ValueError, match="layer 0 has 1 of 4 experts' gate_proj"):
        adapter.from_hf(one_expert, QWEN_MOE)
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.0.weight_scale_inv"):
        adapter.from_hf({"model.layers.0.mlp.experts.0.weight_scale_inv": torch.zeros(1)}, QWEN_MOE)
    with pytest.raises(ValueError, match="layers.0.moe.bogus"):
        adapter.to_hf({"layers.0.moe.bogus": torch.zeros(1)}, QWEN_MOE)


def test_router_gate_alone_brings_its_zero_bias():
    """A loader converting one HF tensor at a time still gets every model key: the bias-less
    format's gate weight converts to the gate and a zero bias."""
    adapter = get_model_spec("qwen3").hf_adapter
    gate = torch.randn(4, 16)
    assert set(adapter.from_hf({"model.layers.1.mlp.gate.weight": gate}, QWEN_MOE)) == {
        "layers.1.moe.router.gate.weight", "layers.1.moe.expert_bias"}
