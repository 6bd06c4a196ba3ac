"""tessera.cp: context parallelism — a sequence split over the cp ranks (load-balanced for
causal attention) and exact attention across them by all-gathering K and V."""

from tessera.cp.attention import AllGatherKVAttention, apply_cp
from tessera.cp.sharding import check_seq_len, local_positions, shard_sequence

__all__ = ["AllGatherKVAttention", "apply_cp", "check_seq_len", "local_positions", "shard_sequence"]
