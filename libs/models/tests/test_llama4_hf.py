"""Llama 4 against transformers itself: a tiny ``Llama4ForCausalLM`` (chunked layers shorter than
the sequence, a NoPE layer past its temperature floor, Scout's Llama 3.1 RoPE scaling, MoE and
dense layers) saved by transformers opens in Tessera through the config reader and the adapter
with transformers' logits, and Tessera's export opens in transformers with them again. Also: the
released multimodal layout (``language_model.*``, vision tensors beside) imports one tensor at a
time, and the config reader takes both transformers layouts and refuses what it cannot build."""

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tessera.models import get_model_spec
from tessera.models.llama4 import hf_config

SPEC = get_model_spec("llama4")
ROPE = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
        "original_max_position_embeddings": 16}
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2, attention_chunk_size=4, floor_scale=4, attn_scale=0.5,
            max_position_embeddings=64, rope_parameters={"rope_theta": 500000.0, **ROPE})


def _open(folder):
    # transformers 5.25 defaults to hub kernels, which this offline venv lacks
    return transformers.Llama4ForCausalLM.from_pretrained(folder, attn_implementation="eager", use_kernels=False).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama4") / "hf"
    torch.manual_seed(0)
    transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**TINY)).save_pretrained(folder)
    return folder


def test_logits_equal_transformers_both_ways(saved, tmp_path):
    reference = _open(saved)
    args = SPEC.hf_config.args_from_config(json.loads((saved / "config.json").read_text()))
    assert (args.moe_layers, args.nope_layers, args.chunked_layers) == ((1, 3), (3,), (0, 1, 2))
    model = SPEC.build(args).eval()
    model.load_state_dict(SPEC.hf_adapter.from_hf(load_file(saved / "model.safetensors"), args))
    tokens = torch.randint(0, TINY["vocab_size"], (2, 12))
    with torch.no_grad():
        want = reference(tokens).logits
        torch.testing.assert_close(model(tokens), want, rtol=1e-5, atol=1e-5)
        (tmp_path / "back").mkdir()
        (tmp_path / "back" / "config.json").write_text(json.dumps(SPEC.hf_config.config_from_args(args)))
        save_file(SPEC.hf_adapter.to_hf(model.state_dict(), args), tmp_path / "back" / "model.safetensors")
        torch.testing.assert_close(_open(tmp_path / "back")(tokens).logits, want, rtol=1e-5, atol=1e-5)
        # the chunks and the temperature are taken, not merely accepted
        for change in (dict(chunked_layers=(), attention_chunk_size=None), dict(attn_temperature_tuning=False)):
            other = SPEC.build(dataclasses.replace(args, **change)).eval()
            other.load_state_dict(model.state_dict())
            assert (other(tokens) - want).abs().max() > 1e-4


def test_multimodal_layout_imports_tensor_by_tensor(saved):
    """The released checkpoints: the text stack under ``language_model.``, fused experts, and
    vision tensors that the import skips; each tensor converts alone."""
    state = load_file(saved / "model.safetensors")
    args = SPEC.hf_config.args_from_config(json.loads((saved / "config.json").read_text()))
    released = {f"language_model.{key}": value for key, value in state.items()}
    released["vision_model.patch_embedding.linear.weight"] = torch.zeros(2, 2)
    assert state["model.layers.1.feed_forward.experts.gate_up_proj"].shape == (4, 32, 32)  # [E, dim, 2 hidden]
    one_by_one = {}
    for key, value in released.items():
        one_by_one.update(SPEC.hf_adapter.from_hf({key: value}, args))
    whole = SPEC.hf_adapter.from_hf(state, args)
    assert one_by_one.keys() == whole.keys() == SPEC.build(args).state_dict().keys()
    assert all(torch.equal(one_by_one[key], whole[key]) for key in whole)
    with pytest.raises(ValueError, match=r"fuses layers\.1\.moe\.experts\.w1 and w3: pass both in one call$"):
        SPEC.hf_adapter.to_hf({"layers.1.moe.experts.w1": whole["layers.1.moe.experts.w1"]}, args)
    # what a streaming exporter must hand over together (tessera.ckpt.export_hf's `together`)
    groups = {key: SPEC.hf_adapter.export_group(key, args) for key in whole}
    assert {key: group for key, group in groups.items() if group} == {
        f"layers.{i}.moe.experts.{w}": f"model.layers.{i}.feed_forward.experts.gate_up_proj" for i in (1, 3) for w in ("w1", "w3")}


def test_config_reader_takes_both_layouts_and_the_multimodal_config():
    v5 = transformers.Llama4TextConfig(**TINY).to_dict()
    args = hf_config.args_from_config(v5)
    v4 = {**{k: v for k, v in v5.items() if k not in ("rope_parameters", "layer_types")},
          "rope_theta": 500000.0, "rope_scaling": ROPE, "no_rope_layers": [], "attn_temperature_tuning": 4}
    assert hf_config.args_from_config(v4) == args
    no_theta = {k: v for k, v in v4.items() if k != "rope_theta"}  # Llama4TextConfig.default_theta, not 10000
    assert hf_config.args_from_config(no_theta) == args
    assert hf_config.args_from_config({"model_type": "llama4", "text_config": v5}) == args
    hf_config.check_config(args, hf_config.config_from_args(args), "c", "t")


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, r"^c: model_type 'llama' is not supported, only 'llama4_text'$"),
    ({"attention_bias": True}, r"^c: attention_bias True is not supported, only False$"),
    ({"layer_types": ["chunked_attention"]}, r"^c: layer_types has 1 entries for 4 layers$"),
    ({"attention_chunk_size": None, "layer_types": ["chunked_attention"] * 4},
     r"^c: layer_types has chunked_attention layers but attention_chunk_size is null$"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, r"^c: rope_parameters.rope_type 'yarn' is not"),
])
def test_bad_configs_are_one_line(change, message):
    with pytest.raises(ValueError, match=message):
        hf_config.args_from_config({**transformers.Llama4TextConfig(**TINY).to_dict(), **change}, "c")


def test_check_config_names_the_first_difference():
    args = SPEC.flavors["tiny"]
    config = {**hf_config.config_from_args(args), "intermediate_size": 256}
    with pytest.raises(ValueError, match=r"^c: intermediate_size is 256 but llama4/tiny has moe.hidden_dim 512$"):
        hf_config.check_config(args, config, "c", "llama4/tiny")
