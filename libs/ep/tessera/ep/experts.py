"""Expert parallelism on modules that follow tessera's experts seam.

The seam (``tessera.models.moe.GroupedExperts`` follows it): ``forward(x, num_tokens_per_expert)``
takes the routed rows sorted by expert (x [N, dim], the first ``num_tokens_per_expert[0]`` rows
for expert 0, ...; counts [E] long) and returns [N, dim] row for row; every parameter of the
module is stacked over the experts on dim 0, and the module reads the number of experts from
its weights, so one holding a dim-0 slice runs its local experts as is. Counts None means E
equal groups of rows (a capacity per expert): then the exchange has equal splits, needs no
counts and reads nothing on the host.

``apply_ep`` keeps that signature: callers still pass their own rows and counts over all E
experts. Parameters become DTensors ``Shard(0)`` on the 1-D ep mesh (rank r holds experts
[r E/ep, (r+1) E/ep)), so checkpoints, gradient-norm clipping and FSDP see the whole experts;
the forward runs the module's own forward on the local shards between the exchanges of
``tessera.ep.dispatch``.
"""

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tessera.ep.degrees import check_ep_degree
from tessera.mesh import local_parameters, swapped_class
from tessera.ep.dispatch import combine, combine_equal, dispatch, dispatch_equal, plan_exchange

def _local_view(grad_divisor: int):
    """A DTensor parameter seen as its local experts (differentiably: gradients reach the DTensor
    as Shard(0) DTensors, divided by ``grad_divisor``). Under FSDP these are the unsharded
    parameters FSDP has just gathered. A parameter tensor parallel split first, on (ep, tp),
    stays a DTensor on the tp mesh, which the module's tensor-parallel forward views its own way
    (a tp-replicated one's gradient summed over the tp ranks' shares, as without ep)."""
    def view(param: DTensor) -> torch.Tensor:
        local = param.to_local()
        if grad_divisor != 1 and local.requires_grad:
            local.register_hook(lambda grad: grad / grad_divisor)
        mesh = param.device_mesh
        if mesh.ndim == 1:
            return local
        return DTensor.from_local(local, mesh[mesh.mesh_dim_names[1:]], param.placements[1:], run_check=False)
    return view


def _row_share(x: torch.Tensor, counts: torch.Tensor, rank: int, size: int):
    """This rank's contiguous 1/size of the rows sorted by expert (the last share may be short),
    its counts per expert, and how many rows come (before, after) it."""
    n = x.shape[0]
    per = -(-n // size)
    lo, hi = min(rank * per, n), min((rank + 1) * per, n)
    ends = counts.cumsum(0)
    return x[lo:hi], ends.clamp(lo, hi) - (ends - counts).clamp(lo, hi), (lo, n - hi)


def _equal_groups_forward(module: nn.Module, cls: type, x: torch.Tensor, group) -> torch.Tensor:
    """E groups of C rows (counts None): equal splits both ways, no counts exchanged. With rows
    split over the tp ranks each sends C / tp rows of every expert (its slice of each group) and
    gets zeros for the others' (the layer's reduce-scatter sums the shares)."""
    n_experts = next(iter(module.parameters())).shape[0]
    n_local = n_experts // module.ep_mesh.size()
    split = module.ep_split_rows
    groups = x.view(n_experts, -1, x.shape[-1])
    capacity = groups.shape[1]
    if split is not None:
        share = capacity // split.size()
        lo = split.get_local_rank() * share
        groups = groups[:, lo:lo + share]
    data_parallel = module.ep_mesh.size() // (split.size() if split is not None else 1)
    with local_parameters(module, _local_view(data_parallel if module.ep_divides_grads else 1)):
        out = combine_equal(cls.forward(module, dispatch_equal(groups.reshape(-1, x.shape[-1]), n_local, group), None),
                            n_local, group)
    if split is None:
        return out
    return F.pad(out.view(n_experts, -1, x.shape[-1]), (0, 0, lo, capacity - lo - share)).view(x.shape)


def _ep_forward(cls: type):
    """A forward that exchanges rows between the ep ranks around ``cls.forward``."""
    def forward(self, x, num_tokens_per_expert):
        group = self.ep_mesh.get_group()
        if num_tokens_per_expert is None:
            return _equal_groups_forward(self, cls, x, group)
        n_counts, n_experts = num_tokens_per_expert.shape[0], next(iter(self.parameters())).shape[0]
        if n_counts != n_experts:
            raise ValueError(f"expert parallel: {n_counts} token counts for {n_experts} experts")
        split = self.ep_split_rows
        if split is not None:
            x, num_tokens_per_expert, (before, after) = _row_share(
                x, num_tokens_per_expert, split.get_local_rank(), split.size())
        exchange = plan_exchange(num_tokens_per_expert, group)
        data_parallel = self.ep_mesh.size() // (split.size() if split is not None else 1)
        with local_parameters(self, _local_view(data_parallel if self.ep_divides_grads else 1)):
            out = combine(cls.forward(self, dispatch(x, exchange, group), exchange.local_counts), exchange, group)
        return out if split is None else F.pad(out, (0, 0, before, after))
    return forward


def apply_ep(experts: nn.Module | Iterable[nn.Module], ep_mesh: DeviceMesh | None,
             divide_grads_by_ep: bool = False, split_rows_over: DeviceMesh | None = None) -> list[nn.Module]:
    """Shards each experts module (see the module docstring) over the 1-D ``ep_mesh`` in place
    and returns them. The full parameters of the ep group's first rank are scattered (so the
    others' values do not matter), or meta tensors stay meta (``to_empty`` + ``init_weights``).
    ``ep_mesh`` None or of size 1: nothing changes. ValueError if the experts do not divide.
    Parameters already split by tensor parallel (DTensors on a 1-D mesh) become DTensors on
    (ep, that mesh), each rank keeping its own shard of its experts.

    Gradients: an expert's gradient sums the contributions of the rows every ep rank sent it,
    exactly as one process running the module on all ranks' rows. When the ep ranks are
    data-parallel ranks whose gradients get averaged (tessera's meshes carve ep out of
    dp_shard x cp), pass ``divide_grads_by_ep=True``: FSDP's default mean over the expert_fsdp
    mesh then makes the expert gradients the mean over all data-parallel ranks, like the others.

    ``split_rows_over``: a 1-D mesh inside the ep group whose ranks pass the same rows (tensor
    parallel's, when the ep group takes the tp ranks: torchtitan's expert_tensor_parallel_degree
    1). Each sends only its contiguous 1/n of them and gets zeros for the others' rows: the
    output is a partial sum over that mesh (the MoE layer's TP style reduce-scatters it) and the
    gradient of ``x`` each rank's share; ``divide_grads_by_ep`` divides by ep / n, the
    data-parallel ranks among the ep ranks.
    """
    modules = [experts] if isinstance(experts, nn.Module) else list(experts)
    if ep_mesh is None or ep_mesh.size() == 1:
        return modules
    if ep_mesh.ndim != 1:
        raise ValueError(f"expert parallel: the ep mesh must be 1-D, got dims {ep_mesh.mesh_dim_names}")
    if split_rows_over is not None and (split_rows_over.ndim != 1 or ep_mesh.size() % split_rows_over.size()):
        raise ValueError(f"expert parallel: split_rows_over {split_rows_over.mesh_dim_names} must be a 1-D mesh "
                         f"inside the ep group of {ep_mesh.size()}")
    for module in modules:
        _shard(module, ep_mesh)
        module.ep_divides_grads = divide_grads_by_ep
        module.ep_split_rows = split_rows_over
        # equal groups (a capacity per expert) split over those ranks in equal slices
        module.capacity_multiple = split_rows_over.size() if split_rows_over is not None else 1
    return modules


def _shard(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    name = type(module).__name__
    if getattr(module, "ep_mesh", None) is not None:
        raise ValueError(f"expert parallel: {name} is already expert-parallel")
    if any(True for child in module.children() for _ in child.parameters()):
        raise ValueError(f"expert parallel: {name} has parameters in submodules; the seam wants them on the module")
    params = dict(module.named_parameters(recurse=False))
    sizes = {p.shape[0] for p in params.values()}
    if len(sizes) != 1:
        raise ValueError(f"expert parallel: {name}'s parameters disagree on the number of experts "
                         f"(dim 0: {sorted(sizes)})")
    check_ep_degree(sizes.pop(), ep_mesh.size())
    joined: dict[DeviceMesh, DeviceMesh] = {}
    for pname, param in params.items():
        module.register_parameter(pname, nn.Parameter(_distribute(param, ep_mesh, joined), requires_grad=param.requires_grad))
    module.ep_mesh = ep_mesh
    module.__class__ = swapped_class(type(module), "ExpertParallel", _ep_forward)  # as fully_shard swaps


def _distribute(param: nn.Parameter, ep_mesh: DeviceMesh, joined: dict[DeviceMesh, DeviceMesh]) -> DTensor:
    """``Shard(0)`` over ep. A parameter already a DTensor on a 1-D mesh (tensor parallel's split
    of each expert) keeps that placement as the second dim of the (ep, its mesh) mesh: ep scatters
    each rank's own shard, so the ranks of that mesh must be the ep ranks' peers (an ep group of
    ranks with equal tensor-parallel index)."""
    if not isinstance(param, DTensor):
        return distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
    if param.device_mesh.ndim != 1 or isinstance(param.placements[0], Shard) and param.placements[0].dim == 0:
        raise ValueError(f"expert parallel: parameters already sharded {param.placements} over "
                         f"{param.device_mesh.mesh_dim_names}; expected a 1-D mesh, not on the expert dim")
    if param.device_mesh not in joined:
        joined[param.device_mesh] = DeviceMesh._concatenate([ep_mesh, param.device_mesh])
    local = distribute_tensor(param.to_local().detach(), ep_mesh, [Shard(0)]).to_local()
    return DTensor.from_local(local, joined[param.device_mesh], [Shard(0), *param.placements], run_check=False,
                              shape=param.shape, stride=param.stride())


def find_experts(model: nn.Module, name: str = "experts", required: bool = True) -> list[nn.Module]:
    """Every submodule of ``model`` held under the attribute ``name`` (tessera.models' MoE
    layers call theirs ``experts``), for ``apply_ep``; ValueError if there is none, unless not
    ``required`` (a pipeline stage of only dense blocks)."""
    found = [module for path, module in model.named_modules() if path.rsplit(".", 1)[-1] == name]
    if not found and required:
        raise ValueError(f"expert parallel: no submodule called {name!r} in {type(model).__name__}")
    return found
