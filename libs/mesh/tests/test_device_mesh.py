import os

import pytest
import torch
import torch.distributed as dist

from tessera.mesh import backend_for, build_meshes, device_type, init_distributed, resolve_parallel_dims
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


def _fail(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_worker_failure_is_reported():
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_on_ranks(_fail, 2, timeout_s=120)
