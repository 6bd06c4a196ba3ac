"""Ordinary steps read nothing back from the device (issue 15): on a GPU each read waits for the
queued work and stops the host from queueing the next step. Only log steps read (loss, grad
norm, skipped-step count); a non-finite step is still skipped exactly, on the device."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.trainer import train as train_module
from tessera.trainer.config import load_config
from tessera.trainer.train import train

torch.set_num_threads(1)

SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.disable_color_printing", "true",
         "--lr_scheduler.warmup_steps", "2"]
# Python's ways to read a tensor's value on the host
READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
         torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}
# and the ops that copy a value to the host under the hood
SCALAR_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}


class HostReads(TorchFunctionMode):
    """Counts host reads per training step (`step` is advanced by the wrapped train_step)."""

    def __init__(self):
        super().__init__()
        self.step, self.reads = 0, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.reads.setdefault(self.step, []).append(func.__name__)
        return func(*args, **(kwargs or {}))


class ScalarOps(TorchDispatchMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.host = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SCALAR_OPS:
            self.host.reads.setdefault(self.host.step, []).append(str(func))
        return func(*args, **(kwargs or {}))


def _counted_run(monkeypatch, argv):
    counter = HostReads()
    make_train_step = train_module.make_train_step

    def counting(*args, **kwargs):
        step = make_train_step(*args, **kwargs)

        def counted_step(batches):
            counter.step += 1  # what the loop reads after this call belongs to this step
            return step(batches)

        return counted_step

    monkeypatch.setattr(train_module, "make_train_step", counting)
    with counter, ScalarOps(counter):
        history = train(load_config(argv))
    return history, counter.reads


def test_ordinary_steps_read_nothing_from_the_device(tmp_path, monkeypatch):
    history, reads = _counted_run(monkeypatch, [*SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "7",
                                                "--metrics.log_freq", "3"])
    assert [h["step"] for h in history] == [1, 3, 6, 7]
    ordinary = {step: reads.get(step, []) for step in (2, 4, 5)}
    assert ordinary == {2: [], 4: [], 5: []}, ordinary
    assert all(reads.get(step) for step in (1, 3, 6, 7)), reads  # the counter sees the log steps' reads


def test_the_foreach_optimizer_reads_the_norm_each_step(tmp_path, monkeypatch):
    """The counter's own check: without a fused kernel the skip decision is a host read."""
    _, reads = _counted_run(monkeypatch, [*SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "3",
                                          "--metrics.log_freq", "3", "--optimizer.implementation", "foreach"])
    assert reads.get(2), reads


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_a_non_finite_step_changes_nothing_and_is_counted_at_the_log_step(tmp_path, monkeypatch, capsys, implementation):
    """Step 2's gradients are poisoned: its update is left out entirely (parameters, moments, step
    count), so steps 1 and 3 leave the same state as a run whose step 2 never happened."""
    make_train_step, states = train_module.make_train_step, {}

    def poisoning(parts, optimizers, *args, **kwargs):
        step, calls = make_train_step(parts, optimizers, *args, **kwargs), []

        def poisoned_step(batches):
            calls.append(1)
            if len(calls) == 2:
                hook = parts[0].output.weight.register_hook(lambda grad: grad * float("nan"))
                result = step(batches)
                hook.remove()
            else:
                result = step(batches)
            states[len(calls)] = ([p.detach().clone() for p in parts[0].parameters()],
                                  {k: {n: v.clone() for n, v in s.items()} for k, s in optimizers[0].state.items()})
            return result

        return poisoned_step

    monkeypatch.setattr(train_module, "make_train_step", poisoning)
    history = train(load_config([*SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "3",
                                 "--metrics.log_freq", "3", "--optimizer.implementation", implementation]))
    (params_1, optim_1), (params_2, optim_2) = states[1], states[2]
    assert all(torch.equal(a, b) for a, b in zip(params_1, params_2))
    assert all(torch.equal(optim_1[k][n], optim_2[k][n]) for k in optim_1 for n in optim_1[k])
    assert all(s["step"].item() == 1 for s in optim_2.values())
    assert all(s["step"].item() == 2 for s in states[3][1].values())
    out = capsys.readouterr().out
    assert "step 3: 1 optimizer step(s) skipped since the last log for a non-finite gradient norm (latest nan; 1 in this run)" in out
    assert [h["step"] for h in history] == [1, 3]


# MoE (issue 34): DeepSeek-V3's tiny flavor, 5 MoE layers
MOE = [*SMALL, "--model.name", "deepseek_v3", "--model.flavor", "tiny", "--training.steps", "4",
       "--metrics.log_freq", "4"]
CAPACITY = ["--parallelism.expert_capacity_factor", "1.25"]


def _ordinary_reads(reads):
    return {step: reads.get(step, []) for step in (2, 3)}


@pytest.mark.parametrize("dispatch", [[], CAPACITY], ids=["dropless", "capacity"])
def test_moe_steps_read_nothing_from_the_device(tmp_path, monkeypatch, dispatch):
    """One process: grouped (dropless) or batched (capacity) expert matmuls read no counts."""
    _, reads = _counted_run(monkeypatch, [*MOE, *dispatch, "--job.dump_folder", str(tmp_path)])
    assert _ordinary_reads(reads) == {2: [], 3: []}, reads


def _ep_reads(rank, world_size, dump):
    """Each EP 2 rank's reads on ordinary steps: dropless, with a capacity factor, and the dense
    debug model under FSDP 2 (what the loop reads of its own: the stop flags, a tensor in host
    memory exchanged over gloo, no device read)."""
    results = {}
    ep2 = ["--parallelism.expert_parallel_degree", "2"]
    for name, argv in (("dropless", [*MOE, *ep2]), ("capacity", [*MOE, *ep2, *CAPACITY]),
                       ("dense", [*SMALL, "--training.steps", "4", "--metrics.log_freq", "4"])):
        with pytest.MonkeyPatch.context() as monkeypatch:
            _, reads = _counted_run(monkeypatch, [*argv, "--parallelism.data_parallel_shard_degree", "2",
                                                  "--job.dump_folder", f"{dump}/{name}"])
        results[name] = _ordinary_reads(reads)
    return results


def test_expert_parallel_reads_once_per_moe_layer_dropless_and_never_with_capacity(tmp_path):
    """Dropless EP exchanges rows with variable splits, which all_to_all_single takes as Python
    ints: one read per MoE layer and forward (backward reuses them). With a capacity the splits
    are equal: the model reads nothing, as the dense one."""
    from tessera.mesh.testing import run_on_ranks

    for per_rank in run_on_ranks(_ep_reads, 2, str(tmp_path)):
        dense = per_rank["dense"]
        assert per_rank["capacity"] == dense, per_rank
        assert per_rank["dropless"] == {step: [*reads, *["tolist"] * 5] for step, reads in dense.items()}, per_rank
