"""What one layer's attention may see: one description, one mask function for every kernel.

A decoder's attention is always causal; a layer may further limit each query to a sliding
window of keys (Mistral, GPT-OSS, Qwen3's window layers) or to its own chunk of the sequence
(Llama 4's local layers). A run that packs several documents into a window adds the document
limit to every layer (block-causal attention, counted from the BOS tokens). Layers with neither
a window nor a chunk attend globally (Llama 4's NoPE layers, GPT-OSS's full layers).

``mask_function`` turns a description into FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)``:
the CUDA path hands it to ``create_block_mask``, and the CPU kernel
(``tessera.models.blocked_attention``) evaluates the very same function on broadcast index
tensors, so the masks a GPU run uses are the ones the CPU tests prove.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """window: a query at index i sees keys i - window < j <= i (window >= 1), None: no limit.
    chunk: a query sees only keys of its own chunk of ``chunk`` tokens (j // chunk == i // chunk),
    None: no limit. Both are counted in the packed window's token indices."""

    window: int | None = None
    chunk: int | None = None

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"attention mask {name} {value!r} is not a positive int or None")

    @property
    def is_plain_causal(self) -> bool:
        return self.window is None and self.chunk is None

    def describe(self, documents: bool = False) -> str:
        parts = ["causal"] + ([f"window {self.window}"] if self.window else []) + ([f"chunk {self.chunk}"] if self.chunk else [])
        return " + ".join(parts + (["document"] if documents else []))


CAUSAL = AttentionMask()


def window_layer(layer_id: int, window: int | None, window_layers) -> AttentionMask:
    """Layer ``layer_id``'s mask in a family whose ``window_layers`` attend to a sliding window of
    ``window`` keys and whose other layers attend globally (GPT-OSS, Qwen3's window layers)."""
    return AttentionMask(window=window) if layer_id in window_layers else CAUSAL


def mask_function(mask: AttentionMask, documents: torch.Tensor | None = None):
    """FlexAttention's mask_mod for ``mask``: True where query ``q_idx`` may see key ``kv_idx``.

    documents: [batch, seq] document ids of the sequence's tokens (in index order, one id per
    packed document), or None: no document limit. Written with tensor operations only, so it
    broadcasts over index tensors as well as FlexAttention's scalars."""
    window, chunk = mask.window, mask.chunk

    def mask_mod(b, h, q_idx, kv_idx):
        visible = q_idx >= kv_idx
        if window is not None:
            visible = visible & (q_idx - kv_idx < window)
        if chunk is not None:
            visible = visible & (q_idx // chunk == kv_idx // chunk)
        if documents is not None:
            visible = visible & (documents[b, q_idx] == documents[b, kv_idx])
        return visible

    return mask_mod


def key_range(mask: AttentionMask, q_start: int, q_end: int) -> tuple[int, int]:
    """The keys [lo, hi) that queries q_start..q_end-1 may see at most: causal up to the last
    query, from the first query's window or chunk start. Plain ints, so a kernel's blocks are
    fixed by the shapes alone (and a compiled block does not depend on the data)."""
    lo = 0
    if mask.window is not None:
        lo = max(lo, q_start - mask.window + 1)
    if mask.chunk is not None:
        lo = max(lo, q_start // mask.chunk * mask.chunk)
    return lo, q_end
