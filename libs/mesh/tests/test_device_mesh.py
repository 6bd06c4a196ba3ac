import itertools
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from tessera.mesh import (
    backend_for,
    build_meshes,
    data_parallel_rank_and_size,
    device_type,
    init_distributed,
    mesh_layout,
    resolve_parallel_dims,
)
from tessera.mesh.layout import ACCESSORS
from tessera.mesh.testing import run_on_ranks


def test_cpu_device_and_backend():
    if not torch.cuda.is_available():
        assert device_type() == "cpu"
        with pytest.raises(ValueError, match="'cuda' was requested"):
            device_type("cuda")
    assert backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="'tpu' is not supported"):
        device_type("tpu")


def test_single_process_needs_no_launcher(monkeypatch):
    for key in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    info = init_distributed("cpu")
    assert (info.rank, info.world_size, info.launched) == (0, 1, False)
    assert not dist.is_initialized()


def _mesh_facts(rank, world_size):
    dims = resolve_parallel_dims(world_size, dp_replicate=2, tp=2)
    meshes = build_meshes(dims, "cpu")
    dp = meshes["dp"]
    # an all-reduce over the flattened dp mesh sums exactly the ranks sharing this tp coordinate
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=dp.get_group())
    return {
        "names": meshes["world"].mesh_dim_names,
        "keys": sorted(meshes),
        "dp_size": dp.size(),
        "tp_size": meshes["tp"].size(),
        "dp_sum": x,  # a tensor: results must survive the worker's exit
        "env_rank": int(os.environ["RANK"]),
    }


def test_mesh_on_four_ranks():
    facts = run_on_ranks(_mesh_facts, 4)
    assert [f["env_rank"] for f in facts] == [0, 1, 2, 3]
    for rank, f in enumerate(facts):
        assert f["names"] == ("dp_replicate", "tp")
        # dp_shard has degree 1, so neither it nor dp_shard_cp exist
        assert f["keys"] == ["dp", "dp_cp", "dp_replicate", "tp", "world"]
        assert (f["dp_size"], f["tp_size"]) == (2, 2)
        # ranks {0,2} share tp coordinate 0, {1,3} coordinate 1
        assert f["dp_sum"].item() == (0 + 2 if rank % 2 == 0 else 1 + 3)


LAYOUTS = {
    "fsdp2_tp2": dict(dp_shard=2, tp=2),
    "hsdp2x2": dict(dp_replicate=2, dp_shard=2),
    "hsdp_cp": dict(dp_replicate=2, cp=2),  # 2-D fsdp mesh over a flattened dp_shard x cp
    "ep2": dict(dp_shard=4, ep=2),
    "ep4_cp2": dict(dp_shard=2, cp=2, ep=4),  # experts' FSDP mesh has one rank
    "ep4_tp2_etp1": dict(tp=2, ep=4, ep_spans_tp=True),  # ep = dp_shard x tp
    "ep2_tp2_etp1": dict(tp=2, ep=2, ep_spans_tp=True),  # ep = tp alone (one world dim, flattened under another name)
}


def _rank_sums(mesh, rank):
    """Per mesh dim, the sum of the rank ids in this rank's group: identifies the group."""
    if mesh is None:
        return None
    sums = []
    for dim in range(mesh.ndim):
        x = torch.tensor([rank])
        dist.all_reduce(x, group=mesh.get_group(dim))
        sums.append(x.item())
    return tuple(mesh.shape), sums


def _hsdp_grad(fsdp_mesh, rank):
    """fully_shard over the 2-D (dp_replicate, dp_shard_cp) mesh averages a gradient over its four ranks."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    linear = fully_shard(torch.nn.Linear(4, 4, bias=False), mesh=fsdp_mesh)
    linear(torch.full((1, 4), float(rank + 1))).sum().backward()
    return linear.weight.grad.full_tensor()


def _accessor_facts(rank, world_size):
    facts = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, kwargs in LAYOUTS.items():
            dims = resolve_parallel_dims(world_size, **kwargs)
            meshes = build_meshes(dims, "cpu")
            facts[name] = {accessor: _rank_sums(getattr(meshes, accessor), rank) for accessor in ACCESSORS}
            facts[name]["keys"] = list(meshes)
            facts[name]["batch_rank"] = meshes.batch.get_local_rank()
            if name == "hsdp_cp":
                facts["hsdp_cp_grad"] = _hsdp_grad(meshes.fsdp, rank)
    facts["warnings"] = [str(w.message) for w in caught]
    return facts


def _group_sum(layout, rank, span):
    """Sum of the ranks that share this rank's world coordinates outside `span` (row-major ranks)."""
    coords = list(itertools.product(*map(range, layout.shape)))
    outside = [i for i, name in enumerate(layout.dim_names) if name not in span]
    return sum(r for r, c in enumerate(coords) if all(c[i] == coords[rank][i] for i in outside))


def test_accessors_are_the_described_groups():
    facts = run_on_ranks(_accessor_facts, 4)
    for name, kwargs in LAYOUTS.items():
        dims = resolve_parallel_dims(4, **kwargs)
        layout = mesh_layout(dims)
        for rank, f in enumerate(facts):
            got = f[name]
            assert got["keys"] == list(layout.mapping_keys), name
            assert got["batch_rank"] == data_parallel_rank_and_size(dims, rank)[0], name
            for accessor in ACCESSORS:
                spans = layout.spans(accessor)
                expected = None if spans is None else (
                    layout.shape_of(accessor), [_group_sum(layout, rank, span) for span in spans])
                assert got[accessor] == expected, (name, accessor, rank)

    def shape_sums(name, accessor):  # the same groups written out, rank by rank
        return [f[name][accessor] for f in facts]

    assert shape_sums("ep2", "ep") == [((2,), [s]) for s in (1, 1, 5, 5)]  # {0,1} {2,3}
    assert shape_sums("ep2", "expert_fsdp") == [((2,), [s]) for s in (2, 4, 2, 4)]  # {0,2} {1,3}
    assert shape_sums("ep4_cp2", "expert_fsdp") == [((1,), [r]) for r in range(4)]
    assert shape_sums("hsdp2x2", "fsdp") == [((2, 2), s) for s in ([2, 1], [4, 1], [2, 5], [4, 5])]
    assert shape_sums("hsdp_cp", "fsdp") == [((2, 2), s) for s in ([2, 1], [4, 1], [2, 5], [4, 5])]
    assert shape_sums("fsdp2_tp2", "dp_replicate") == [None] * 4
    for f in facts:
        # d(sum(W x))/dW has rows x = rank + 1; the mean over ranks 0..3 is 2.5
        assert torch.equal(f["hsdp_cp_grad"], torch.full((4, 4), 2.5))
        assert f["warnings"] == []  # no slicing of flattened dims back out of the world mesh


def _fail(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_worker_failure_is_reported():
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_on_ranks(_fail, 2, timeout_s=120)
