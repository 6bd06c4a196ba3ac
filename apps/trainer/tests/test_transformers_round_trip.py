"""transformers -> trainer -> transformers, for GPT-OSS, Llama 4 and DeepSeek-V3: a tiny model transformers wrote
(save_pretrained, the embedded tokenizer's files beside it) gives a run its architecture (model.flavor
from_hf_config) and its weights (initial_load_in_hf from model.hf_assets_path); imported, the model
gives transformers' logits; it trains a step and exports (last_save_in_hf), and transformers opens the
export with the trained model's logits. Where the HF format has no router bias (hf_adapter.export_note:
GPT-OSS, Llama 4) the export is compared with the trained model's logits with that bias zeroed, and
says so in one warning line. transformers' DeepSeek-V3 config.json names a multi-token-prediction
module whose weights it does not save: the run trains without it and says so. One process, fp32, within 1e-5 absolute (HF adapters' layouts: tests/test_moe_hf.py)."""

import pytest
import torch
import transformers

from tessera.data import hf_tokenizer_files, load_tokenizer
from tessera.models import get_model_spec
from tessera.models.spec import hf_export_note
from tessera.trainer.checkpointing import Checkpointer
from tessera.trainer.config import load_config
from tessera.trainer.train import train

VOCAB, SEQ = 2048, 16  # the embedded tokenizer's vocabulary; sequences longer than the windows and chunks
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             rms_norm_eps=1e-6)
MODELS = {  # family: transformers' class and config
    # one window layer (4 keys), one full; sinks and biases; YaRN
    "gpt_oss": (transformers.GptOssForCausalLM, transformers.GptOssConfig(
        **SHAPE, intermediate_size=24, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})),
    # chunks of 4 tokens on layers 0-2, NoPE with temperature tuning on 3; MoE on 1 and 3, dense on 0 and 2
    "llama4": (transformers.Llama4ForCausalLM, transformers.Llama4TextConfig(
        **SHAPE, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=4, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=4, floor_scale=4, attn_scale=0.5,
        max_position_embeddings=64, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})),
    # MLA, sigmoid group-limited routing with its correction bias, a dense first layer, YaRN within its
    # original context (transformers applies it at any length, so the run at SEQ must too)
    "deepseek_v3": (transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=1, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                      "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})),
}
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _open(hf_cls, folder):
    # transformers 5.25 defaults to hub kernels, which this offline venv lacks
    return hf_cls.from_pretrained(folder, attn_implementation="eager", use_kernels=False).eval()


def _logits(model, zero_router_bias: bool = False) -> torch.Tensor:
    """The model's logits on TOKENS in eval mode (no expert load counted), optionally as if its
    router biases were zero; the model is left as it was."""
    biases = {name: b.clone() for name, b in model.named_buffers() if name.endswith("expert_bias")}
    with torch.no_grad():
        for name in biases if zero_router_bias else ():
            model.get_buffer(name).zero_()
        logits = model.eval()(TOKENS)
        model.train()
        for name, bias in biases.items():
            model.get_buffer(name).copy_(bias)
    return logits


@pytest.mark.parametrize("family", sorted(MODELS))
def test_transformers_model_trains_and_exports_back(family, tmp_path, monkeypatch, capsys):
    hf_cls, hf_config = MODELS[family]
    torch.manual_seed(0)
    written = hf_cls(hf_config)
    with torch.no_grad():  # every weight, bias, sink and norm off its init, so each one's mapping matters
        for param in written.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    written.save_pretrained(tmp_path / "hf")
    for name, content in hf_tokenizer_files(load_tokenizer()).items():
        (tmp_path / "hf" / name).write_bytes(content)
    with torch.no_grad():
        want = _open(hf_cls, tmp_path / "hf")(TOKENS).logits

    captured = {}
    restore, export = Checkpointer.restore, Checkpointer._export_hf

    def restore_and_capture(self):
        step = restore(self)
        captured["imported"] = _logits(self.parts[0])
        return step

    def capture_then_export(self, step):
        model = self.parts[0]
        captured["biases"] = [b.clone() for name, b in model.named_buffers() if name.endswith("expert_bias")]
        captured["trained"], captured["unbiased"] = _logits(model), _logits(model, zero_router_bias=True)
        captured["note"] = hf_export_note(self.spec, self.args)
        export(self, step)

    monkeypatch.setattr(Checkpointer, "restore", restore_and_capture)
    monkeypatch.setattr(Checkpointer, "_export_hf", capture_then_export)
    train(load_config([
        "--model.name", family, "--model.flavor", "from_hf_config", "--model.hf_assets_path", str(tmp_path / "hf"),
        "--checkpoint.initial_load_in_hf", "true", "--checkpoint.enable", "true", "--checkpoint.last_save_in_hf", "true",
        "--training.seq_len", str(SEQ), "--training.local_batch_size", "2", "--training.steps", "1",
        "--lr_scheduler.warmup_steps", "1", "--training.mixed_precision_param", "float32",
        "--job.dump_folder", str(tmp_path / "run")]))

    torch.testing.assert_close(captured["imported"], want, rtol=0, atol=1e-5)
    assert (captured["trained"] - want).abs().max() > 1e-3  # the step moved it: the export check bites
    assert captured["biases"] and all(b.abs().sum() > 0 for b in captured["biases"])  # balancing learned a bias
    out = capsys.readouterr().out
    note = captured["note"]  # what the export cannot hold: the router bias, or nothing (DeepSeek-V3 keeps it)
    assert (f"checkpoint: warning: {note}\n" in out) == bool(note)
    assert ("multi-token-prediction module(s) whose weights" in out) == (family == "deepseek_v3")
    with torch.no_grad():
        exported = _open(hf_cls, tmp_path / "run" / "checkpoint" / "step-1-hf")(TOKENS).logits
    torch.testing.assert_close(exported, captured["unbiased" if note else "trained"], rtol=0, atol=1e-5)
