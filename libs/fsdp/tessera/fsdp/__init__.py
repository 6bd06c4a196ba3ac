"""tessera.fsdp: FSDP2/HSDP sharding, DDP replication and distributed gradient clipping."""

from tessera.fsdp.data_parallel import RESHARD_POLICIES, apply_ddp, apply_fsdp
from tessera.fsdp.grad_norm import clip_grad_norm_

__all__ = ["RESHARD_POLICIES", "apply_ddp", "apply_fsdp", "clip_grad_norm_"]
