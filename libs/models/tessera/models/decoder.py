"""The decoder shell of every family (Llama, DeepSeek-V3, Qwen3, GPT-OSS): token embedding,
``layers``, final norm, output projection, and the RoPE table indexed by explicit positions.

Conventions (see ``tessera.models.llama.model`` and the package README): module
names ``tok_embeddings``, ``layers`` (``nn.ModuleDict`` keyed "0".."n-1"), ``norm``, ``output``;
pipeline stages may set the first and last three to None and delete layers; positions are indexed
once at entry, where the tokens are the whole sequence this rank holds, and every block gets those
rows whole as the keyword ``rope``, with the step's ``AttentionBatch`` as the keyword ``attention``
(document ids for block-causal attention, block masks built once for every layer).
"""

import torch
from torch import nn

from tessera.models.attention import AttentionBatch, attention_batch, inner_attentions
from tessera.models.feed_forward import BASE_INIT_STD, FeedForward
from tessera.models.moe import MoE
from tessera.models.rms_norm import RMSNorm

__all__ = ["BASE_INIT_STD", "Decoder", "TransformerBlock", "depth_init_std"]


def depth_init_std(layer_id: int, n_layers: int, depth_init: bool = True) -> float:
    """Init std of the projections writing into the residual stream, scaled down with depth
    (the layer index, or n_layers without depth_init) so the residual's variance stays bounded."""
    return BASE_INIT_STD / (2 * (layer_id + 1 if depth_init else n_layers)) ** 0.5


class TransformerBlock(nn.Module):
    """h = x + attention(attention_norm(x)); out = h + ffn(ffn_norm(h)), where the ffn is the
    submodule ``feed_forward`` (a dense SwiGLU) or ``moe`` (``tessera.models.moe.MoE``); the
    other one is None. ``attention`` takes ``(x, *, rope, attention)`` (an ``AttentionBatch``) and offers
    ``init_weights(init_std)``."""

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, ffn: FeedForward | MoE, init_std: float):
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.feed_forward = ffn if isinstance(ffn, FeedForward) else None
        self.moe = ffn if isinstance(ffn, MoE) else None
        self.weight_init_std = init_std

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        if self.moe is not None:
            self.moe.init_weights(self.weight_init_std, buffer_device)
        else:
            self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, *, rope: torch.Tensor, attention: AttentionBatch | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope=rope, attention=attention)
        ffn = self.feed_forward if self.moe is None else self.moe
        return h + ffn(self.ffn_norm(h))


class Decoder(nn.Module):
    """tokens [B, T] (long) -> logits [B, T, vocab_size] in the parameter dtype.

    A family subclasses it, passing its blocks, and says how its RoPE table is made
    (``rope_table``); blocks take ``(h, *, rope, attention)`` and offer
    ``init_weights(buffer_device)``. Construction initialises the weights; after building on the
    meta device call ``to_empty(device=...)`` then ``init_weights()``.
    """

    def __init__(self, args, blocks: list[nn.Module], *, tie_embeddings: bool = False):
        super().__init__()
        self.args = args
        self.tie_embeddings = tie_embeddings
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._tie_output()
        # tessera.pp: a tied output projection is the embedding's weight, so a pipeline's last stage keeps a copy
        self.shared_with_last_stage = ("tok_embeddings",) if tie_embeddings else ()
        # Not persistent: derived from args, so checkpoints need not carry it.
        self.register_buffer("rope", self.rope_table(), persistent=False)
        self._rope_dtype = self.rope.dtype
        self.init_weights()

    def rope_table(self) -> torch.Tensor:
        """[max_seq_len, ...]: the rotation of each position, as the family's attention takes it
        (a cos|sin table, ``tessera.models.rotary.rope_table``, or Llama's complex rotations)."""
        raise NotImplementedError

    def _tie_output(self) -> None:
        if self.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # to_empty()/to() may give the two tied modules separate new Parameters: tie them again.
        self._tie_output()
        # Module.to(dtype) casts buffers too: cos/sin of large angles need float32, and a cast of
        # complex rotations to real drops their imaginary part.
        if self.rope.dtype != self._rope_dtype:
            with torch.device(self.rope.device):
                self.rope = self.rope_table()
        return self

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Recompute the RoPE table and reset the blocks' buffers (on ``buffer_device``, default:
        where the table is) and initialise every parameter this module (or stage) still holds.

        Embedding: normal, std 1. Output: std dim**-0.5 cut at 3 std. Tied embeddings: the
        shared weight normal, std 0.02 (Qwen3's ``initializer_range``, as Hugging Face inits
        it); the output's init would give each token's own logit sqrt(dim) (a token's normed
        embedding times itself) and a first loss far above ln(vocab). Norms: ones. Blocks:
        their own ``init_weights``.
        """
        buffer_device = buffer_device or self.rope.device
        with torch.device(buffer_device):
            self.rope = self.rope_table()
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights(buffer_device)
        for inner in inner_attentions(self.layers):  # attention sinks
            inner.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and self.tie_embeddings:
            nn.init.normal_(self.output.weight, std=BASE_INIT_STD)
        elif self.output is not None:
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab]. A later pipeline stage takes hidden states
        [B, T, dim] instead (floating point: the last one may hold a copy of ``tok_embeddings``,
        tessera.pp's ``shared_with_last_stage``); without ``norm``/``output`` it returns hidden states.

        positions: position ids (long, [T] or [B, T], each < ``max_seq_len``) of the T tokens,
        default 0..T-1; a rank holding a later part of a sequence passes that part's ids, and so
        does a later pipeline stage under sequence parallel (its input is a sequence shard).
        document_ids: [B, T], the document of each token when a window packs several (ids that
        count documents, so they never decrease along a row); attention then stays within a
        document (block-causal). None: each layer's own mask alone.
        """
        h, rope, attention = self._inputs(tokens, positions, document_ids)
        for layer in self.layers.values():
            h = layer(h, rope=rope, attention=attention)
        return self._head(h)

    def _inputs(self, tokens: torch.Tensor, positions: torch.Tensor | None,
                document_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """(the first block's input, the RoPE rows of the positions, the step's AttentionBatch)."""
        h = tokens if tokens.is_floating_point() else self.tok_embeddings(tokens)
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=self.rope.device)
        # Indexed here, from the tokens: under sequence parallel h already holds only this rank's
        # shard of the sequence, while attention sees (and rotates) all T tokens.
        rope = self.rope[positions]
        return h, rope, attention_batch(self.layers, document_ids, positions.shape[-1], h.device)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
