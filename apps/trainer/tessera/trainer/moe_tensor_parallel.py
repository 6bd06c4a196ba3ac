"""The MoE layer under tensor parallel, as torchtitan 0.2 lays it out: the trainer's composition of
tessera.tp's share-convention styles with the MoE layer convention (libraries do not import each
other). torchtitan's expert_tensor_parallel_degree has no effect without ep; with ep see
``MoETensorParallel``'s ``split_experts`` and ``tessera.ep.apply_ep``. The layer all-gathers the
sequence-split hidden state, every TP rank routes all tokens, and the work is split on hidden
features: the routed experts' w1/w3 on their output rows and w2 on its input columns (each rank
holds every expert's slice), the shared experts colwise/rowwise. Each rank's output is a partial
sum, reduce-scattered back to sequence shards (all-reduced without sequence parallel).

Gradients follow tessera.tp.local's share convention: the router and the experts' inputs get
this rank's share, summed once by the reduce-scatter behind the layer's input; the router
weight's shares are summed over the TP ranks. Routing is identical on every TP rank, so expert
loads (the router-bias update) count each token once without any TP reduction. A sequence-wise
balance loss is computed whole on every TP rank: its gradient scale must be divided by the TP
degree (``tessera.models.moe.set_aux_loss_scale``).

Layer conventions (tessera.models.moe.MoE follows them): forward(x [B, T, dim]) -> [B, T, dim];
submodules ``router.gate`` (a linear), ``experts`` (w1, w3 [E, hidden, dim], w2 [E, dim, hidden])
and ``shared_experts`` (a SwiGLU ``w1``/``w2``/``w3``, or None).
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from tessera.tp import ColwiseFromShare, Layouts, LocalShards, local_share

# The routed experts split on hidden features (torchtitan's expert TensorParallel).
EXPERT_SHARDS = {"w1": Shard(1), "w2": Shard(2), "w3": Shard(1)}


def _gather_input(between: Placement, mesh: DeviceMesh, module: nn.Module, inputs: tuple):
    x = inputs[0] if isinstance(inputs[0], DTensor) else DTensor.from_local(inputs[0], mesh, [between], run_check=False)
    return (local_share(x), *inputs[1:])


def _scatter_output(between: Placement, mesh: DeviceMesh, module: nn.Module, inputs: tuple, out):
    partial_sum = DTensor.from_local(out, mesh, [Partial()], run_check=False)
    return partial_sum.redistribute(placements=[between]).to_local()


class MoETensorParallel(ParallelStyle):
    """The ParallelStyle of one MoE layer (see the module docstring); ``between`` is the hidden
    state's layout outside it (``Layouts.between_blocks``). ``split_experts=False`` leaves the
    routed experts to expert parallel over an ep group holding the tp ranks (``apply_ep`` with
    ``split_rows_over`` the tp mesh): its output is a partial sum over tp as well."""

    def __init__(self, between: Placement, split_experts: bool = True):
        super().__init__()
        self.between = between
        self.split_experts = split_experts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        plan = {"router.gate": LocalShards(), **({"experts": LocalShards(EXPERT_SHARDS)} if self.split_experts else {})}
        if getattr(module, "shared_experts", None) is not None:
            plan.update({"shared_experts.w1": ColwiseFromShare(), "shared_experts.w3": ColwiseFromShare(),
                         "shared_experts.w2": RowwiseParallel(output_layouts=Partial())})
        for style in plan.values():
            style.src_data_rank = self.src_data_rank
        parallelize_module(module, device_mesh, plan)
        module.register_forward_pre_hook(partial(_gather_input, self.between, device_mesh))
        module.register_forward_hook(partial(_scatter_output, self.between, device_mesh))
        return module


def moe_tp_style(layouts: Layouts, split_experts: bool = True) -> ParallelStyle:
    """tessera.tp StyleFactory for the "moe" role (bind ``split_experts`` with functools.partial)."""
    return MoETensorParallel(layouts.between_blocks, split_experts)
