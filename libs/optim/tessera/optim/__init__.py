"""tessera.optim: optimizers for sharded training. Muon (torch.optim.Muon's update for plain and
DTensor matrices and stacks of them, each matrix orthogonalised whole by one owner rank), and
AdamW with its moments in bfloat16."""

from tessera.optim.adamw import AdamW
from tessera.optim.muon import Muon
from tessera.optim.newton_schulz import adjusted_lr, orthogonalise
from tessera.optim.owners import apply_whole, matrix_mesh_dims, whole_locally

__all__ = ["AdamW", "Muon", "adjusted_lr", "apply_whole", "matrix_mesh_dims", "orthogonalise", "whole_locally"]
