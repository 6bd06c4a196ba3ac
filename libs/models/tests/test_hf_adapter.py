from dataclasses import replace

import pytest
import torch

from tessera.models import get_model_spec
from tessera.models.llama import ModelArgs, Transformer, apply_rotary_emb, precompute_freqs_cis

TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, multiple_of=16, max_seq_len=16)
adapter = get_model_spec("llama3").hf_adapter


def test_round_trip_is_identity_and_names_are_hf():
    state = Transformer(TINY).state_dict()
    hf = adapter.to_hf(state, TINY)
    assert {"model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight"} <= set(hf)
    assert len(hf) == len(state)
    back = adapter.from_hf(hf, TINY)
    assert back.keys() == state.keys()
    for key in state:
        assert torch.equal(back[key], state[key]), key


def test_tied_round_trip_drops_and_restores_lm_head():
    args = replace(TINY, tie_embeddings=True)
    model = Transformer(args)
    hf = adapter.to_hf(model.state_dict(), args)
    assert "lm_head.weight" not in hf
    fresh = Transformer(args)
    fresh.load_state_dict(adapter.from_hf(hf, args))
    assert torch.equal(fresh.output.weight, model.tok_embeddings.weight)


def test_unknown_keys_are_named():
    with pytest.raises(ValueError, match="layers.0.attention.bogus"):
        adapter.to_hf({"layers.0.attention.bogus": torch.zeros(1)}, TINY)
    with pytest.raises(ValueError, match="model.bogus"):
        adapter.from_hf({"model.bogus": torch.zeros(1)}, TINY)
    expert = "model.layers.0.mlp.experts.0.gate_proj.weight"  # an MoE model's, in a dense family's load
    with pytest.raises(ValueError, match=f"unknown Hugging Face Llama key '{expert}'"):
        adapter.from_hf({expert: torch.zeros(1)}, TINY)


def rotate_half_rope(x, theta):
    """HF Llama RoPE: feature i pairs with i + head_dim/2. x: [bs, seqlen, heads, head_dim]."""
    head_dim, seqlen = x.shape[-1], x.shape[1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seqlen).float(), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)[None, :, None, :]
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def test_hf_rotate_half_gives_same_attention_scores_as_complex_rope():
    torch.manual_seed(0)
    model = Transformer(TINY)
    attn, seqlen, hd = model.layers["0"].attention, 6, TINY.head_dim
    x = torch.randn(1, seqlen, TINY.dim)

    q = attn.wq(x).view(1, seqlen, -1, hd)
    k = attn.wk(x).view(1, seqlen, -1, hd)
    q, k = apply_rotary_emb(q, k, precompute_freqs_cis(hd, seqlen, TINY.rope_theta))

    hf = adapter.to_hf(model.state_dict(), TINY)
    q_hf = rotate_half_rope((x @ hf["model.layers.0.self_attn.q_proj.weight"].T).view(1, seqlen, -1, hd), TINY.rope_theta)
    k_hf = rotate_half_rope((x @ hf["model.layers.0.self_attn.k_proj.weight"].T).view(1, seqlen, -1, hd), TINY.rope_theta)

    def scores(q, k):  # query head h uses kv head h // n_rep
        k = k.repeat_interleave(TINY.n_heads // TINY.kv_heads, dim=2)
        return torch.einsum("bqhd,bkhd->bhqk", q, k)

    torch.testing.assert_close(scores(q_hf, k_hf), scores(q, k), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(q_hf, q)  # the layouts really differ
