"""Explicit positions and the inner-attention seam of the Llama model."""

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models import InnerAttention
from tessera.mesh import repeat_kv_heads
from tessera.models.llama import ModelArgs, RopeScaling, Transformer, apply_rotary_emb, precompute_freqs_cis

SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8)
TINY = ModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=101, multiple_of=16, max_seq_len=16, rope_scaling=SCALING
)


def tiny_model():
    torch.manual_seed(0)
    return Transformer(TINY)


def reference_logits(model, tokens):
    """The forward written out: rotations are the first T rows of the RoPE table, attention is
    causal SDPA over the whole sequence."""
    args, (bs, seqlen) = model.args, tokens.shape
    freqs_cis = precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)[:seqlen]
    h = model.tok_embeddings(tokens)
    for block in model.layers.values():
        attn, x = block.attention, block.attention_norm(h)
        q, k, v = (w(x).view(bs, seqlen, -1, args.head_dim) for w in (attn.wq, attn.wk, attn.wv))
        q, k = apply_rotary_emb(q, k, freqs_cis)
        q, k, v = q.transpose(1, 2), repeat_kv_heads(k.transpose(1, 2), args.n_heads), repeat_kv_heads(v.transpose(1, 2), args.n_heads)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + attn.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
        h = h + block.feed_forward(block.ffn_norm(h))
    return model.output(model.norm(h))


class Recorder(nn.Module):
    """Default attention that keeps the q, k, v it was called with."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, q, k, v, batch=None):
        self.calls.append((q, k, v))
        return InnerAttention()(q, k, v, batch)


class PrefixAttention(nn.Module):
    """Causal attention over a prefix seen in an earlier call plus the current chunk, as a rank
    holding a later chunk of a sequence would compute it with the earlier keys and values."""

    def __init__(self):
        super().__init__()
        self.prefix = None

    def forward(self, q, k, v, batch=None):
        if self.prefix is None:
            self.prefix = (k, v)
            return InnerAttention()(q, k, v)
        (k_prefix, v_prefix), n_prefix, n_chunk = self.prefix, self.prefix[0].shape[2], q.shape[2]
        visible = torch.ones(n_chunk, n_prefix + n_chunk, dtype=torch.bool).tril(diagonal=n_prefix)
        k, v = (repeat_kv_heads(torch.cat(pair, dim=2), q.shape[1]) for pair in ((k_prefix, k), (v_prefix, v)))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)


def test_default_positions_give_the_reference_logits_bit_for_bit():
    model = tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(tokens), reference_logits(model, tokens))
        assert torch.equal(model(tokens, positions=torch.arange(12)), model(tokens))


def test_inner_attention_is_a_swappable_submodule_called_with_bhsd_layout():
    model = tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (3, 10))
    expected = model(tokens)
    assert isinstance(model.layers["0"].attention.inner_attention, InnerAttention)
    recorders = {}
    for name, block in model.layers.items():
        block.attention.inner_attention = recorders[name] = Recorder()
    assert "layers.1.attention.inner_attention" in dict(model.named_modules())
    assert torch.equal(model(tokens), expected)
    for recorder in recorders.values():
        (call,) = recorder.calls
        q_shape, kv_shape = (3, TINY.n_heads, 10, TINY.head_dim), (3, TINY.n_kv_heads, 10, TINY.head_dim)
        assert [t.shape for t in call] == [q_shape, kv_shape, kv_shape]  # the kernel repeats K/V itself


def test_positions_of_a_later_chunk_rotate_q_and_k_as_the_full_sequence_does():
    model = tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    model.layers["0"].attention.inner_attention = recorder = Recorder()
    model(tokens)
    model(tokens[:, 4:8], positions=torch.arange(4, 8))
    model(tokens[:, 4:8])
    (q_full, k_full, _), (q_chunk, k_chunk, _), (q_from_0, _, _) = recorder.calls
    torch.testing.assert_close(q_chunk, q_full[:, :, 4:8])
    torch.testing.assert_close(k_chunk, k_full[:, :, 4:8])
    assert not torch.allclose(q_from_0, q_full[:, :, 4:8])


def test_chunk_with_its_positions_and_the_prefix_keys_gives_the_full_sequence_logits():
    model = tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    full = model(tokens)
    for block in model.layers.values():
        block.attention.inner_attention = PrefixAttention()
    torch.testing.assert_close(model(tokens[:, :5]), full[:, :5])
    torch.testing.assert_close(model(tokens[:, 5:], positions=torch.arange(5, 12)), full[:, 5:])


def test_batched_positions_rotate_each_sequence_by_its_own():
    model = tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 6))
    # Row 1 skips every other position: RoPE sees only differences, so a mere shift would not show.
    positions = torch.stack([torch.arange(0, 6), torch.arange(0, 12, 2)])
    logits = model(tokens, positions=positions)
    torch.testing.assert_close(logits[:1], model(tokens[:1]))
    torch.testing.assert_close(logits[1:], model(tokens[1:], positions=torch.arange(0, 12, 2)))
    assert not torch.allclose(logits[1:], model(tokens[1:]))


def test_pipeline_stage_takes_positions_with_hidden_states():
    model = tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 6))
    positions = torch.arange(3, 9)
    expected = model(tokens, positions=positions)
    hidden = model.tok_embeddings(tokens)
    model.tok_embeddings = None
    torch.testing.assert_close(model(hidden, positions=positions), expected)
