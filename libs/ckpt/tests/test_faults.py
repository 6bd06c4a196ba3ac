"""CheckpointManager under faults: leftovers of foreign copies, final exports, unwritable folders."""

import errno
import multiprocessing
import os
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tessera.ckpt import CheckpointManager, ModelState, OptimizerState, read_dcp
from tessera.ckpt import folders
from tessera.ckpt.folders import claim


def _manager(folder, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    states = {"model": ModelState([model]), "optimizer": OptimizerState([model], [optimizer])}
    return CheckpointManager(folder, states, interval=2, **kwargs)


def test_incomplete_step_folder_is_kept_aside_and_does_not_block_its_save(tmp_path):
    stale = tmp_path / "step-2"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"\1" * 100)  # e.g. an interrupted copy: no .metadata
    manager = _manager(tmp_path)
    manager.save(2)
    assert (stale / ".metadata").is_file()
    assert set(read_dcp(stale)) == {"model", "optimizer"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-2.incomplete"]
    assert (tmp_path / "step-2.incomplete" / "__0_0.distcp").read_bytes() == b"\1" * 100  # nothing destroyed
    (tmp_path / "step-2" / ".metadata").unlink()  # damaged again: a second copy is kept beside the first
    manager.save(2)
    assert (tmp_path / "step-2.incomplete-2" / "__0_0.distcp").is_file()


def test_resume_says_which_damaged_checkpoints_it_passed_over(tmp_path, caplog):
    manager = _manager(tmp_path)
    manager.save(2)
    manager.save(4)
    (tmp_path / "step-4" / ".metadata").unlink()  # damaged after it was published
    with caplog.at_level("WARNING", logger="tessera.ckpt"):
        assert _manager(tmp_path).load() == 2
    assert "passing over incomplete checkpoints (no .metadata): step-4" in caplog.text
    assert (tmp_path / "step-4").is_dir()  # loading never deletes


def test_final_export_goes_beside_the_full_checkpoint(tmp_path):
    manager = _manager(tmp_path, last_save_model_only=True)
    manager.maybe_save(3, last_step=True)
    assert set(read_dcp(tmp_path / "step-3")) == {"model", "optimizer"}
    assert set(read_dcp(tmp_path / "step-3-model")) == {"model"}
    assert _manager(tmp_path).load() == 3


def test_resume_passes_over_newer_model_only_checkpoints(tmp_path):
    manager = _manager(tmp_path)
    manager.save(0, model_only=True)  # a seed checkpoint
    assert manager.resume_step() == (0, [])
    manager.save(2)
    manager.save(4, model_only=True)  # a final export as older versions wrote it
    assert manager.resume_step() == (2, [4])
    assert _manager(tmp_path).load() == 2


def test_unwritable_folder_is_named_with_the_os_error(tmp_path):
    (tmp_path / "file").write_text("x")
    manager = _manager(tmp_path / "file" / "ckpt")
    with pytest.raises(OSError, match=r"^checkpoint folder .*file/ckpt is not writable: Not a directory$"):
        manager.check_writable()
    assert manager.load() is None
    assert not Path(tmp_path / "file").is_dir()


def test_writability_check_leaves_no_trace(tmp_path):
    _manager(tmp_path / "new" / "ckpt").check_writable()
    assert list(tmp_path.iterdir()) == []


def test_checks_of_one_new_folder_at_once_all_pass(tmp_path):
    """Fault tolerance's replica groups start together and check their one checkpoint folder at
    once: a check removed the folder another had just made (FileNotFoundError) or failed to
    remove it (Directory not empty), 52 of 200 pairs here; that group restarted before training."""
    errors = []

    def check(folder: Path) -> None:
        try:
            _manager(folder).check_writable()
        except OSError as e:
            errors.append(e)
    for i in range(50):
        threads = [threading.Thread(target=check, args=(tmp_path / f"run-{i}" / "ckpt",)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []
    assert [p for p in tmp_path.rglob("*") if not p.is_dir()] == []  # no probe left behind


def _hold(folder, ready):
    lock = claim(folder)  # held while the file is open
    ready.set()
    time.sleep(600)
    lock.close()


def test_a_folder_has_one_writer_until_it_ends_by_any_death(tmp_path):
    """Two writers of one folder share its in-progress names and retention: their saves mixed into
    a step folder marked complete (measured: two trainer runs on one folder, step-2 unreadable)."""
    folder = tmp_path / "ckpt"
    first, second = _manager(folder), _manager(folder)
    first.claim()
    with pytest.raises(OSError, match=rf"^checkpoint folder {re.escape(str(folder))} is in use by process {os.getpid()} "
                                      rf"on {re.escape(socket.gethostname())}: two runs writing one folder"):
        second.claim()
    first.close()
    second.claim()  # given up by close()
    second.close()
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    holder = context.Process(target=_hold, args=(folder, ready))
    holder.start()
    assert ready.wait(60)
    with pytest.raises(OSError, match=f"in use by process {holder.pid} "):
        _manager(folder).claim()
    holder.kill()  # SIGKILL: no cleanup of its own
    holder.join()
    claimed = _manager(folder)
    claimed.claim()
    claimed.close()


def test_the_one_writer_removes_the_partial_saves_of_crashed_runs(tmp_path):
    """A full disk's failed save leaves its partial folder, which holds the space a re-run needs."""
    folder = tmp_path / "ckpt"
    (folder / ".step-4.tmp").mkdir(parents=True)
    (folder / ".step-4.tmp" / "__0_0.distcp").write_bytes(bytes(1024))
    manager = _manager(folder)
    manager.claim()
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]
    manager.close()


def test_a_filesystem_that_locks_only_files_open_for_writing_is_claimed_so(tmp_path, monkeypatch):
    """NFS refuses an exclusive flock on a file open read-only (EBADF): without the retry every
    run on NFS, the usual shared folder, went unclaimed."""
    real_flock = folders.fcntl.flock

    def nfs_flock(file, operation):
        if file.mode == "r":
            raise OSError(errno.EBADF, "Bad file descriptor")
        real_flock(file, operation)
    monkeypatch.setattr(folders.fcntl, "flock", nfs_flock)
    lock = claim(tmp_path / "ckpt")
    assert lock is not None and lock.mode == "r+"
    with pytest.raises(OSError, match="in use by process"):
        _manager(tmp_path / "ckpt").claim()
    lock.close()


def test_a_folder_that_cannot_be_locked_is_said_and_its_partial_saves_kept(tmp_path, monkeypatch, caplog):
    """Without a lock another run's save in progress looks like a crashed one's: it stays."""
    def no_locks(file, operation):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(folders.fcntl, "flock", no_locks)
    partial = tmp_path / "ckpt" / ".step-2.tmp"
    partial.mkdir(parents=True)
    manager = _manager(tmp_path / "ckpt")
    manager.claim()
    assert partial.is_dir() and "could not be locked" in caplog.text
    manager.close()
