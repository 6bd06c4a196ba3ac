"""Named Qwen3 configurations, from the published Hugging Face configs (flavor names as
torchtitan's). Context: 40960 positions (``max_position_embeddings``), RoPE theta 1e6.
"debugmodel" and "debugmodel_moe" are torchtitan 0.2.2's (31,987,968 and 315,758,848
parameters); "tiny" and "tiny_moe" are Tessera's own, for tests.

Published Qwen3-MoE balances load with an auxiliary loss; here its flavors use auxiliary-loss-free
balancing (bias step 1e-3, as torchtitan), whose bias HF's format cannot hold (see hf_adapter).
"""

from tessera.models.moe import MoEArgs
from tessera.models.qwen3.args import Qwen3Args

_QWEN3 = dict(vocab_size=151936, head_dim=128, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960)
# Softmax over all experts, top-8, top-k weights renormalised (norm_topk_prob), no shared experts.
_QWEN3_MOE = dict(top_k=8, n_shared_experts=0, score_func="softmax", route_norm=True)

qwen3_flavors: dict[str, Qwen3Args] = {
    # torchtitan's debug models: head_dim 128 != dim / n_heads = 16.
    "debugmodel": Qwen3Args(vocab_size=2048, dim=256, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=128,
                            hidden_dim=3072, tie_embeddings=True, max_seq_len=4096),
    "debugmodel_moe": Qwen3Args(vocab_size=2048, dim=256, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=128,
                                hidden_dim=3072, moe=MoEArgs(n_experts=64, hidden_dim=768, **_QWEN3_MOE),
                                max_seq_len=4096),
    # Tessera's test models: head_dim 64 != dim / n_heads = 32, so the decoupling is exercised.
    "tiny": Qwen3Args(vocab_size=2048, dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768,
                      tie_embeddings=True),
    "tiny_moe": Qwen3Args(vocab_size=2048, dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768,
                          moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=128, score_func="softmax", route_norm=True)),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, tie_embeddings=True, **_QWEN3),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, tie_embeddings=True, **_QWEN3),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, tie_embeddings=True, **_QWEN3),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288, **_QWEN3),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408, **_QWEN3),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600, **_QWEN3),
    "30B-A3B": Qwen3Args(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, hidden_dim=6144,
                         moe=MoEArgs(n_experts=128, hidden_dim=768, **_QWEN3_MOE), **_QWEN3),
    "235B-A22B": Qwen3Args(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, hidden_dim=12288,
                           moe=MoEArgs(n_experts=128, hidden_dim=1536, **_QWEN3_MOE), **_QWEN3),
}
