"""Expert parallelism on modules that follow tessera's experts seam.

The seam (``tessera.models.moe.GroupedExperts`` follows it): ``forward(x, num_tokens_per_expert)``
takes the routed rows sorted by expert (x [N, dim], the first ``num_tokens_per_expert[0]`` rows
for expert 0, ...; counts [E] long) and returns [N, dim] row for row; every parameter of the
module is stacked over the experts on dim 0, and the module reads the number of experts from
its weights, so one holding a dim-0 slice runs its local experts as is.

``apply_ep`` keeps that signature: callers still pass their own rows and counts over all E
experts. Parameters become DTensors ``Shard(0)`` on the 1-D ep mesh (rank r holds experts
[r E/ep, (r+1) E/ep)), so checkpoints, gradient-norm clipping and FSDP see the whole experts;
the forward runs the module's own forward on the local shards between the exchanges of
``tessera.ep.dispatch``.
"""

from collections.abc import Iterable
from contextlib import contextmanager

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tessera.ep.degrees import check_ep_degree
from tessera.ep.dispatch import combine, dispatch, plan_exchange

_EP_CLASSES: dict[type, type] = {}


@contextmanager
def _local_parameters(module: nn.Module, grad_divisor: int):
    """The module's DTensor parameters seen as their local shards (differentiably: gradients
    reach the DTensors as Shard(0) DTensors, divided by ``grad_divisor``) while the module's own
    forward runs. Under FSDP these are the unsharded parameters FSDP has just gathered."""
    saved = dict(module._parameters)
    try:
        for name, param in saved.items():
            if isinstance(param, DTensor):
                local = param.to_local()
                if grad_divisor != 1 and local.requires_grad:
                    local.register_hook(lambda grad: grad / grad_divisor)
                module._parameters[name] = local
        yield
    finally:
        module._parameters.update(saved)


def _ep_class(cls: type) -> type:
    """A subclass of ``cls`` whose forward exchanges rows between the ep ranks around
    ``cls.forward`` (a class swap, as ``fully_shard`` does, so hooks and FSDP wrapping keep
    working and the state-dict keys stay the same)."""
    if cls not in _EP_CLASSES:
        def forward(self, x, num_tokens_per_expert):
            group = self.ep_mesh.get_group()
            n_counts, n_experts = num_tokens_per_expert.shape[0], next(iter(self.parameters())).shape[0]
            if n_counts != n_experts:
                raise ValueError(f"expert parallel: {n_counts} token counts for {n_experts} experts")
            exchange = plan_exchange(num_tokens_per_expert, group)
            with _local_parameters(self, self.ep_mesh.size() if self.ep_divides_grads else 1):
                out = cls.forward(self, dispatch(x, exchange, group), exchange.local_counts)
            return combine(out, exchange, group)

        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": forward})
    return _EP_CLASSES[cls]


def apply_ep(experts: nn.Module | Iterable[nn.Module], ep_mesh: DeviceMesh | None,
             divide_grads_by_ep: bool = False) -> list[nn.Module]:
    """Shards each experts module (see the module docstring) over the 1-D ``ep_mesh`` in place
    and returns them. The full parameters of the ep group's first rank are scattered (so the
    others' values do not matter), or meta tensors stay meta (``to_empty`` + ``init_weights``).
    ``ep_mesh`` None or of size 1: nothing changes. ValueError if the experts do not divide.

    Gradients: an expert's gradient sums the contributions of the rows every ep rank sent it,
    exactly as one process running the module on all ranks' rows. When the ep ranks are
    data-parallel ranks whose gradients get averaged (tessera's meshes carve ep out of
    dp_shard x cp), pass ``divide_grads_by_ep=True``: FSDP's default mean over the expert_fsdp
    mesh then makes the expert gradients the mean over all data-parallel ranks, like the others.
    """
    modules = [experts] if isinstance(experts, nn.Module) else list(experts)
    if ep_mesh is None or ep_mesh.size() == 1:
        return modules
    if ep_mesh.ndim != 1:
        raise ValueError(f"expert parallel: the ep mesh must be 1-D, got dims {ep_mesh.mesh_dim_names}")
    for module in modules:
        _shard(module, ep_mesh)
        module.ep_divides_grads = divide_grads_by_ep
    return modules


def _shard(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    name = type(module).__name__
    if isinstance(module, tuple(_EP_CLASSES.values())):
        raise ValueError(f"expert parallel: {name} is already expert-parallel")
    if any(True for child in module.children() for _ in child.parameters()):
        raise ValueError(f"expert parallel: {name} has parameters in submodules; the seam wants them on the module")
    params = dict(module.named_parameters(recurse=False))
    sizes = {p.shape[0] for p in params.values()}
    if len(sizes) != 1:
        raise ValueError(f"expert parallel: {name}'s parameters disagree on the number of experts "
                         f"(dim 0: {sorted(sizes)})")
    check_ep_degree(sizes.pop(), ep_mesh.size())
    for pname, param in params.items():
        sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
        module.register_parameter(pname, nn.Parameter(sharded, requires_grad=param.requires_grad))
    module.ep_mesh = ep_mesh
    module.__class__ = _ep_class(type(module))


def find_experts(model: nn.Module, name: str = "experts") -> list[nn.Module]:
    """Every submodule of ``model`` held under the attribute ``name`` (tessera.models' MoE
    layers call theirs ``experts``), for ``apply_ep``; ValueError if there is none."""
    found = [module for path, module in model.named_modules() if path.rsplit(".", 1)[-1] == name]
    if not found:
        raise ValueError(f"expert parallel: no submodule called {name!r} in {type(model).__name__}")
    return found
