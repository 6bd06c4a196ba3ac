"""Named DeepSeek configurations, from the published Hugging Face configs (DeepSeek-V2-Lite as
"16B", DeepSeek-V2 as "236B", DeepSeek-V3 as "671B", torchtitan's names), torchtitan 0.2.2's
"debugmodel" (33,014,016 parameters), and Tessera's own "tiny" for tests.

All MoE flavors balance load without auxiliary loss (bias step 1e-3, as DeepSeek-V3 and
torchtitan); "671B" adds the sequence-wise balance loss with DeepSeek-V3's alpha = 1e-4. The
flavors named "_mtp" add one multi-token-prediction module ("debugmodel_mtp": torchtitan's
``deepseek_v3_debugmodel_mtp``); the others have none, like torchtitan's (DeepSeek-V3's own module
comes with ``from_hf_config``). The trainer overrides ``max_seq_len`` (its seq_len: YaRN applies
above 4096) and may override ``vocab_size``.
"""

import dataclasses

from tessera.models.deepseek_v3.args import DeepSeekV3Args, YarnScaling
from tessera.models.moe import MoEArgs

# V2 and V2-Lite: mscale_all_dim 0.707; V3: 1.0. All: factor 40 over a 4096-token original context.
_V2_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=0.707)
_V3_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0)
_DEBUG_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=0.70)
_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)

deepseek_v3_flavors: dict[str, DeepSeekV3Args] = {
    # torchtitan's debug model: DeepSeek-V2-Lite's MLA heads at width 256, softmax routing,
    # two shared experts.
    "debugmodel": DeepSeekV3Args(
        vocab_size=2048, dim=256, n_layers=6, n_dense_layers=1, n_heads=16, inter_dim=1024,
        moe=MoEArgs(n_experts=8, top_k=3, hidden_dim=256, n_shared_experts=2, score_func="softmax"),
        q_lora_rank=0, **_MLA, yarn=_DEBUG_YARN, max_seq_len=16384,
    ),
    # Tessera's test model, a tiny V3: sigmoid routing limited to 2 of 4 expert groups, a shared
    # expert. Its context is the family's (163840), so long-sequence runs can use it.
    "tiny": DeepSeekV3Args(
        vocab_size=2048, dim=256, n_layers=6, n_dense_layers=1, n_heads=8, inter_dim=1024,
        moe=MoEArgs(n_experts=8, top_k=3, hidden_dim=256, n_shared_experts=1, score_func="sigmoid",
                    route_norm=True, route_scale=2.5, n_groups=4, topk_groups=2),
        q_lora_rank=0, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        yarn=_V3_YARN, max_seq_len=163840,
    ),
    "16B": DeepSeekV3Args(
        vocab_size=102400, dim=2048, n_layers=27, n_dense_layers=1, n_heads=16, inter_dim=10944,
        moe=MoEArgs(n_experts=64, top_k=6, hidden_dim=1408, n_shared_experts=2, score_func="softmax"),
        q_lora_rank=0, **_MLA, yarn=_V2_YARN, max_seq_len=163840,
    ),
    # Group-limited greedy routing: groups ranked by their best expert.
    "236B": DeepSeekV3Args(
        vocab_size=102400, dim=5120, n_layers=60, n_dense_layers=1, n_heads=128, inter_dim=12288,
        moe=MoEArgs(n_experts=160, top_k=6, hidden_dim=1536, n_shared_experts=2, score_func="softmax",
                    route_scale=16.0, n_groups=8, topk_groups=3, group_score_top=1),
        q_lora_rank=1536, **_MLA, yarn=_V2_YARN, max_seq_len=163840,
    ),
    "671B": DeepSeekV3Args(
        vocab_size=129280, dim=7168, n_layers=61, n_dense_layers=3, n_heads=128, inter_dim=18432,
        moe=MoEArgs(n_experts=256, top_k=8, hidden_dim=2048, n_shared_experts=1, score_func="sigmoid",
                    route_norm=True, route_scale=2.5, n_groups=8, topk_groups=4, group_score_top=2,
                    aux_loss_alpha=1e-4),
        q_lora_rank=1536, **_MLA, yarn=_V3_YARN, max_seq_len=163840,
    ),
}
deepseek_v3_flavors["debugmodel_mtp"] = dataclasses.replace(deepseek_v3_flavors["debugmodel"], num_mtp_layers=1)
deepseek_v3_flavors["tiny_mtp"] = dataclasses.replace(deepseek_v3_flavors["tiny"], num_mtp_layers=1)
