"""Modules that run whole (or on their own shards) on plain tensors inside a tensor-parallel block.

Inside a block every TP rank holds the same replicated input. Some modules do not fit the
colwise/rowwise pattern: a low-rank projection and its norm that every rank runs whole
(DeepSeek's MLA latents), a norm over head_dim applied to the rank's local heads (Qwen3's QK-norm),
a router, experts split on their hidden features. ``LocalShards`` runs such a module's own forward
on plain tensors: its parameters are DTensors on the TP mesh (``Replicate`` unless told a
``Shard``), so checkpoints, FSDP and gradient clipping see whole parameters.

Gradient convention for plain tensors inside a block: a rank's gradient of a replicated
activation is its *share* (the true gradient is the sum over the TP ranks), as the gradient a
colwise linear sends back to the block input is. Every share meets the others once, in the
reduce-scatter (or all-reduce) at the block input. So a replicated parameter's gradient is a
share too and is summed over the TP ranks as it accumulates; a ``Shard`` parameter's gradient is
its own shard's; a DTensor input is taken as its local value with the share convention.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from tessera.mesh import local_parameters, swapped_class

def replicated_as_share(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A plain tensor every TP rank holds whole, as a ``Replicate`` DTensor whose gradient comes
    back as this rank's share (not summed: the block input sums the shares once)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False, grad_placements=[Partial()])


def local_share(x: DTensor) -> torch.Tensor:
    """A DTensor's replicated value as a plain tensor whose gradient is taken as a share."""
    return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim).to_local(grad_placements=[Partial()])


def _summed_over_ranks(param: DTensor) -> torch.Tensor:
    """A replicated parameter's local value; backward sums the ranks' gradient shares (one
    all-reduce) into a ``Replicate`` gradient."""
    return local_share(DTensor.from_local(param.to_local(), param.device_mesh, param.placements, run_check=False))


def _local_view(param: DTensor) -> torch.Tensor:
    replicated = all(isinstance(p, Replicate) for p in param.placements)
    return _summed_over_ranks(param) if replicated else param.to_local()


def _local_forward(cls: type):
    """``cls.forward`` on plain tensors: DTensor inputs as shares, parameters as local views."""
    def forward(self, *args, **kwargs):
        args = [local_share(a) if isinstance(a, DTensor) else a for a in args]
        with local_parameters(self, _local_view):
            return cls.forward(self, *args, **kwargs)
    return forward


class LocalShards(ParallelStyle):
    """The module's own parameters become DTensors on the TP mesh; its forward then runs on plain
    tensors (see the module docstring). Placements: ``Shard(d)`` for each parameter the module
    declares in its ``tp_shard_dims`` ({name: dim}: how its family splits it, e.g. experts on
    their hidden features, attention sinks on heads), overridden by ``placements`` given by name
    (e.g. ``{"w1": Shard(1)}``), ``Replicate`` for the rest. Its inputs and outputs are plain
    tensors: a DTensor input is read as its replicated value. ValueError for a placement naming
    no parameter or for parameters held by submodules (give each submodule its own style)."""

    def __init__(self, placements: Mapping[str, Placement] | None = None):
        super().__init__()
        self.placements = dict(placements or {})

    def placements_of(self, module: nn.Module) -> dict[str, Placement]:
        """Each of the module's own parameters' placement under this style."""
        params = dict(module.named_parameters(recurse=False))
        unknown = sorted(set(self.placements) - set(params))
        if unknown:
            raise ValueError(f"tensor parallel: {type(module).__name__} has no parameters {unknown}")
        declared = {name: Shard(dim) for name, dim in getattr(module, "tp_shard_dims", {}).items() if name in params}
        return {name: self.placements.get(name, declared.get(name, Replicate())) for name in params}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(module).__name__
        if any(True for child in module.children() for _ in child.parameters()):
            raise ValueError(f"tensor parallel: {name} has parameters in submodules; style each submodule")
        for pname, placement in self.placements_of(module).items():
            param = module.get_parameter(pname)
            sharded = distribute_tensor(param.detach(), device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.__class__ = swapped_class(type(module), "TPLocal", _local_forward)
        return module


class PartialRegion(ParallelStyle):
    """A module every TP rank runs on the whole input and whose output is a partial sum over the
    ranks (an MoE layer: every rank routes all tokens, the experts split on hidden features):
    its input is gathered from ``between`` (the hidden state's layout outside, taken with the
    share convention), its output reduce-scattered back to ``between`` (all-reduced without
    sequence parallel). Its submodules get their own styles (router ``LocalShards``, experts
    ``LocalShards`` on their declared dims, shared experts colwise and rowwise to a partial sum)."""

    def __init__(self, between: Placement):
        super().__init__()
        self.between = between

    def _gather_input(self, mesh: DeviceMesh, module: nn.Module, inputs: tuple):
        x = inputs[0] if isinstance(inputs[0], DTensor) else DTensor.from_local(inputs[0], mesh, [self.between], run_check=False)
        return (local_share(x), *inputs[1:])

    def _scatter_output(self, mesh: DeviceMesh, module: nn.Module, inputs: tuple, out):
        partial_sum = DTensor.from_local(out, mesh, [Partial()], run_check=False)
        return partial_sum.redistribute(placements=[self.between]).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(partial(self._gather_input, device_mesh))
        module.register_forward_hook(partial(self._scatter_output, device_mesh))
        return module


class ColwiseFromShare(ColwiseParallel):
    """``ColwiseParallel``, except that a plain-tensor input (the output of a ``LocalShards``
    module inside the block) is taken with the share convention: its gradient is left for the
    block input to sum, instead of being all-reduced here. DTensor inputs behave as in torch."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        if not isinstance(x, DTensor) and tuple(input_layouts) == (Replicate(),):
            x = replicated_as_share(x, device_mesh)
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, (x, *inputs[1:]), device_mesh)
