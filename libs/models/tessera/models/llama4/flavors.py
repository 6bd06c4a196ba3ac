"""Named Llama 4 text stacks, by torchtitan 0.2.2's names: the released Scout and Maverick text
models and a debug model, each without iRoPE ("17bx16e", "17bx128e", "debugmodel": RoPE and
global causal attention on every layer, as torchtitan's) and with it ("..._irope"), plus
Tessera's own "tiny" for tests.

Both released stacks: 48 layers of width 5120, 40 query / 8 K/V heads of 128, RoPE theta 5e5;
one routed expert of 16 (Scout, every layer) or 128 (Maverick, every second layer) per token
plus a shared expert, both 8192 wide; dense layers 16384 wide. Scout extends RoPE with Llama 3.1
scaling (factor 16 over 8192 positions). iRoPE as released (Hugging Face's ``text_config``):
every fourth layer (3, 7, ...) NoPE with attention-temperature tuning, the others chunked to
8192 keys, and on Scout the L2 q/k norm. torchtitan's "_irope" flavors have the same tensors
but put NoPE on layers 0, 4, ... and neither tune the temperature nor normalise q/k: Tessera's
follow the release, whose checkpoints they load. Routing balances load without an auxiliary
loss (bias step 1e-3, as torchtitan); the released format has no router bias (see hf_adapter).
"""

from tessera.models.llama.args import RopeScaling
from tessera.models.llama4.args import Llama4Args, every
from tessera.models.moe import MoEArgs


def _moe(n_experts: int, hidden_dim: int) -> MoEArgs:
    """Top-1 sigmoid routing, the score applied to the expert's input, one shared expert."""
    return MoEArgs(n_experts=n_experts, top_k=1, hidden_dim=hidden_dim, n_shared_experts=1, score_func="sigmoid",
                   score_before_experts=True)


def _layers(n_layers: int, moe_step: int, irope: bool, nope_step: int = 4) -> dict:
    """MoE every ``moe_step``-th layer; with iRoPE every ``nope_step``-th layer NoPE, the others chunked."""
    nope = every(nope_step, n_layers) if irope else ()
    chunked = tuple(i for i in range(n_layers) if i not in nope) if irope else ()
    return dict(n_layers=n_layers, moe_layers=every(moe_step, n_layers), nope_layers=nope, chunked_layers=chunked)


_SCOUT_SCALING = RopeScaling(factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0, original_max_position_embeddings=8192)
_DEBUG = dict(vocab_size=2048, dim=256, n_heads=16, n_kv_heads=16, head_dim=16, hidden_dim=768, moe=_moe(8, 512),
              rope_scaling=_SCOUT_SCALING, max_seq_len=1048576)
_RELEASED = dict(vocab_size=202048, dim=5120, n_heads=40, n_kv_heads=8, head_dim=128, hidden_dim=16384,
                 attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, norm_eps=1e-5, rope_theta=500000.0)

llama4_flavors: dict[str, Llama4Args] = {
    "debugmodel": Llama4Args(**_DEBUG, **_layers(6, 2, irope=False), use_qk_norm=False),
    "debugmodel_irope": Llama4Args(**_DEBUG, **_layers(6, 2, irope=True), attention_chunk_size=256, floor_scale=8192),
    # torchtitan's debug shape with iRoPE at short range: chunks of 32 tokens, temperature tuning
    # from position 31, so short runs exercise both.
    "tiny": Llama4Args(**_DEBUG, **_layers(6, 2, irope=True), attention_chunk_size=32, floor_scale=32),
    "17bx16e": Llama4Args(moe=_moe(16, 8192), **_layers(48, 1, irope=False), use_qk_norm=False,
                          rope_scaling=_SCOUT_SCALING, max_seq_len=10485760, **_RELEASED),
    "17bx128e": Llama4Args(moe=_moe(128, 8192), **_layers(48, 2, irope=False), use_qk_norm=False, rope_scaling=None,
                           max_seq_len=1048576, **_RELEASED),
    "17bx16e_irope": Llama4Args(moe=_moe(16, 8192), **_layers(48, 1, irope=True), use_qk_norm=True,
                                rope_scaling=_SCOUT_SCALING, max_seq_len=10485760, **_RELEASED),
    "17bx128e_irope": Llama4Args(moe=_moe(128, 8192), **_layers(48, 2, irope=True), use_qk_norm=False,
                                 rope_scaling=None, max_seq_len=1048576, **_RELEASED),
}
