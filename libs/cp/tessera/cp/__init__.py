"""tessera.cp: context parallelism — a sequence split over the cp ranks (load-balanced for
causal attention) and exact attention across them: K and V all-gathered, or passed around
torch's ring."""

from tessera.cp.attention import AllGatherKVAttention, apply_cp
from tessera.cp.ring import RingAttention
from tessera.cp.sharding import check_seq_len, local_positions, shard_sequence

__all__ = ["AllGatherKVAttention", "RingAttention", "apply_cp", "check_seq_len", "local_positions", "shard_sequence"]
