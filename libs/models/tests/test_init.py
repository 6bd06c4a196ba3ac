import math
from dataclasses import replace

import pytest
import torch

from tessera.models.llama import ModelArgs, Transformer, precompute_freqs_cis

TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=8)


def meta_then_init(args, seed):
    with torch.device("meta"):
        model = Transformer(args)
    assert model.output.weight.is_meta
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_meta_init_is_finite_and_seeded():
    a, b, c = meta_then_init(TINY, 0), meta_then_init(TINY, 0), meta_then_init(TINY, 1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.isfinite(pa).all(), name
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    torch.testing.assert_close(a.rope, precompute_freqs_cis(TINY.head_dim, TINY.max_seq_len, TINY.rope_theta))
    assert torch.isfinite(a(torch.randint(0, TINY.vocab_size, (1, 8)))).all()


def test_init_stds():
    args = replace(TINY, dim=256, n_heads=4, n_kv_heads=None, n_layers=4)
    model = meta_then_init(args, 0)
    assert torch.all(model.norm.weight == 1) and torch.all(model.layers["1"].ffn_norm.weight == 1)
    assert abs(model.tok_embeddings.weight.std().item() - 1.0) < 0.05
    assert abs(model.layers["0"].attention.wq.weight.std().item() - 0.02) < 0.002
    # what writes into the residual stream: depth_init, 0.02 / sqrt(2 (layer + 1)); without it,
    # 0.02 / sqrt(2 n_layers) in every layer (4 layers: the two differ in layers 0 and 3)
    flat = meta_then_init(replace(args, depth_init=False), 0)
    for layer in (0, 3):
        for weights, std in ((model, 0.02 / (2 * (layer + 1)) ** 0.5), (flat, 0.02 / 8**0.5)):
            block = weights.layers[str(layer)]
            for linear in (block.feed_forward.w2, block.attention.wo):
                assert abs(linear.weight.std().item() - std) < 0.1 * std, (layer, std)
    out_std = args.dim**-0.5
    assert model.output.weight.abs().max().item() <= 3 * out_std
    assert abs(model.output.weight.std().item() - out_std * 0.986) < 0.1 * out_std  # std of a 3-sigma cut normal


def test_tied_embeddings_share_storage_after_to_empty():
    args = replace(TINY, tie_embeddings=True)
    model = meta_then_init(args, 0)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    # The tied weight is counted once and gets Hugging Face's init for tied families: normal, std 0.02.
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in Transformer(TINY).parameters()) - TINY.vocab_size * TINY.dim
    assert abs(model.output.weight.std().item() - 0.02) < 0.002


@pytest.mark.parametrize("flavor", ["tiny", "tiny_moe"])
def test_qwen3_debug_models_start_near_ln_vocab(flavor):
    """The first loss on random tokens is near ln(vocab) (7.62 for 2048; the untied families start
    near 8.1): the tied dense flavor started at 10.4 when its shared weight took the output's
    init (each token's own logit then sqrt(dim) = 16)."""
    from tessera.models import get_model_spec

    spec = get_model_spec("qwen3")
    args = spec.flavors[flavor]
    torch.manual_seed(0)
    model = spec.build(args)
    tokens = torch.randint(args.vocab_size, (4, 64))
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    assert abs(loss.item() - math.log(args.vocab_size)) < 0.6, loss.item()
