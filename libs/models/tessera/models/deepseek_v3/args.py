"""Hyper-parameters of a DeepSeek-V2/V3 model."""

from dataclasses import dataclass, field, replace

from tessera.models.moe import MoEArgs
from tessera.models.rotary import YarnScaling


@dataclass(frozen=True)
class DeepSeekV3Args:
    """Shape of a DeepSeek-V2/V3 model (defaults: the debug flavor's shape).

    Multi-head latent attention: queries from ``dim`` directly (``q_lora_rank`` 0) or through a
    ``q_lora_rank`` bottleneck; keys and values from a ``kv_lora_rank`` latent; each head's query
    and key have ``qk_nope_head_dim`` features without position plus ``qk_rope_head_dim`` rotated
    ones (the key's rotated part shared by all heads); values have ``v_head_dim``. The first
    ``n_dense_layers`` blocks have a dense SwiGLU of ``inter_dim``, the others an MoE layer.

    ``num_mtp_layers`` multi-token-prediction modules (``mtp.py``; Hugging Face's
    ``num_nextn_predict_layers``, torchtitan's name) follow the ``n_layers`` blocks as blocks
    ``n_layers .. n_layers + num_mtp_layers - 1`` of ``layers``, where Hugging Face stores them.

    ``yarn`` (``tessera.models.rotary.YarnScaling``) applies to the rotary part of MLA when
    ``max_seq_len`` exceeds its ``original_max_position_embeddings``, as in DeepSeek's reference
    code (and torchtitan): pretraining at the original context uses plain RoPE, a longer run
    (context extension) switches YaRN on. ``yarn_always`` applies it at any length, as
    transformers applies a config.json's ``rope_scaling``: a checkpoint read from Hugging Face
    keeps the positions it was trained with whatever seq_len fine-tunes it.
    """

    vocab_size: int = 2048
    dim: int = 256
    n_layers: int = 6
    n_dense_layers: int = 1
    n_heads: int = 8
    inter_dim: int = 1024
    moe: MoEArgs = field(default_factory=MoEArgs)
    q_lora_rank: int = 0
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    yarn: YarnScaling | None = field(default_factory=YarnScaling)
    max_seq_len: int = 163840
    depth_init: bool = True
    num_mtp_layers: int = 0
    yarn_always: bool = False

    def __post_init__(self):
        if self.num_mtp_layers < 0:
            raise ValueError(f"DeepSeekV3Args: num_mtp_layers={self.num_mtp_layers} must be >= 0")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"DeepSeekV3Args: n_dense_layers={self.n_dense_layers} is not in "
                             f"0..n_layers={self.n_layers}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepSeekV3Args: qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn_active(self) -> bool:
        return self.yarn is not None and (self.yarn_always or self.max_seq_len > self.yarn.original_max_position_embeddings)

    def with_context(self, max_seq_len: int) -> "DeepSeekV3Args":
        """The same model stated for ``max_seq_len`` positions: YaRN fixed as it is now (on at any
        length, or none), so that the length no longer switches it (an export states the
        architecture's length, not the run's)."""
        active = self.yarn_active
        return replace(self, yarn=self.yarn if active else None, yarn_always=active, max_seq_len=max_seq_len)

    @property
    def softmax_scale_factor(self) -> float:
        """YaRN's factor on the attention scores when YaRN applies (else 1), folded into q: the
        softmax scale is qk_head_dim ** -0.5 times it."""
        return self.yarn.attention_factor() if self.yarn_active else 1.0
