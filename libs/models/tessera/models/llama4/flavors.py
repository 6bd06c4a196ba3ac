"""Named Llama 4 text stacks (torchtitan's names): the released Scout and Maverick text models
from their Hugging Face ``text_config``, and a tiny debug model.

Both released stacks: 48 layers of width 5120, 40 query / 8 K/V heads of 128, RoPE theta 5e5,
every fourth layer (3, 7, ...) NoPE with attention-temperature tuning, the others chunked to
8192 keys; one routed expert of 16 (Scout, every layer) or 128 (Maverick, every second layer)
per token plus a shared expert, both 8192 wide; dense layers 16384 wide. Scout extends RoPE with
Llama 3.1 scaling (factor 16 over 8192 positions) and L2-normalises q and k; Maverick does
neither. Routing balances load without an auxiliary loss (bias step 1e-3, as torchtitan); the
released format has no router bias (see hf_adapter).
"""

from tessera.models.llama.args import RopeScaling
from tessera.models.llama4.args import Llama4Args, every
from tessera.models.moe import MoEArgs


def _moe(n_experts: int, hidden_dim: int) -> MoEArgs:
    """Top-1 sigmoid routing, the score applied to the expert's input, one shared expert."""
    return MoEArgs(n_experts=n_experts, top_k=1, hidden_dim=hidden_dim, n_shared_experts=1, score_func="sigmoid",
                   score_before_experts=True)


def _layers(n_layers: int, moe_step: int, nope_step: int = 4) -> dict:
    nope = every(nope_step, n_layers)
    return dict(n_layers=n_layers, moe_layers=every(moe_step, n_layers), nope_layers=nope,
                chunked_layers=tuple(i for i in range(n_layers) if i not in nope))


_RELEASED = dict(vocab_size=202048, dim=5120, n_heads=40, n_kv_heads=8, head_dim=128, hidden_dim=16384,
                 attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, norm_eps=1e-5, rope_theta=500000.0)

llama4_flavors: dict[str, Llama4Args] = {
    # torchtitan's debug shape (dim 256, 16 heads, 8 experts, MoE every second layer) with iRoPE
    # at short range: chunks of 32 tokens, temperature tuning from position 31, so short runs
    # exercise both.
    "debugmodel": Llama4Args(vocab_size=2048, dim=256, n_heads=16, n_kv_heads=16, head_dim=16, hidden_dim=768,
                             moe=_moe(8, 512), **_layers(6, 2), attention_chunk_size=32, floor_scale=32,
                             rope_scaling=RopeScaling(factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                                                      original_max_position_embeddings=8192),
                             max_seq_len=1048576),
    "17bx16e": Llama4Args(moe=_moe(16, 8192), **_layers(48, 1), use_qk_norm=True,
                          rope_scaling=RopeScaling(factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                                                   original_max_position_embeddings=8192),
                          max_seq_len=10485760, **_RELEASED),
    "17bx128e": Llama4Args(moe=_moe(128, 8192), **_layers(48, 2), use_qk_norm=False, rope_scaling=None,
                           max_seq_len=1048576, **_RELEASED),
}
