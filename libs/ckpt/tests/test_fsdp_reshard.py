"""Save under FSDP on 4 ranks, load under FSDP on 2 ranks and in one process without a group;
each load then trains 2 steps like the uninterrupted 4-rank run (one global batch per step, split
over the ranks): every weight within 1e-7 (fp32, only the reduction order differs; measured
3e-8 under FSDP 2)."""

import copy
import io
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tessera.ckpt.manager
from tessera.ckpt import CheckpointManager, ModelState, OptimizerState, RankLocalState, rng_state
from tessera.mesh.testing import run_on_ranks

DIM = 18  # not a multiple of 4: uneven shards


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, DIM)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for i in range(3)})
        self.head = nn.Linear(DIM, 5)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x)


class Loader:
    def __init__(self, position=0):
        self.position = position

    def state_dict(self):
        return {"position": self.position, "seen": torch.tensor([self.position, 2 * self.position])}

    def load_state_dict(self, state):
        self.position = state["position"]


def _fsdp_toy(world_size, seed):
    torch.manual_seed(seed)
    model = Toy()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _states(model, optimizer, loader, rank):
    return {
        "model": ModelState([model]),
        "optimizer": OptimizerState([model], [optimizer]),
        "dataloader": RankLocalState(loader, f"dp_rank_{rank}"),
        "rng": rng_state(rank),
    }


def _full(model, optimizer):
    """Whole model and optimizer state on this rank (plain tensors, copied: training goes on)."""
    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    return copy.deepcopy((get_model_state_dict(model, options=options),
                          get_optimizer_state_dict(model, optimizer, options=options)))


def _packed(*values):
    """Results leave a worker as bytes: tensors sent through the queue would share memory
    with a process that is about to exit."""
    buffer = io.BytesIO()
    torch.save(values, buffer)
    return buffer.getvalue()


def _unpacked(data):
    return torch.load(io.BytesIO(data), weights_only=True)


def _continue(model, optimizer, rank, world_size):
    """Steps 3 and 4 on a global batch of 8 rows per step, this rank's share of it (an own
    generator: the global RNG's draws are compared). Returns the full weights after them."""
    for step in (3, 4):
        rows = torch.randn(8, 6, generator=torch.Generator().manual_seed(step)).chunk(world_size)[rank]
        model(rows).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return _full(model, optimizer)[0]


def _train_and_save(rank, world_size, folder):
    model, optimizer = _fsdp_toy(world_size, seed=0)
    for step in range(2):
        torch.manual_seed(100 * step + rank)
        model(torch.randn(3, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    manager = CheckpointManager(folder, _states(model, optimizer, Loader(10 + rank), rank), interval=1)
    manager.save(2)
    manager.close()
    weights, optim = _full(model, optimizer)
    draw = torch.rand(4)
    return _packed(weights, optim, draw, _continue(model, optimizer, rank, world_size))


def _load(rank, world_size, folder):
    model, optimizer = _fsdp_toy(world_size, seed=1)
    loader = Loader()
    step = CheckpointManager(folder, _states(model, optimizer, loader, rank), interval=1).load()
    draw = torch.rand(4)
    weights, optim = _full(model, optimizer)
    return _packed(step, weights, optim, loader.position, draw, _continue(model, optimizer, rank, world_size))


def _assert_same(expected, actual):
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, actual[key]), key
        else:
            assert value == actual[key], key


def test_fsdp4_checkpoint_loads_under_fsdp2_and_single_process(tmp_path):
    folder = str(tmp_path / "ckpt")
    saved = [_unpacked(result) for result in run_on_ranks(_train_and_save, 4, folder)]
    weights, optim, _, uninterrupted = saved[0]
    assert optim["state.layers.1.0.weight.exp_avg"].abs().sum() > 0  # AdamW state exists

    for rank, result in enumerate(run_on_ranks(_load, 2, folder)):
        step, loaded_weights, loaded_optim, position, draw, continued = _unpacked(result)
        assert step == 2
        _assert_same(weights, loaded_weights)
        _assert_same(optim, loaded_optim)
        assert position == 10 + rank  # this dp rank's data loader state
        assert torch.equal(draw, saved[rank][2])  # this rank's RNG continues where it was saved
        torch.testing.assert_close(continued, uninterrupted, rtol=0, atol=1e-7)

    assert not dist.is_initialized()
    torch.manual_seed(1)
    model = Toy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = Loader()
    assert CheckpointManager(folder, _states(model, optimizer, loader, 0), interval=1).load() == 2
    assert torch.equal(torch.rand(4), saved[0][2])
    loaded_weights, loaded_optim = _full(model, optimizer)
    _assert_same(weights, loaded_weights)
    _assert_same(optim, loaded_optim)
    assert loader.position == 10
    torch.testing.assert_close(_continue(model, optimizer, 0, 1), uninterrupted, rtol=0, atol=1e-7)


def _resume_older_and_save(rank, world_size, folder):
    model, optimizer = _fsdp_toy(world_size, seed=0)
    states = _states(model, optimizer, Loader(rank), rank)
    for step in (1, 2):
        CheckpointManager(folder, states, interval=1).save(step)
    manager = CheckpointManager(folder, states, interval=1)
    set_aside = tessera.ckpt.manager.set_aside
    tessera.ckpt.manager.set_aside = lambda *args: time.sleep(1) or set_aside(*args)  # rank 0: late
    try:
        return manager.load(1), manager.save(2)
    finally:
        tessera.ckpt.manager.set_aside = set_aside  # the ranks stay up for other tests


def test_every_rank_saves_anew_the_step_a_resume_from_an_older_one_set_aside(tmp_path):
    """Rank 0 sets step-2 aside before any rank looks for it (a barrier): no rank finds it still
    there and skips the save the others write."""
    folder = tmp_path / "ckpt"
    assert run_on_ranks(_resume_older_and_save, 2, str(folder), timeout_s=60) == [(1, True), (1, True)]
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-2", "step-2.superseded"]
