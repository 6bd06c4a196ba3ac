"""tessera.cp: context parallelism — a sequence split over the cp ranks (load-balanced for
causal attention) and exact attention across them: K and V all-gathered for the model's own
masked kernel, or passed around torch's ring for plain causal attention."""

from tessera.cp.attention import KVGather, apply_cp
from tessera.cp.ring import RingAttention
from tessera.cp.sharding import check_seq_len, local_positions, local_runs, shard_sequence

__all__ = ["KVGather", "RingAttention", "apply_cp", "check_seq_len", "local_positions", "local_runs", "shard_sequence"]
