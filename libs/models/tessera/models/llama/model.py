"""Llama 2 / Llama 3.x decoder (Touvron et al. 2023; Llama 3 Herd of Models, 2024).

Pre-norm transformer: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Conventions other libraries rely on:
- module names ``tok_embeddings``, ``layers`` (``nn.ModuleDict`` keyed "0".."n-1"),
  ``attention_norm``, ``attention.{wq,wk,wv,wo}``, ``ffn_norm``, ``feed_forward.{w1,w2,w3}``,
  ``norm``, ``output``;
- heads are reshaped with ``-1`` and K/V are repeated by the ratio n_heads // n_kv_heads, so
  tensor-parallel linears holding fewer local heads work unchanged;
- ``attention.inner_attention`` is the swappable attention kernel (default
  ``tessera.models.attention.CausalSDPA``): q, k, v [batch, heads, seq, head_dim] with K/V
  repeated, causal over the tokens it is given -> [batch, heads, seq, head_dim]; it also gets
  the keyword ``document_ids`` [batch, seq] when the caller asks for block-causal masking;
- positions are explicit: ``forward(tokens, positions=None)`` takes position ids ([T] or [B, T],
  default 0..T-1), and the RoPE table is indexed by them once at model entry, where the tokens
  are the whole sequence this rank holds; blocks get that rotation as the keyword ``freqs_cis``
  and use it whole, since under sequence parallel a block sees the full sequence only after its
  input is gathered, while between blocks it holds a shard;
- a block's sub-modules take the hidden state as their only positional argument;
- pipeline stages may set ``tok_embeddings``/``norm``/``output`` to None and delete layers.
"""

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.attention import CausalSDPA
from tessera.models.llama.args import ModelArgs
from tessera.models.llama.rope import apply_rotary_emb, precompute_freqs_cis
from tessera.models.rms_norm import RMSNorm

BASE_INIT_STD = 0.02


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[bs, seqlen, n_kv_heads, head_dim] -> [bs, seqlen, n_kv_heads * n_rep, head_dim];
    each K/V head serves the n_rep consecutive query heads of its group."""
    return x if n_rep == 1 else torch.repeat_interleave(x, n_rep, dim=2)


def _trunc_normal(weight: torch.Tensor, std: float) -> None:
    # Bounds are absolute (+-2), as in torchtitan: for std <= 0.02 this barely truncates.
    nn.init.trunc_normal_(weight, mean=0.0, std=std)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings; the attention kernel itself
    is the swappable submodule ``inner_attention`` (see ``tessera.models.attention``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.inner_attention = CausalSDPA()

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _trunc_normal(linear.weight, BASE_INIT_STD)
        _trunc_normal(self.wo.weight, init_std)

    def forward(self, x: torch.Tensor, *, freqs_cis: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [bs, seqlen, dim]; freqs_cis: the rotation of each of the seqlen tokens,
        [seqlen, head_dim // 2] or [bs, seqlen, head_dim // 2]; document_ids: see Transformer."""
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        masks = {} if document_ids is None else {"document_ids": document_ids}
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **masks)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        _trunc_normal(self.w1.weight, BASE_INIT_STD)
        _trunc_normal(self.w2.weight, init_std)
        _trunc_normal(self.w3.weight, init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """h = x + attention(norm(x)); out = h + feed_forward(norm(h))."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        # Std of the projections writing into the residual stream (wo, w2, w3), scaled down
        # with depth so the residual's variance does not grow with the number of layers.
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = BASE_INIT_STD / (2 * depth) ** 0.5

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, *, freqs_cis: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis=freqs_cis, document_ids=document_ids)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama decoder: tokens [B, T] (long) -> logits [B, T, vocab_size] in the parameter dtype.

    Construction initialises the weights; after building on the meta device call
    ``to_empty(device=...)`` then ``init_weights()``.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._tie_output()
        # Not persistent: derived from args, so checkpoints need not carry it.
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.init_weights()

    def _precompute_freqs_cis(self) -> torch.Tensor:
        a = self.args
        return precompute_freqs_cis(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

    def _tie_output(self) -> None:
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # to_empty()/to() may give the two tied modules separate new Parameters: tie them again.
        self._tie_output()
        # Module.to(dtype) casts complex buffers to real, dropping the rotation's imaginary part.
        if not self.freqs_cis.is_complex():
            with torch.device(self.freqs_cis.device):
                self.freqs_cis = self._precompute_freqs_cis()
        return self

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Recompute ``freqs_cis`` (on ``buffer_device``, default: where the buffer is) and
        initialise every parameter this module (or pipeline stage) still holds.

        Embedding: normal, std 1. Linears: truncated normal, std 0.02, with depth-scaled std for
        wo/w2/w3. Output: std dim**-0.5 cut at 3 std; with tied embeddings the shared weight
        gets this init, since logits' scale matters and the first block's norm undoes
        the embedding's. Norms: ones.
        """
        with torch.device(buffer_device or self.freqs_cis.device):
            self.freqs_cis = self._precompute_freqs_cis()
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab]. Pipeline stages without ``tok_embeddings``
        take hidden states [B, T, dim]; without ``norm``/``output`` they return hidden states.

        positions: position ids (long, [T] or [B, T], each < ``max_seq_len``) of the T tokens,
        default 0..T-1; a rank holding a later part of a sequence passes that part's ids, and so
        does a later pipeline stage under sequence parallel (its input is a sequence shard).
        document_ids: [B, T], the document of each token when a window packs several; attention
        then stays within a document (block-causal). None: plain causal attention.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=self.freqs_cis.device)
        # Indexed here, from the tokens: under sequence parallel h already holds only this rank's
        # shard of the sequence, while attention sees (and rotates) all T tokens.
        freqs_cis = self.freqs_cis[positions]
        for layer in self.layers.values():
            h = layer(h, freqs_cis=freqs_cis, document_ids=document_ids)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
