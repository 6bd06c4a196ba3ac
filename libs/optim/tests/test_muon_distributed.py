"""tessera.optim.Muon on sharded parameters equals one-process Muon, with each sharded matrix
orthogonalised by exactly one owner rank: every placement a trainer makes (FSDP rows, TP rows or
columns, FSDP x TP, HSDP, experts split across ranks and within them), uneven shards included."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tessera.mesh.testing import run_on_ranks

SHAPES = [(16, 24), (40, 12), (7, 10), (3, 9), (4, 6, 10)]  # the last: 4 experts of 6 x 10
KWARGS = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32)
STEPS = 3

# mesh shape, names, placements for 2-D tensors, placements for the expert stack
LAYOUTS = {
    "rows4": ((4,), ("dp",), (Shard(0),), (Shard(1),)),
    "cols4": ((4,), ("tp",), (Shard(1),), (Shard(2),)),
    "fsdp_x_tp": ((2, 2), ("dp", "tp"), (Shard(0), Shard(1)), (Shard(1), Shard(2))),
    "rows_twice": ((2, 2), ("dp", "tp"), (Shard(0), Shard(0)), (Shard(1), Shard(1))),
    "hsdp": ((2, 2), ("replicate", "shard"), (Replicate(), Shard(0)), (Replicate(), Shard(1))),
    "experts_split": ((2, 2), ("ep", "dp"), (Shard(0), Shard(1)), (Shard(0), Shard(1))),
}


def _data():
    torch.manual_seed(0)
    params = [torch.randn(s) * 0.1 for s in SHAPES]
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(STEPS)]
    return params, grads


def _one_process():
    from tessera.optim import Muon

    params, grads = _data()
    params = [p.requires_grad_() for p in params]
    optimizer = Muon(params, **KWARGS)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g
        optimizer.step()
    return [p.detach() for p in params]


def _sharded(rank, world_size, layout):
    import tessera.optim.muon as muon_module
    from tessera.optim import Muon

    shape, names, matrix, stack = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    params, grads = _data()
    placements = [stack if p.ndim == 3 else matrix for p in params]
    dparams = [nn.Parameter(distribute_tensor(p, mesh, pl)) for p, pl in zip(params, placements)]
    calls = []
    ns = muon_module.orthogonalise
    muon_module.orthogonalise = lambda u, **kw: calls.append(tuple(u.shape)) or ns(u, **kw)
    try:
        optimizer = Muon(dparams, **KWARGS)
        for step in grads:
            for p, g, pl in zip(dparams, step, placements):
                p.grad = distribute_tensor(g, mesh, pl)
            optimizer.step()
    finally:
        muon_module.orthogonalise = ns
    buffers = [optimizer.state[p]["momentum_buffer"].placements == p.placements for p in dparams]
    return [p.full_tensor() for p in dparams], calls, buffers


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_muon_equals_one_process(layout):
    expected = _one_process()
    results = run_on_ranks(_sharded, 4, layout)
    for values, _, buffers in results:
        assert all(buffers)
        for got, want in zip(values, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # each matrix is orthogonalised once per step by one rank; the owners take turns
    calls = [c for _, c, _ in results]
    _, _, matrix, stack = LAYOUTS[layout]
    replicas = 2 if layout == "hsdp" else 1  # each replica group orthogonalises its own copy
    expert_groups = 2 if layout == "experts_split" else 1  # the expert halves are different matrices
    whole_stack_matrices = 4 // expert_groups
    n_whole = sum(len(c) for c in calls)
    assert n_whole == STEPS * replicas * (len(SHAPES) - 1 + expert_groups), calls
    assert max(len(c) for c in calls) == STEPS * -(-n_whole // STEPS // 4), calls  # the owners take turns
    assert all(shape[0] == whole_stack_matrices for c in calls for shape in c if len(shape) == 3), calls


def _fsdp_over_tp(rank, world_size):
    """fully_shard over a tensor-parallel linear: the owner sees exactly the whole matrix."""
    from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tessera.optim import apply_whole

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 14, bias=False), nn.Linear(14, 6, bias=False))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    seen = []
    for index, p in enumerate(model.parameters()):
        whole = p.full_tensor()

        def check(w, whole=whole):
            seen.append(torch.equal(w, whole))
            return w * 2

        doubled = apply_whole(p, p.to_local(), index, check)
        assert torch.equal(doubled, p.to_local() * 2)
    return seen


def test_fsdp_over_tensor_parallel_placements_reassemble():
    seen = [s for rank_seen in run_on_ranks(_fsdp_over_tp, 4) for s in rank_seen]
    assert seen == [True, True]  # two matrices, one owner each
