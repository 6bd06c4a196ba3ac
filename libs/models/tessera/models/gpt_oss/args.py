"""Hyper-parameters of a GPT-OSS model."""

from dataclasses import dataclass, field

from tessera.models.layer_sets import kept_layers
from tessera.models.moe import MoEArgs
from tessera.models.rotary import YarnScaling

# GPT-OSS's routing: softmax over the chosen experts' logits (= the softmax scores renormalised
# over them), a gate with a bias, no shared experts.
GPT_OSS_ROUTING = dict(score_func="softmax", route_norm=True, gate_bias=True, n_shared_experts=0)
# The released models' YaRN: a 4096-token original context stretched 32 times, ramp ends kept fractional.
GPT_OSS_YARN = YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                           mscale=1.0, truncate=False)


def alternating_windows(n_layers: int) -> tuple[int, ...]:
    """The released models' layout: sliding-window attention on even layers, full on odd ones."""
    return tuple(range(0, n_layers, 2))


@dataclass(frozen=True)
class GptOssArgs:
    """Shape of a GPT-OSS model (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card"); defaults:
    the debug flavor's shape.

    Attention: grouped-query, ``head_dim`` its own value, biases on the q/k/v/o projections,
    a learned sink logit per head; the layers in ``window_layers`` see the last
    ``sliding_window`` keys (their own included), the others every earlier key. RoPE in
    Hugging Face's half-split layout, YaRN-scaled at every length (``yarn``; None: plain).
    Every block's feed-forward is an MoE layer (``moe``) whose experts are the clamped SwiGLU
    ``(clamp(up, +-swiglu_limit) + 1) * g * sigmoid(swiglu_alpha g)``, g = ``min(gate, swiglu_limit)``.
    Window layer indices from ``n_layers`` on are dropped (``tessera.models.layer_sets``).
    """

    vocab_size: int = 2048
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 32
    moe: MoEArgs = field(default_factory=lambda: MoEArgs(n_experts=8, top_k=2, hidden_dim=256, **GPT_OSS_ROUTING))
    sliding_window: int = 128
    window_layers: tuple[int, ...] = (0, 2)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    yarn: YarnScaling | None = GPT_OSS_YARN
    max_seq_len: int = 131072
    depth_init: bool = True

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"GptOssArgs: n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"GptOssArgs: head_dim={self.head_dim} must be even for RoPE")
        kept_layers(self, "window_layers")

    @property
    def softmax_scale_factor(self) -> float:
        """YaRN's factor on the attention scores (1 without YaRN), folded into q."""
        return self.yarn.attention_factor() if self.yarn is not None else 1.0
