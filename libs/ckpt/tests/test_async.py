"""Async saves write exactly what sync saves write, snapshot the state at save time, never overlap."""

import io
import time

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tessera.ckpt import CheckpointManager, ModelState, OptimizerState, RankLocalState, read_dcp, rng_state
from tessera.mesh.testing import run_on_ranks


class Loader:
    def __init__(self, position):
        self.position = position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def _train_step(model, optimizer, seed):
    torch.manual_seed(seed)
    model(torch.randn(3, 10)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _setup(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 14), nn.Tanh(), nn.Linear(14, 10))
    if world_size > 1:
        mesh = init_device_mesh("cpu", (world_size,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, optimizer, seed=rank)
    states = {
        "model": ModelState([model]),
        "optimizer": OptimizerState([model], [optimizer]),
        "dataloader": RankLocalState(Loader(rank + 3), f"dp_rank_{rank}"),
        "rng": rng_state(rank),
    }
    return model, optimizer, states


def _slow_down_writes():
    """Background writes start late, so the training step below surely runs before them."""
    write_data = FileSystemWriter.write_data

    def late_write_data(self, plan, planner):
        time.sleep(0.5)
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = late_write_data


def _save_each_mode(rank, world_size, root):
    model, optimizer, states = _setup(rank, world_size)
    rng = torch.get_rng_state()
    for mode in ("disabled", "async_with_pinned_mem", "async"):  # async last: it trains on
        torch.set_rng_state(rng)  # the same RNG state goes into every checkpoint
        manager = CheckpointManager(f"{root}/{mode}", states, interval=1, async_mode=mode)
        if mode == "async":
            _slow_down_writes()
        manager.save(1)
        if mode == "async":
            # Training goes on while step 1 is written: the checkpoint must hold the state at
            # save time. Saving step 2 right away waits for step 1 (saves never overlap).
            _train_step(model, optimizer, seed=10 + rank)
            manager.save(2)
            _train_step(model, optimizer, seed=20 + rank)
        manager.close()
    return rank


def _decoded(value):
    """Per-rank states are torch.save bytes; compare what they hold."""
    return torch.load(io.BytesIO(value), weights_only=True) if isinstance(value, bytes) else value


def _assert_same(a, b, where=""):
    assert a.keys() == b.keys(), where
    for key in a:
        x, y = _decoded(a[key]), _decoded(b[key])
        if isinstance(x, dict):
            _assert_same(x, y, f"{where}/{key}")
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"{where}/{key}"
        else:
            assert x == y, f"{where}/{key}"


def _check(root):
    sync = read_dcp(root / "disabled" / "step-1")
    assert read_dcp(root / "disabled" / "step-1", only="dataloader").keys() >= {"dp_rank_0"}
    _assert_same(sync, read_dcp(root / "async" / "step-1"))
    _assert_same(sync, read_dcp(root / "async_with_pinned_mem" / "step-1"))
    later = read_dcp(root / "async" / "step-2", only="model")
    assert not torch.equal(later["0.weight"], sync["model"]["0.weight"])  # step 2 saw the training step
    assert sorted(p.name for p in (root / "async").iterdir()) == ["step-1", "step-2"]


def test_async_equals_sync_under_fsdp(tmp_path):
    assert run_on_ranks(_save_each_mode, 2, str(tmp_path)) == [0, 1]
    _check(tmp_path)


def test_async_equals_sync_in_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(FileSystemWriter, "write_data", FileSystemWriter.write_data)  # undone after the test
    _save_each_mode(0, 1, str(tmp_path))
    _check(tmp_path)
