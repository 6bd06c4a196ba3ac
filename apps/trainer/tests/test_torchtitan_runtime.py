"""What torchtitan 0.2.2's [metrics], [profiling] and [validation] keys do at run time, beside
their names: which steps a trace and a memory snapshot hold, where a replica group's metrics go,
how many batches a validation reads."""

import json
import os
from pathlib import Path

import pytest
import torch

from tessera.trainer import profiling
from tessera.trainer import train as train_module
from tessera.trainer import validation as validation_module
from tessera.trainer.config import load_config
from tessera.trainer.metrics import metrics_folder
from tessera.trainer.train import train

torch.set_num_threads(1)

SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
         "--metrics.disable_color_printing", "true", "--lr_scheduler.warmup_steps", "2",
         "--training.dataloader.num_workers", "0"]


def _embeddings(trace: Path) -> int:
    """Forward passes in a trace: the model's one token embedding per forward."""
    return sum(event.get("name") == "aten::embedding" for event in json.loads(trace.read_text())["traceEvents"])


def test_step_n_s_trace_holds_its_validation_and_the_ops_shapes(tmp_path):
    """torchtitan advances the profiler at the end of each iteration: iteration_4's trace is step
    4's training forward and its two validation batches; iteration_2's is step 2's forward
    alone (step 1's validation belongs to step 1)."""
    train(load_config([*SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "4",
                       "--profiling.enable_profiling", "true", "--profiling.profile_freq", "2",
                       "--profiling.profiler_warmup", "0", "--validation.enable", "true", "--validation.freq", "4",
                       "--validation.steps", "2"]))
    traces = tmp_path / "profile_traces"
    assert _embeddings(traces / "iteration_2" / "rank0_trace.json") == 1
    assert _embeddings(traces / "iteration_4" / "rank0_trace.json") == 3
    events = json.loads((traces / "iteration_2" / "rank0_trace.json").read_text())["traceEvents"]
    assert any("Input Dims" in event.get("args", {}) for event in events)  # torchtitan's record_shapes


def test_memory_snapshots_every_profile_freq_steps_and_on_out_of_memory(tmp_path, monkeypatch):
    """A resumed run (from step 1) snapshots after step 2; step 4 runs out of memory: the last
    completed step's snapshot is dumped as iteration_3_exit (torchtitan's name) and the error
    goes on."""
    recorded = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kwargs: recorded.append(kwargs))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: Path(path).write_bytes(b"snapshot"))
    config = load_config(["--profiling.enable_memory_snapshot", "true", "--profiling.profile_freq", "2"])
    with pytest.raises(torch.OutOfMemoryError), profiling.memory_snapshots(config, tmp_path, 3, 1) as snapshots:
        snapshots.step_done(2)
        snapshots.step_done(3)
        raise torch.OutOfMemoryError("CUDA out of memory")
    folder = tmp_path / "memory_snapshot"
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.pickle")) == [
        "iteration_2/rank3_memory_snapshot.pickle", "iteration_3_exit/rank3_memory_snapshot.pickle"]
    assert recorded == [{"max_entries": 100_000}]


def test_each_replica_group_logs_into_a_folder_of_its_own(tmp_path):
    """Under fault tolerance every replica group has a rank 0 that logs: torchtitan gives each its
    replica_<id> folder, under which save_for_all_ranks adds rank_<r>."""
    group = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "1"]
    folder = metrics_folder(load_config(group), tmp_path, 0)
    assert folder.name == "replica_1" and folder.parent.parent == tmp_path / "tb"
    assert metrics_folder(load_config([*group, "--metrics.save_for_all_ranks", "true"]), tmp_path, 3) == folder / "rank_3"
    assert metrics_folder(load_config([]), tmp_path, 0).parent == tmp_path / "tb"


def test_each_replica_group_traces_and_snapshots_into_a_folder_of_its_own(tmp_path, monkeypatch):
    """Each group's rank 0 wrote iteration_N/rank0_trace.json and rank0_memory_snapshot.pickle over
    the other groups' files: torchtitan's fault-tolerant trainer adds replica_<id>."""
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kwargs: None)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: Path(path).write_bytes(b"snapshot"))
    config = load_config(["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2",
                          "--fault_tolerance.replica_id", "1", "--profiling.enable_profiling", "true",
                          "--profiling.enable_memory_snapshot", "true", "--profiling.profile_freq", "2",
                          "--profiling.profiler_warmup", "0"])
    with (profiling.profiler(config, tmp_path, 0, "cpu", 0) as profiler,
          profiling.memory_snapshots(config, tmp_path, 0, 0) as snapshots):
        for step in (1, 2):
            torch.ones(2).sum()
            profiler.step()
            snapshots.step_done(step)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.*")) == [
        "memory_snapshot/iteration_2/replica_1/rank0_memory_snapshot.pickle",
        "profile_traces/iteration_2/replica_1/rank0_trace.json"]


def test_each_replica_group_s_flight_recorder_dumps_into_a_folder_of_its_own(tmp_path, monkeypatch):
    """NCCL's flight recorder names its dumps <prefix><rank>: a replica group's own folder keeps
    the groups' rank 0 dumps apart; the user's own setting still wins."""
    for name in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    group = ["--job.dump_folder", str(tmp_path), "--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2",
             "--fault_tolerance.replica_id", "1"]
    train_module._flight_recorder(load_config(group))
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "comm_traces" / "replica_1" / "rank_")
    assert (tmp_path / "comm_traces" / "replica_1").is_dir() and os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "20000"
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/site/traces/rank_")
    train_module._flight_recorder(load_config(group))
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/site/traces/rank_"


def test_validation_reads_validation_steps_batches_from_a_smaller_set(tmp_path, monkeypatch):
    """validation.steps batches, re-reading a set that holds fewer (torchtitan's loader loops);
    -1 reads the set once."""
    path = tmp_path / "validation.txt"
    path.write_text("\n\n".join(f"validation {i} " + "text " * 40 for i in range(5)))
    counts, build = [], validation_module.build_dataloader

    def counting(*args, **kwargs):
        counts.append(0)
        for batch in build(*args, **kwargs):
            counts[-1] += 1
            yield batch

    monkeypatch.setattr(validation_module, "build_dataloader", counting)
    common = [*SMALL, "--training.steps", "1", "--validation.enable", "true", "--validation.dataset_path", str(path)]
    train(load_config([*common, "--job.dump_folder", str(tmp_path / "whole"), "--validation.steps", "-1"]))
    (whole,) = counts
    assert 0 < whole < 12
    train(load_config([*common, "--job.dump_folder", str(tmp_path / "more"), "--validation.steps", "12"]))
    assert counts[1:] == [12]
