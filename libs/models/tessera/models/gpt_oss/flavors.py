"""Named GPT-OSS configurations: "20b" and "120b" from the released Hugging Face configs
(openai/gpt-oss-20b, openai/gpt-oss-120b; torchtitan's names), torchtitan 0.2.2's "debugmodel"
(the released layer at width 256, 4 layers, 8 experts: 183,397,920 parameters, most of them
the 201,088-token embeddings), and Tessera's own "tiny" for tests.

Released: vocabulary 201088 (o200k_harmony), dim 2880, 64 query and 8 K/V heads of 64 features,
experts 2880 wide, top 4, sliding window 128 on even layers, RoPE theta 150000 with YaRN (x32
over 4096 positions, context 131072). The released models balance load with an auxiliary loss;
these flavors keep Tessera's default, auxiliary-loss-free balancing (bias step 1e-3), whose bias
HF's format does not hold (see hf_adapter). The trainer overrides ``max_seq_len`` (its seq_len)
and may override ``vocab_size``.
"""

from tessera.models.gpt_oss.args import GPT_OSS_ROUTING, GptOssArgs, alternating_windows
from tessera.models.moe import MoEArgs

_RELEASED = dict(vocab_size=201088, dim=2880, n_heads=64, n_kv_heads=8, head_dim=64, sliding_window=128,
                 swiglu_limit=7.0, norm_eps=1e-5, rope_theta=150000.0, max_seq_len=131072)

gpt_oss_flavors: dict[str, GptOssArgs] = {
    "debugmodel": GptOssArgs(**{**_RELEASED, "dim": 256}, n_layers=4, window_layers=alternating_windows(4),
                             moe=MoEArgs(n_experts=8, top_k=4, hidden_dim=2880, **GPT_OSS_ROUTING)),
    # 4 layers: both attention kinds twice; 8 experts divide over 2 and 4 ranks.
    "tiny": GptOssArgs(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32,
                       moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=256, **GPT_OSS_ROUTING),
                       window_layers=alternating_windows(4)),
    "20b": GptOssArgs(n_layers=24, moe=MoEArgs(n_experts=32, top_k=4, hidden_dim=2880, **GPT_OSS_ROUTING),
                      window_layers=alternating_windows(24), **_RELEASED),
    "120b": GptOssArgs(n_layers=36, moe=MoEArgs(n_experts=128, top_k=4, hidden_dim=2880, **GPT_OSS_ROUTING),
                       window_layers=alternating_windows(36), **_RELEASED),
}
