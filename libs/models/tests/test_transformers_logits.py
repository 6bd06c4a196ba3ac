"""Each family against transformers itself: a tiny model transformers builds and saves opens in
Tessera (its config.json through the family's reader, its safetensors through the adapter) with
transformers' logits, and Tessera's export (config_from_args + to_hf) opens in transformers with
them again. Qwen3 with sliding windows on some layers, Qwen3-MoE on all (as transformers 5 places
them), and there the windows change the logits; GPT-OSS with sinks, biases and YaRN; DeepSeek-V3
with YaRN read from rope_scaling; DeepSeek-V2-Lite's layout. Each model is built for 16
positions, as the trainer builds it for its seq_len."""

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tessera.models import get_model_spec

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            max_position_embeddings=64, rms_norm_eps=1e-6)
WINDOW = 4  # shorter than the 12 tokens below: it changes what a query sees
CASES = {  # name: (family, transformers' class, its config)
    "llama3": ("llama3", transformers.LlamaForCausalLM,
               transformers.LlamaConfig(**TINY, num_key_value_heads=2, rope_theta=500000.0)),
    "deepseek_v3": ("deepseek_v3", transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(
        **TINY, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, num_nextn_predict_layers=0)),  # transformers saves no MTP weights
    # YaRN within its original context (transformers applies it at any length), a norm epsilon that
    # the latent norms do not take, and the group/shared-expert counts left to transformers' defaults
    "deepseek_v3_yarn": ("deepseek_v3", transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(
        **{**TINY, "rms_norm_eps": 0.1}, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=16,
        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, num_nextn_predict_layers=0,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})),
    # DeepSeek-V2-Lite's layout: no query bottleneck, greedy softmax routing without renormalising, YaRN
    "deepseek_v2_lite": ("deepseek_v3", transformers.DeepseekV2ForCausalLM, transformers.DeepseekV2Config(
        **TINY, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})),
    "qwen3_windows": ("qwen3", transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        **TINY, num_key_value_heads=2, head_dim=8, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=2)),
    "qwen3_moe_windows": ("qwen3", transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        **TINY, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        norm_topk_prob=True, use_sliding_window=True, sliding_window=WINDOW)),
    # sinks and biases everywhere, windows on every other layer, YaRN with fractional ramp ends
    "gpt_oss": ("gpt_oss", transformers.GptOssForCausalLM, transformers.GptOssConfig(
        **{**TINY, "intermediate_size": 24, "max_position_embeddings": 131072}, num_key_value_heads=2, head_dim=8,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})),
}


def _open(hf_cls, folder):
    # transformers 5.25 defaults to hub kernels, which this offline venv lacks
    return hf_cls.from_pretrained(folder, attn_implementation="eager", use_kernels=False).eval()


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers_both_ways(case, tmp_path):
    family, hf_cls, config = CASES[case]
    torch.manual_seed(0)
    written = hf_cls(config)
    with torch.no_grad():  # every weight, bias, sink, norm and router bias off its init, so each one's mapping matters
        router_biases = [b for name, b in written.named_buffers() if name.endswith("e_score_correction_bias")]
        for tensor in [*written.parameters(), *router_biases]:
            tensor.add_(torch.randn_like(tensor) * 0.1)
    written.save_pretrained(tmp_path / "hf")
    reference = _open(hf_cls, tmp_path / "hf")
    spec = get_model_spec(family)
    args = spec.hf_config.args_from_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    args = dataclasses.replace(args, max_seq_len=16)  # as the trainer sets its seq_len
    model = spec.build(args).eval()
    model.load_state_dict(spec.hf_adapter.from_hf(load_file(tmp_path / "hf" / "model.safetensors"), args))
    tokens = torch.randint(0, TINY["vocab_size"], (2, 12))
    with torch.no_grad():
        want = reference(tokens).logits
        torch.testing.assert_close(model(tokens), want, rtol=1e-5, atol=1e-5)
        (tmp_path / "back").mkdir()
        (tmp_path / "back" / "config.json").write_text(json.dumps(spec.hf_config.config_from_args(args)))
        save_file(spec.hf_adapter.to_hf(model.state_dict(), args), tmp_path / "back" / "model.safetensors")
        torch.testing.assert_close(_open(hf_cls, tmp_path / "back")(tokens).logits, want, rtol=1e-5, atol=1e-5)
        if case.endswith("_windows") or case == "gpt_oss":  # the windows are taken, not merely accepted
            assert args.window_layers
            global_model = spec.build(dataclasses.replace(args, sliding_window=None, window_layers=())).eval()
            global_model.load_state_dict(model.state_dict())
            assert (global_model(tokens) - want).abs().max() > 1e-3
