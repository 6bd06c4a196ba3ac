"""Hugging Face config.json <-> Llama ModelArgs: transformers 4 and 5 layouts, exact shapes,
Llama 3.1 RoPE frequencies, flavor checks, refusals, and the model args record."""

import dataclasses
import json
import math
import re

import pytest
import torch

from tessera.models import ARGS_FILE, args_record, get_model_spec, read_args_record, read_hf_config
from tessera.models.llama import ModelArgs, RopeScaling, Transformer, llama2_flavors, llama3_flavors, rope_frequencies
from tessera.models.llama.hf_config import args_from_config, check_config, config_from_args

# Llama 3.1 8B's config.json as transformers 4 writes it.
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0",
    "use_cache": True, "vocab_size": 128256,
}
# A small Llama with Llama 3.1 scaling, as transformers 5 writes it (rope_theta inside rope_parameters).
# intermediate_size 200 is no multiple_of rounding of 256's 2/3 * 4 * dim.
SMALL_V5 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 200,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 16384, "rms_norm_eps": 1e-06, "vocab_size": 96, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "dtype": "bfloat16", "transformers_version": "5.0.0",
}


def v4_of(v5):
    """The same model as transformers 4 writes it: rope_theta on top, "type" in rope_scaling."""
    config = {k: v for k, v in v5.items() if k != "rope_parameters"}
    params = dict(v5["rope_parameters"])
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    return config


def test_rope_scaling_comes_before_rope_parameters_as_in_transformers_5():
    """A transformers-4 rope_scaling block added to a transformers-5 config is the one transformers
    applies (its rope_parameters are replaced, theta read from the top level)."""
    default = {**SMALL_V5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_theta": 500000.0}
    scaled = {**default, "rope_scaling": {k: v for k, v in SMALL_V5["rope_parameters"].items() if k != "rope_theta"}}
    assert args_from_config(default, "c").rope_scaling is None
    assert args_from_config(scaled, "c") == args_from_config(SMALL_V5, "c")


def test_a_top_level_original_context_comes_before_the_rope_sections_as_in_transformers_5():
    """transformers takes a scaled RoPE's original_max_position_embeddings from the top level of
    config.json (where Phi-3 writes it) before the rope section's own: the frequencies follow it."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for config in ({**SMALL_V5, "original_max_position_embeddings": 2048},
                   {**v4_of(SMALL_V5), "original_max_position_embeddings": 2048}):
        args = args_from_config(config, "c")
        assert args.rope_scaling.original_max_position_embeddings == 2048
        want, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig.from_dict(json.loads(json.dumps(config))))  # it edits
        torch.testing.assert_close(rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling).float(), want,
                                   rtol=1e-6, atol=0)


def llama31_reference(head_dim, theta, factor, low, high, old_len):
    """Meta's Llama 3.1 frequency scaling, written out per frequency in float64."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("config", [SMALL_V5, v4_of(SMALL_V5)], ids=["transformers5", "transformers4"])
def test_both_layouts_give_the_architecture_and_the_llama31_frequencies(config):
    args = args_from_config(config, "small/config.json")
    assert args == ModelArgs(dim=256, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=96, ffn_dim=200, norm_eps=1e-6,
                             rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), max_seq_len=16384,
                             tie_embeddings=True)
    assert (args.head_dim, args.ffn_hidden_dim) == (128, 200)
    with torch.device("meta"):
        model = Transformer(args)
    assert model.layers["0"].feed_forward.w1.weight.shape == (200, 256)  # intermediate_size exactly
    assert model.layers["0"].attention.wk.weight.shape == (128, 256)  # one K/V head
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling).double()
    reference = llama31_reference(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    torch.testing.assert_close(freqs, reference, rtol=1e-6, atol=0)
    plain = llama31_reference(128, 500000.0, 1.0, 1.0, 4.0, 8192)  # factor 1: unscaled
    kept, divided = torch.isclose(reference, plain), torch.isclose(reference, plain / 8)
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # all three bands are exercised


def test_llama2_layout_without_scaling_and_llama_defaults():
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 1,
              "num_attention_heads": 4, "vocab_size": 32, "rope_scaling": None}
    args = args_from_config(config)
    assert (args.kv_heads, args.norm_eps, args.rope_theta, args.rope_scaling, args.max_seq_len, args.tie_embeddings) == \
        (4, 1e-6, 10000.0, None, 2048, False)  # LlamaConfig's defaults
    head_dim = args.head_dim
    expected = torch.tensor([10000.0 ** (-i / head_dim) for i in range(0, head_dim, 2)], dtype=torch.float64)
    torch.testing.assert_close(rope_frequencies(head_dim, args.rope_theta, args.rope_scaling).double(), expected, rtol=1e-6, atol=0)
    assert args_from_config({**config, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}).rope_theta == 1e6


@pytest.mark.parametrize("flavors, name", [(llama3_flavors, n) for n in ("1B", "3B", "8B", "70B", "405B")]
                         + [(llama2_flavors, n) for n in ("7B", "13B", "70B")])
def test_every_flavor_round_trips_through_config_json(flavors, name):
    flavor = flavors[name]
    config = json.loads(json.dumps(config_from_args(flavor, dtype="bfloat16")))
    check_config(flavor, config, "config.json", name)  # the same architecture, field by field
    back = args_from_config(config)
    assert back == dataclasses.replace(flavor, n_kv_heads=flavor.kv_heads, multiple_of=back.multiple_of,
                                       ffn_dim_multiplier=None, ffn_dim=flavor.ffn_hidden_dim)
    assert args_from_config(json.loads(json.dumps(config_from_args(back)))) == back
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"


def test_the_published_llama31_8b_config_is_the_8b_flavor():
    check_config(llama3_flavors["8B"], LLAMA31_8B, "Llama-3.1-8B/config.json", "llama3/8B")
    config = config_from_args(args_from_config(LLAMA31_8B), dtype="bfloat16", bos_token_id=128000, eos_token_id=128001)
    assert {k: v for k, v in config.items() if k != "head_dim"} == \
        {k: v for k, v in LLAMA31_8B.items() if k not in ("attention_dropout", "initializer_range", "pretraining_tp",
                                                           "transformers_version", "use_cache")}


def test_a_mismatching_flavor_names_the_first_field_and_both_values():
    with pytest.raises(ValueError) as error:
        check_config(llama3_flavors["8B"], {**LLAMA31_8B, "num_hidden_layers": 16}, "x/config.json", "llama3/8B")
    assert str(error.value) == "x/config.json: num_hidden_layers is 16 but llama3/8B has n_layers 32"
    with pytest.raises(ValueError, match=r"x: rope_scaling is RopeScaling\(factor=32.0.* but llama3/8B has rope_scaling RopeScaling\(factor=8.0"):
        check_config(llama3_flavors["8B"], {**LLAMA31_8B, "rope_scaling": {**LLAMA31_8B["rope_scaling"], "factor": 32.0}}, "x", "llama3/8B")
    with pytest.raises(ValueError, match="x: intermediate_size is 14337 but llama3/8B has ffn_hidden_dim 14336"):
        check_config(llama3_flavors["8B"], {**LLAMA31_8B, "intermediate_size": 14337}, "x", "llama3/8B")


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral"}, "c.json: model_type 'mistral' is not supported, only 'llama'"),
    ({"hidden_act": "gelu"}, "c.json: hidden_act 'gelu' is not supported, only 'silu'"),
    ({"attention_bias": True}, "c.json: attention_bias True is not supported, only False"),
    ({"mlp_bias": True}, "c.json: mlp_bias True is not supported, only False"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "c.json: rope_scaling.rope_type 'yarn' is not supported"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
     "c.json: rope_parameters.rope_type 'linear' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "c.json: rope_scaling.low_freq_factor is missing"),
    ({"head_dim": 64}, "c.json: head_dim 64 is not supported: Tessera's Llama uses hidden_size / num_attention_heads = 4096 / 32"),
    ({"hidden_size": None}, "c.json: hidden_size is missing"),
    ({"num_hidden_layers": "32"}, "c.json: num_hidden_layers '32' is not an integer"),
    ({"vocab_size": 0}, "c.json: vocab_size 0 must be positive"),
    ({"tie_word_embeddings": "no"}, "c.json: tie_word_embeddings 'no' is not true or false"),
    ({"num_key_value_heads": 5}, "c.json: ModelArgs: n_heads=32 is not divisible by n_kv_heads=5"),
])
def test_what_tessera_cannot_express_is_one_line_naming_the_file_and_field(change, message):
    with pytest.raises(ValueError) as error:
        args_from_config({**LLAMA31_8B, **change}, "c.json")
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_read_hf_config_errors_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMALL_V5))
    assert read_hf_config(tmp_path) == read_hf_config(tmp_path / "config.json") == SMALL_V5
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'empty' / 'config.json'} does not exist")):
        read_hf_config(tmp_path / "empty")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'none'} does not exist")):
        read_hf_config(tmp_path / "none")
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="config.json is not readable JSON: Expecting property name"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="config.json holds a JSON list, not an object"):
        read_hf_config(tmp_path)


def test_args_record_round_trips_and_refuses_garbage(tmp_path):
    spec = get_model_spec("llama3")
    args = dataclasses.replace(llama3_flavors["1B"], vocab_size=40, ffn_dim=96)
    (tmp_path / ARGS_FILE).write_bytes(args_record(spec, args, flavor="1B", bos_token_id=3))
    found_spec, found_args, record = read_args_record(tmp_path)
    assert found_spec is spec and found_args == args and (record["flavor"], record["bos_token_id"]) == ("1B", 3)
    assert read_args_record(tmp_path / "elsewhere") is None
    for field, value, message in (("n_layers", "2", "ModelArgs.n_layers '2' is not an int"),
                                  ("norm_eps", True, "ModelArgs.norm_eps True is not a number"),
                                  ("rope_scaling", {"factor": "8"}, "RopeScaling.factor '8' is not a number")):
        (tmp_path / ARGS_FILE).write_text(json.dumps({**record, "args": {**record["args"], field: value}}))
        with pytest.raises(ValueError, match=re.escape(f"model_args.json: {message}")):  # not a TypeError in the model
            read_args_record(tmp_path)
    record["args"]["wings"] = 2
    (tmp_path / ARGS_FILE).write_text(json.dumps(record))
    with pytest.raises(ValueError, match="model_args.json: 'wings' is not a field of ModelArgs"):
        read_args_record(tmp_path)
    (tmp_path / ARGS_FILE).write_text(json.dumps({"model": "gpt9", "args": {}}))
    with pytest.raises(ValueError, match="model_args.json: unknown model 'gpt9'"):
        read_args_record(tmp_path)
    (tmp_path / ARGS_FILE).write_text("{}")
    with pytest.raises(ValueError, match="model_args.json is not a model args record: KeyError"):
        read_args_record(tmp_path)
