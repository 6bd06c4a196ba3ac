"""Hyper-parameters of a Qwen3 model, dense or mixture of experts."""

from dataclasses import dataclass

from tessera.models.layer_sets import kept_layers
from tessera.models.moe import MoEArgs


@dataclass(frozen=True)
class Qwen3Args:
    """Shape of a Qwen3 model (defaults: the dense debug flavor's shape).

    ``head_dim`` is its own hyper-parameter (not dim / n_heads). With ``moe`` set every block's
    feed-forward is an MoE layer (Qwen3-MoE), otherwise a SwiGLU of ``hidden_dim``. The layers
    in ``window_layers`` attend to a sliding window of ``sliding_window`` keys (Hugging Face's
    "sliding_attention" layers), the others globally; indices from ``n_layers`` on are dropped
    (``tessera.models.layer_sets``).
    """

    vocab_size: int = 2048
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 64
    hidden_dim: int = 768
    moe: MoEArgs | None = None
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    tie_embeddings: bool = False  # output.weight is tok_embeddings.weight (0.6B, 1.7B, 4B)
    depth_init: bool = True
    sliding_window: int | None = None  # keys a window layer's query sees, its own included
    window_layers: tuple[int, ...] = ()  # the layers that use it, in increasing order

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Qwen3Args: n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Args: head_dim={self.head_dim} must be even for RoPE")
        kept_layers(self, "window_layers")
        if self.window_layers and self.sliding_window is None:
            raise ValueError(f"Qwen3Args: window_layers={self.window_layers} need a sliding_window")
