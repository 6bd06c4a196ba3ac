"""A save that dies half-way leaves the last good checkpoint loadable and untouched; a published
folder's files were fsynced before it appeared (a power loss never publishes an empty file)."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import _FileSystemWriter

from tessera.ckpt import CheckpointManager, ModelState, OptimizerState, export_hf

# Saves step 1, then SIGKILLs itself while saving step 2: after the data file is written and
# before DCP writes .metadata, i.e. mid-save.
_CRASHING_TRAINER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter
    from tessera.ckpt import CheckpointManager, ModelState

    folder = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 512)  # 0.5 MB
    manager = CheckpointManager(folder, {"model": ModelState([model])}, interval=1, keep_latest_k=1)
    manager.save(1)
    torch.save(model.state_dict(), os.path.join(folder, "step1_weights.pt"))

    write_data = _FileSystemWriter.write_data
    def write_then_die(self, plan, planner):
        write_data(self, plan, planner).wait()
        os.kill(os.getpid(), signal.SIGKILL)
    _FileSystemWriter.write_data = write_then_die
    with torch.no_grad():
        model.weight.add_(1.0)
    manager.save(2)
    """
)


def _model_manager(folder, **kwargs):
    torch.manual_seed(3)
    model = nn.Linear(256, 512)
    return model, CheckpointManager(folder, {"model": ModelState([model])}, interval=1, **kwargs)


def test_sigkill_mid_save_keeps_previous_step(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", _CRASHING_TRAINER, str(folder)], env=env, capture_output=True, timeout=120)
    assert result.returncode == -9, result.stderr.decode()[-2000:]
    leftover = folder / ".step-2.tmp"
    assert any(leftover.glob("*.distcp")) and not (leftover / ".metadata").exists()
    assert (folder / "step-1").is_dir() and not (folder / "step-2").exists()

    model, manager = _model_manager(folder, keep_latest_k=1)
    assert manager.load() == 1  # the tmp folder is ignored
    expected = torch.load(folder / "step1_weights.pt", weights_only=True)
    assert torch.equal(model.weight, expected["weight"])

    manager.save(3)  # a later good save cleans the leftover, then retention applies
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["step-3"]


def _failing_write(self, plan, planner):
    raise OSError("disk full (injected)")


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_writer_exception_keeps_previous_step(tmp_path, monkeypatch, async_mode):
    model, manager = _model_manager(tmp_path, keep_latest_k=1, async_mode=async_mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager.states["optimizer"] = OptimizerState([model], [optimizer])
    manager.save(1)
    manager.wait()
    good = {k: v.clone() for k, v in model.state_dict().items()}

    monkeypatch.setattr(_FileSystemWriter, "write_data", _failing_write)
    with torch.no_grad():
        model.weight.mul_(2.0)
    with pytest.raises(OSError, match=rf"^cannot write checkpoint to {re.escape(str(tmp_path))}: disk full \(injected\)$"):
        manager.save(2)
        manager.wait()
    monkeypatch.undo()
    assert sorted(p.name for p in Path(tmp_path).iterdir() if p.name.startswith("step-")) == ["step-1"]

    fresh_model, fresh = _model_manager(tmp_path)
    fresh.states["optimizer"] = OptimizerState([fresh_model], [torch.optim.SGD(fresh_model.parameters(), lr=0.1)])
    assert fresh.load() == 1
    assert torch.equal(fresh_model.weight, good["weight"])
    manager.close()


def _record_fsyncs(monkeypatch):
    """The paths os.fsync is called on, in order (as named at that moment)."""
    synced = []
    fsync = os.fsync

    def recording(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return synced


def _assert_synced_before_publish(synced, tmp, final):
    """Every file in ``final`` was fsynced in ``tmp`` (DCP syncs ``.metadata`` as ``.metadata.tmp``
    and renames it), then ``tmp`` itself (its entries), then the parent after the rename."""
    before = synced[:synced.index(tmp)] if tmp in synced else synced
    names = sorted(p.name for p in final.iterdir())
    assert [n for n in names if tmp / n not in before and tmp / f"{n}.tmp" not in before] == []
    assert tmp in synced, "the folder's entries were not synced before it was published"
    assert final.parent in synced[synced.index(tmp):]


def test_a_save_fsyncs_every_file_and_the_folder_before_publishing(tmp_path, monkeypatch):
    synced = _record_fsyncs(monkeypatch)
    _, manager = _model_manager(tmp_path, extra_files={"model_args.json": b"{}", "notes.txt": tmp_path / "x"})
    (tmp_path / "x").write_bytes(b"copied")
    manager.save(1)
    assert {p.name for p in (tmp_path / "step-1").iterdir()} >= {".metadata", "model_args.json", "notes.txt"}
    _assert_synced_before_publish(synced, tmp_path / ".step-1.tmp", tmp_path / "step-1")


def test_a_hugging_face_export_fsyncs_every_file_and_the_folder_before_publishing(tmp_path, monkeypatch):
    synced = _record_fsyncs(monkeypatch)
    model = nn.ModuleDict({"a": nn.Linear(4, 4, bias=False), "b": nn.Linear(4, 4, bias=False)})
    assert export_hf(model, tmp_path / "hf", lambda sd: sd, max_shard_bytes=64, extra_files={"config.json": b"{}"})
    assert {p.name for p in (tmp_path / "hf").iterdir()} == {
        "config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors"}
    _assert_synced_before_publish(synced, tmp_path / ".hf.tmp", tmp_path / "hf")
