import dataclasses

import pytest
import torch
from torch import nn

import tessera.models as models
from tessera.models import ModelSpec, get_model_spec, list_model_specs, register_model_spec


def test_llama_specs_registered():
    assert {"llama2", "llama3"} <= set(list_model_specs())
    assert "debugmodel" in get_model_spec("llama2").flavors


def test_unknown_model_names_it_and_the_registered():
    with pytest.raises(ValueError, match=r"'nope'.*llama2.*llama3"):
        get_model_spec("nope")


def test_tp_plan_patterns_match_real_modules():
    spec = get_model_spec("llama3")
    model = spec.build(spec.flavors["debugmodel"])
    names = {name for name, _ in model.named_modules()}
    for pattern in spec.tp_plan:
        assert pattern.replace("*", "0") in names, pattern
    assert spec.tp_plan["layers.*.attention.wo"] == "rowwise" and spec.tp_plan["output"] == "vocab_output"
    args = spec.flavors["8B"]
    assert spec.tp_divisible(args) == {"n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256, "ffn_hidden_dim": 14336}


@dataclasses.dataclass(frozen=True)
class MLPArgs:
    dim: int = 8
    vocab_size: int = 16
    max_seq_len: int = 4


class TinyLM(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        return self.output(self.tok_embeddings(tokens))


def custom_spec(name, **changes):
    fields = dict(
        name=name,
        flavors={"tiny": MLPArgs()},
        build=TinyLM,
        flops_per_token=lambda args, seq_len: 6 * args.dim * args.vocab_size,
        tp_plan={"tok_embeddings": "vocab_embedding", "output": "vocab_output"},
        tp_divisible=lambda args: {"vocab_size": args.vocab_size},
    )
    return ModelSpec(**{**fields, **changes})


def test_register_custom_spec_and_errors():
    register_model_spec(custom_spec("test_tiny_lm"))
    spec = get_model_spec("test_tiny_lm")
    args = dataclasses.replace(spec.flavors["tiny"], vocab_size=32)
    assert spec.build(args)(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 32)
    assert models.num_params(spec.build(args), exclude_embedding=True) == 8 * 32
    with pytest.raises(ValueError, match="'test_tiny_lm' is already registered"):
        register_model_spec(custom_spec("test_tiny_lm"))
