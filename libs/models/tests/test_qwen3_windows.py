"""Qwen3 as transformers 5 writes it: sliding windows (`use_sliding_window`, `sliding_window`,
`max_window_layers`, `layer_types`) on the layers transformers puts them on, and Qwen3-MoE's
`num_local_experts` (logits against transformers' models with windows: test_transformers_logits)."""

import dataclasses

import pytest
import transformers

from tessera.models import get_model_spec
from tessera.models.masks import AttentionMask
from tessera.models.qwen3 import hf_config

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6)
TINY_MOE = dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True)
WINDOW = 4  # shorter than the 12 tokens below: it changes what a query sees


def _windowed(config: dict) -> tuple[int | None, tuple[int, ...]]:
    args = hf_config.args_from_config(config)
    return args.sliding_window, args.window_layers


@pytest.mark.parametrize("kwargs, layers", [
    (dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2), (2, 3)),
    (dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0), (0, 1, 2, 3)),
    (dict(use_sliding_window=True, sliding_window=WINDOW,
          layer_types=["sliding_attention", "full_attention"] * 2), (0, 2)),
    (dict(use_sliding_window=False, sliding_window=WINDOW, max_window_layers=0), ()),
])
def test_window_layers_are_the_ones_transformers_writes(kwargs, layers):
    config = transformers.Qwen3Config(**TINY, **kwargs).to_dict()
    written = tuple(i for i, kind in enumerate(config["layer_types"]) if kind == "sliding_attention")
    assert written == layers
    assert _windowed(config) == ((WINDOW, layers) if layers else (None, ()))
    # transformers 4's file: no layer_types, the windows from max_window_layers on
    if "max_window_layers" in kwargs:
        assert _windowed({k: v for k, v in config.items() if k != "layer_types"}) == _windowed(config)


def test_qwen3_moe_reads_either_experts_spelling_and_windows_every_layer():
    config = transformers.Qwen3MoeConfig(**TINY_MOE, use_sliding_window=True, sliding_window=WINDOW).to_dict()
    assert "num_local_experts" in config and "num_experts" not in config  # transformers 5's spelling
    args = hf_config.args_from_config(config)
    assert args.moe.n_experts == 4 and (args.sliding_window, args.window_layers) == (WINDOW, (0, 1, 2, 3))
    v4 = {**{k: v for k, v in config.items() if k != "num_local_experts"}, "num_experts": 4}
    assert hf_config.args_from_config(v4) == args
    with pytest.raises(ValueError, match=r"cannot put sliding windows on some layers only: \(1,\)$"):
        hf_config.config_from_args(dataclasses.replace(args, window_layers=(1,)))


def test_a_bad_layer_types_list_is_one_line():
    config = transformers.Qwen3Config(**TINY, use_sliding_window=True, sliding_window=WINDOW).to_dict()
    with pytest.raises(ValueError, match=r"^c: layer_types must list 4 of 'sliding_attention' / 'full_attention'"):
        hf_config.args_from_config({**config, "layer_types": ["sliding_attention"]}, "c")


def test_attention_kinds_and_flops_count_the_window():
    spec = get_model_spec("qwen3")
    args = dataclasses.replace(spec.flavors["tiny"], sliding_window=16, window_layers=(4, 5))
    assert spec.attention_kinds(args) == ((AttentionMask(), False), (AttentionMask(window=16), False))
    plain = spec.flavors["tiny"]
    per_layer_key = 12 * args.n_heads * args.head_dim
    assert spec.flops_per_token(plain, 64) - spec.flops_per_token(args, 64) == 2 * per_layer_key * (64 - 16)
    assert spec.flops_per_token(plain, 8) == spec.flops_per_token(args, 8)  # windows longer than the sequence
