"""tessera.fsdp: FSDP2/HSDP sharding, DDP replication and distributed gradient clipping."""

from tessera.fsdp.data_parallel import MIXED_PRECISION_DTYPES, RESHARD_POLICIES, apply_ddp, apply_fsdp
from tessera.fsdp.grad_norm import clip_grad_norm_

__all__ = ["MIXED_PRECISION_DTYPES", "RESHARD_POLICIES", "apply_ddp", "apply_fsdp", "clip_grad_norm_"]
