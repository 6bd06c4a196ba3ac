import copy
from dataclasses import replace

import pytest
import torch

from tessera.models.llama import ModelArgs, Transformer

TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=101, multiple_of=16, max_seq_len=16)


def tiny_model(args=TINY, seed=0):
    torch.manual_seed(seed)
    return Transformer(args)


def test_logits_shape_and_dtype():
    model = tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, TINY.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_module_names():
    names = {name for name, _ in tiny_model().named_parameters()}
    assert {
        "tok_embeddings.weight",
        "layers.1.attention_norm.weight",
        "layers.1.attention.wq.weight",
        "layers.1.attention.wk.weight",
        "layers.1.attention.wv.weight",
        "layers.1.attention.wo.weight",
        "layers.1.ffn_norm.weight",
        "layers.1.feed_forward.w1.weight",
        "layers.1.feed_forward.w2.weight",
        "layers.1.feed_forward.w3.weight",
        "norm.weight",
        "output.weight",
    } <= names
    assert not any(name.endswith("bias") for name in names)
    assert "rope" not in tiny_model().state_dict()


def test_changing_future_tokens_leaves_past_logits_unchanged():
    model = tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % TINY.vocab_size
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = tiny_model()
    mha_args = replace(TINY, n_kv_heads=None)
    mha = Transformer(mha_args)
    n_rep, head_dim = TINY.n_heads // TINY.kv_heads, TINY.head_dim
    state = gqa.state_dict()
    for key, w in list(state.items()):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            # kv head j serves query heads j*n_rep .. j*n_rep + n_rep - 1.
            state[key] = w.view(TINY.kv_heads, head_dim, TINY.dim).repeat_interleave(n_rep, 0).reshape(-1, TINY.dim)
    mha.load_state_dict(state)
    tokens = torch.randint(0, TINY.vocab_size, (2, 9))
    torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_pipeline_stages_compose_to_full_model():
    model = tiny_model()
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    del first.layers["1"]
    first.norm = first.output = None
    del last.layers["0"]
    last.tok_embeddings = None
    tokens = torch.randint(0, TINY.vocab_size, (2, 8))
    hidden = first(tokens)
    assert hidden.shape == (2, 8, TINY.dim)
    torch.testing.assert_close(last(hidden), model(tokens))
    # A stage initialises what it still holds.
    last.init_weights()
    first.init_weights()
    assert list(last.layers) == ["1"] and torch.isfinite(last(hidden)).all()


def test_bfloat16_model_keeps_complex_rope():
    model = tiny_model()
    with pytest.warns(UserWarning, match="imaginary"):
        model.to(torch.bfloat16)
    assert model.rope.dtype == torch.complex64
    logits = model(torch.randint(0, TINY.vocab_size, (1, 5)))
    assert logits.dtype == torch.bfloat16


def test_bad_args_name_the_field():
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        ModelArgs(dim=64, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads=5"):
        ModelArgs(dim=64, n_heads=5)
