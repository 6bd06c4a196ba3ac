"""CheckpointManager under faults: leftovers of foreign copies, final exports, unwritable folders."""

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from tessera.ckpt import CheckpointManager, ModelState, OptimizerState, read_dcp


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
