"""Named Llama configurations, from the papers and Meta's released params.json files.

The trainer overrides ``max_seq_len`` (its seq_len) and may override ``vocab_size``
(its tokenizer) with ``dataclasses.replace``.
"""

from tessera.models.llama.args import ModelArgs, RopeScaling

# Llama 3.1 (8B/70B/405B) and Llama 3.2 (1B/3B) long-context RoPE scaling.
LLAMA3_1_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)
LLAMA3_2_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)

# The debug model is never pretrained, so its context is the family's (131072, as torchtitan's
# debugmodel inherits it): long-sequence runs (context parallel) can use it.
_DEBUG = dict(dim=256, n_layers=6, n_heads=16, vocab_size=2048, multiple_of=256, max_seq_len=131072)
_LLAMA2 = dict(vocab_size=32000, rope_theta=10000.0, norm_eps=1e-5, max_seq_len=4096)
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=131072)

llama2_flavors: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(**_DEBUG, rope_theta=10000.0),
    "7B": ModelArgs(dim=4096, n_layers=32, n_heads=32, multiple_of=256, **_LLAMA2),
    "13B": ModelArgs(dim=5120, n_layers=40, n_heads=40, multiple_of=256, **_LLAMA2),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                     multiple_of=4096, **_LLAMA2),
}

llama3_flavors: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(**_DEBUG, rope_theta=500000.0, rope_scaling=LLAMA3_1_SCALING),  # torchtitan's: 3.1 scaling
    # Llama 3.2: tied input/output embeddings.
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
                    multiple_of=256, rope_scaling=LLAMA3_2_SCALING, tie_embeddings=True, **_LLAMA3),
    "3B": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0,
                    multiple_of=256, rope_scaling=LLAMA3_2_SCALING, tie_embeddings=True, **_LLAMA3),
    # Llama 3.1.
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                    multiple_of=1024, rope_scaling=LLAMA3_1_SCALING, **_LLAMA3),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                     multiple_of=4096, rope_scaling=LLAMA3_1_SCALING, **_LLAMA3),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                      multiple_of=4096, rope_scaling=LLAMA3_1_SCALING, **_LLAMA3),
}
