import pytest
import torch

from tessera.models import get_model_spec, num_params
from tessera.models.llama import ModelArgs, Transformer, flops_per_token

# Published sizes (llama3 1B/3B have tied embeddings, counted once).
EXPECTED_PARAMS = {
    ("llama2", "7B"): 6.74e9,
    ("llama2", "13B"): 13.02e9,
    ("llama2", "70B"): 68.98e9,
    ("llama3", "1B"): 1.24e9,
    ("llama3", "3B"): 3.21e9,
    ("llama3", "8B"): 8.03e9,
    ("llama3", "70B"): 70.6e9,
    ("llama3", "405B"): 405.9e9,
}


@pytest.mark.parametrize("family", ["llama2", "llama3"])
def test_every_flavor_builds_on_meta(family):
    spec = get_model_spec(family)
    for flavor, args in spec.flavors.items():
        with torch.device("meta"):
            model = spec.build(args)
        count = num_params(model)
        if (family, flavor) in EXPECTED_PARAMS:
            assert count == pytest.approx(EXPECTED_PARAMS[family, flavor], rel=0.01), flavor
        assert model.args.tie_embeddings == (model.output.weight is model.tok_embeddings.weight)
        assert len(model.rope) == args.max_seq_len


def test_known_hidden_sizes():
    llama3 = get_model_spec("llama3").flavors
    assert get_model_spec("llama2").flavors["7B"].ffn_hidden_dim == 11008
    assert get_model_spec("llama2").flavors["70B"].ffn_hidden_dim == 28672
    assert llama3["8B"].ffn_hidden_dim == 14336
    assert llama3["405B"].ffn_hidden_dim == 53248
    assert llama3["1B"].ffn_hidden_dim == 8192 and llama3["3B"].ffn_hidden_dim == 8192
    assert llama3["1B"].rope_scaling.factor == 32 and llama3["8B"].rope_scaling.factor == 8


def test_flops_per_token_on_a_small_config():
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, multiple_of=16)
    # Hand count: head_dim 8, kv dim 16, ffn hidden int(2*128/3)=85 -> 96.
    per_layer = 32 * 32 + 2 * (32 * 16) + 32 * 32 + 3 * 32 * 96 + 2 * 32
    non_embedding = 2 * per_layer + 32 + 32 * 50
    seq_len = 10
    expected = 6 * non_embedding + 12 * 2 * 4 * 8 * seq_len
    assert flops_per_token(args, seq_len) == expected
    assert get_model_spec("llama3").flops_per_token(args, seq_len) == expected
    assert num_params(Transformer(args), exclude_embedding=True) == non_embedding
