"""Hyper-parameters of a Llama 4 text model."""

from dataclasses import dataclass

from tessera.models.llama.args import RopeScaling
from tessera.models.layer_sets import kept_layers
from tessera.models.moe import MoEArgs


def every(step: int, n_layers: int) -> tuple[int, ...]:
    """Layers step-1, 2*step-1, ...: where Llama 4 puts its MoE layers
    (``interleave_moe_layer_step``) and its NoPE layers (``no_rope_layer_interval``)."""
    return tuple(range(step - 1, n_layers, step))


@dataclass(frozen=True)
class Llama4Args:
    """Shape of a Llama 4 text stack (defaults: the debug flavor's).

    iRoPE: the layers in ``nope_layers`` have no positional encoding and attend to every earlier
    key, their queries scaled by ``1 + attn_scale * log(1 + floor((pos + 1) / floor_scale))`` when
    ``attn_temperature_tuning``; the other layers rotate q and k (RoPE, interleaved pairs, Llama
    3.1 scaling when ``rope_scaling``), L2-normalise them when ``use_qk_norm`` (an RMS norm
    without weight) and, in ``chunked_layers``, see only keys of their own chunk of
    ``attention_chunk_size`` tokens. Feed-forward: an MoE layer (``moe``: routed experts and
    one shared expert, each ``moe.hidden_dim`` wide) in ``moe_layers``, elsewhere a dense SwiGLU
    of ``hidden_dim``. Layer indices from ``n_layers`` on are dropped (``tessera.models.layer_sets``).
    """

    vocab_size: int = 2048
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int = 16
    head_dim: int = 16
    hidden_dim: int = 768
    moe: MoEArgs = MoEArgs()
    moe_layers: tuple[int, ...] = (1, 3, 5)
    nope_layers: tuple[int, ...] = (3,)
    chunked_layers: tuple[int, ...] = (0, 1, 2, 4, 5)
    attention_chunk_size: int | None = 32
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: int = 32
    attn_scale: float = 0.1
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 1048576
    tie_embeddings: bool = False
    depth_init: bool = True

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Llama4Args: n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"Llama4Args: head_dim={self.head_dim} must be even for RoPE")
        for name in ("moe_layers", "nope_layers", "chunked_layers"):
            kept_layers(self, name)
        if self.chunked_layers and self.attention_chunk_size is None:
            raise ValueError(f"Llama4Args: chunked_layers={self.chunked_layers} need an attention_chunk_size")
        if not self.chunked_layers:  # no layer uses it
            object.__setattr__(self, "attention_chunk_size", None)
