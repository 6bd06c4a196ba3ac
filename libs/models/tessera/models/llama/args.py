"""Hyper-parameters of a Llama 2 / Llama 3.x model."""

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (long-context extension).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor``
    are kept, those longer than ``original_max_position_embeddings / low_freq_factor``
    are divided by ``factor``, and the band in between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a Llama model. Defaults are Llama 2 7B.

    Frozen so flavors can be shared safely; derive variants with ``dataclasses.replace``.
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: multi-head attention (as many K/V heads as Q heads)
    vocab_size: int = 32000
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    ffn_dim: int | None = None  # SwiGLU hidden size as given (HF's intermediate_size); None: derived
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 4096
    tie_embeddings: bool = False  # output.weight is tok_embeddings.weight (Llama 3.2 1B/3B)
    depth_init: bool = True  # init std of wo/w2/w3 shrinks with the layer index, not n_layers

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"ModelArgs: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"ModelArgs: n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"ModelArgs: head_dim={self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads: ``n_kv_heads``, or ``n_heads`` when that is None."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size: ``ffn_dim`` when set (a Hugging Face config states it outright),
        else 2/3 of 4*dim (keeps the FLOPs of a 4*dim MLP with three matrices), times
        ``ffn_dim_multiplier``, rounded up to ``multiple_of``."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)
