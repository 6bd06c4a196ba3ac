"""CheckpointManager in one process: schedule, retention, partial loads, export, every error path."""

import io
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn

from tessera.ckpt import manager as manager_module
from tessera.ckpt import (
    CheckpointManager,
    ModelState,
    OptimizerState,
    RankLocalState,
    dcp_to_torch_save,
    read_dcp,
    rng_state,
    torch_save_to_dcp,
    write_dcp,
)


class Toy(nn.Module):
    def __init__(self, dim=6, n_layers=3):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.layers = nn.ModuleDict({str(i): nn.Linear(dim, dim) for i in range(n_layers)})
        self.head = nn.Linear(dim, 3)


class Counter:
    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _trained(seed=0, **toy_args):
    torch.manual_seed(seed)
    model = Toy(**toy_args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    return model, optimizer


def _manager(folder, model, optimizer, loader=None, train=None, **kwargs):
    states = {"model": ModelState([model]), "optimizer": OptimizerState([model], [optimizer])}
    if loader is not None:
        states["dataloader"] = RankLocalState(loader, "dp_rank_0")
    if train is not None:
        states["train"] = train  # same on every rank: a plain object entry
    return CheckpointManager(folder, states, interval=kwargs.pop("interval", 1), **kwargs)


def _steps(folder):
    return sorted(int(p.name.split("-")[1]) for p in Path(folder).glob("step-*"))


def _data_file(step_dir):
    return next(Path(step_dir).glob("*.distcp"))


def test_maybe_save_interval_and_keep_latest_k(tmp_path):
    model, optimizer = _trained()
    manager = _manager(tmp_path, model, optimizer, interval=2, keep_latest_k=2)
    for step in range(1, 8):
        manager.maybe_save(step, last_step=step == 7)
    assert _steps(tmp_path) == [6, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-6", "step-7"]  # no tmp left behind


def test_keep_all_and_no_resave_of_existing_step(tmp_path):
    model, optimizer = _trained()
    manager = _manager(tmp_path, model, optimizer)
    manager.save(1)
    before = _data_file(tmp_path / "step-1").stat().st_mtime_ns
    manager.save(2)
    manager.save(1)  # exists: not overwritten
    assert _steps(tmp_path) == [1, 2]
    assert _data_file(tmp_path / "step-1").stat().st_mtime_ns == before


def _names(folder):
    return sorted(p.name for p in Path(folder).iterdir())


def test_a_resume_from_an_older_step_sets_the_newer_ones_aside_at_its_first_save(tmp_path):
    """Steps 2..8 from an earlier run; this one resumes from step 4 with keep_latest_k=2. The newer
    checkpoints are of the timeline it leaves: its first save sets them aside with their exports
    (kept, never loaded nor counted), so retention keeps what it resumed from and wrote, its own
    step 6 is saved rather than the stale one kept, a later resume picks this run's progress, and
    its final exports are not the old run's. A load alone (load_only, tools) changes nothing."""
    model, optimizer = _trained()
    train = Counter()
    earlier = _manager(tmp_path, model, optimizer, train=train)
    for step in (2, 4, 6, 8):
        train.value = step
        earlier.save(step)
    earlier.export_model(8)
    (tmp_path / "step-8-hf").mkdir()  # a trainer's Hugging Face export
    manager = _manager(tmp_path, model, optimizer, train=train, keep_latest_k=2)
    assert manager.load(4) == 4 and train.value == 4
    assert _names(tmp_path) == ["step-2", "step-4", "step-6", "step-8", "step-8-hf", "step-8-model"]
    train.value = 105
    assert manager.save(5)
    assert _names(tmp_path) == ["step-4", "step-5", "step-6.superseded", "step-8-hf.superseded",
                                "step-8-model.superseded", "step-8.superseded"]
    train.value = 106
    assert manager.save(6)
    assert _names(tmp_path)[:3] == ["step-5", "step-6", "step-6.superseded"]
    resumed = Counter()
    assert _manager(tmp_path, *_trained(seed=1), train=resumed).load() == 6 and resumed.value == 106
    assert read_dcp(tmp_path / "step-8.superseded", only="train") == {"value": 8}


def test_only_the_checkpoints_a_load_passed_over_are_set_aside(tmp_path, monkeypatch):
    """A newer checkpoint published while or after this run loaded (another fault-tolerance
    replica group writing) is of the same run: kept."""
    model, optimizer = _trained()
    _manager(tmp_path, model, optimizer).save(2)
    manager = _manager(tmp_path, model, optimizer)
    load_into = manager_module.load_into

    def publish_step_3_then_load(*args, **kwargs):  # the other writer, while this one reads
        if not (tmp_path / "step-3").exists():
            _manager(tmp_path, model, optimizer).save(3)
        return load_into(*args, **kwargs)

    monkeypatch.setattr(manager_module, "load_into", publish_step_3_then_load)
    assert manager.load(2) == 2
    _manager(tmp_path, model, optimizer).save(5)
    manager.save(4)
    assert _names(tmp_path) == ["step-2", "step-3", "step-4", "step-5"]


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path):
    """keep_latest_k keeps the newest k and the one just written: a seed (step 0) written into
    a folder of newer checkpoints stays."""
    model, optimizer = _trained()
    for step in (2, 4):
        _manager(tmp_path, model, optimizer).save(step)
    _manager(tmp_path, model, optimizer, keep_latest_k=1).save(0, model_only=True)
    assert _names(tmp_path) == ["step-0", "step-4"]


def test_load_newest_explicit_and_missing(tmp_path):
    model, optimizer = _trained()
    loader, train = Counter(5), Counter(3)
    manager = _manager(tmp_path, model, optimizer, loader, train)
    assert manager.load() is None  # nothing saved yet: fresh start
    manager.save(3)
    loader.value, train.value = 9, 4
    manager.save(4)
    fresh_model, fresh_opt = _trained(seed=1)
    fresh_loader, fresh_train = Counter(), Counter()
    fresh = _manager(tmp_path, fresh_model, fresh_opt, fresh_loader, fresh_train)
    assert fresh.load() == 4 and (fresh_loader.value, fresh_train.value) == (9, 4)
    assert fresh.load(3) == 3 and (fresh_loader.value, fresh_train.value) == (5, 3)
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=re.escape("no checkpoint for step 7 in") + ".*available steps: \\[3, 4\\]"):
        fresh.load(7)
    with pytest.raises(FileNotFoundError, match="checkpoint folder .*nowhere does not exist"):
        _manager(tmp_path / "nowhere", fresh_model, fresh_opt).load(3)
    assert _manager(tmp_path / "nowhere", fresh_model, fresh_opt).load() is None


def test_exclude_from_loading(tmp_path):
    model, optimizer = _trained()
    _manager(tmp_path, model, optimizer, Counter(5)).save(1)
    fresh_model, fresh_opt = _trained(seed=1)
    loader = Counter(42)
    manager = _manager(tmp_path, fresh_model, fresh_opt, loader, exclude_from_loading=("dataloader", "optimizer"))
    opt_before = {k: v.clone() for k, v in fresh_opt.state_dict()["state"][0].items()}
    assert manager.load() == 1
    assert loader.value == 42
    assert torch.equal(fresh_model.embed.weight, model.embed.weight)
    assert all(torch.equal(v, fresh_opt.state_dict()["state"][0][k]) for k, v in opt_before.items())


def test_model_only_export_in_bfloat16(tmp_path):
    model, optimizer = _trained()
    manager = _manager(tmp_path, model, optimizer, Counter(5), last_save_model_only=True, export_dtype="bfloat16")
    manager.maybe_save(10, last_step=True)
    exported = read_dcp(tmp_path / "step-10-model")
    assert set(exported) == {"model"}
    for name, value in model.state_dict().items():
        assert exported["model"][name].dtype == torch.bfloat16
        assert torch.equal(exported["model"][name], value.to(torch.bfloat16))
    # The export goes beside the full checkpoint, which a longer run resumes from.
    assert set(read_dcp(tmp_path / "step-10")) == {"model", "optimizer", "dataloader"}
    # A model-only checkpoint (a seed) restores the weights only, upcast into the fp32 model.
    manager.save(11, model_only=True)
    fresh_model, fresh_opt = _trained(seed=1)
    loader = Counter(1)
    assert _manager(tmp_path, fresh_model, fresh_opt, loader).load(11) == 11
    assert torch.equal(fresh_model.head.weight, model.head.weight.to(torch.bfloat16).float())
    assert loader.value == 1


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_extra_files_go_into_every_checkpoint_folder(tmp_path, async_mode):
    model, optimizer = _trained()
    source = tmp_path / "tokenizer.model"
    source.write_bytes(b"\x00ranks\n")
    files = {"model_args.json": b'{"dim": 6}\n', "tokenizer.model": source}
    manager = _manager(tmp_path / "ckpt", model, optimizer, last_save_model_only=True, async_mode=async_mode,
                       extra_files=files)
    manager.maybe_save(1)
    manager.save(2, model_only=True)
    manager.maybe_save(3, last_step=True)
    manager.close()
    for name in ("step-1", "step-2", "step-3", "step-3-model"):
        folder = tmp_path / "ckpt" / name
        assert (folder / "model_args.json").read_bytes() == b'{"dim": 6}\n', name
        assert (folder / "tokenizer.model").read_bytes() == b"\x00ranks\n", name
    fresh_model, fresh_opt = _trained(seed=1)
    assert _manager(tmp_path / "ckpt", fresh_model, fresh_opt).load() == 3  # DCP ignores the extra files
    assert torch.equal(fresh_model.head.weight, model.head.weight)
    for bad in (".metadata", "sub/file", ""):
        with pytest.raises(ValueError, match=f"extra checkpoint file name {bad!r} must be a plain file name"):
            _manager(tmp_path, model, optimizer, extra_files={bad: b""})
    with pytest.raises(ValueError, match="extra checkpoint file 'x': str is neither bytes nor a path"):
        _manager(tmp_path, model, optimizer, extra_files={"x": "text"})


def test_pipeline_parts_merge_and_reshard_into_one_module(tmp_path):
    model, _ = _trained()
    stage0, stage1 = Toy(), Toy()
    stage0.load_state_dict(model.state_dict())
    stage1.load_state_dict(model.state_dict())
    del stage0.layers["1"], stage0.layers["2"], stage0.head  # layers keep their global names
    del stage1.embed, stage1.layers["0"]
    optims = [torch.optim.AdamW(s.parameters(), lr=1e-2) for s in (stage0, stage1)]
    for stage, opt in zip((stage0, stage1), optims):
        for p in stage.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    states = {"model": ModelState([stage0, stage1]), "optimizer": OptimizerState([stage0, stage1], optims)}
    CheckpointManager(tmp_path, states, interval=1).save(1)

    whole = Toy()
    whole_opt = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    assert _manager(tmp_path, whole, whole_opt).load() == 1
    expected_model = {**stage0.state_dict(), **stage1.state_dict()}
    assert whole.state_dict().keys() == expected_model.keys()
    for name, value in expected_model.items():
        assert torch.equal(whole.state_dict()[name], value), name
    expected_optim = states["optimizer"].state_dict()
    loaded_optim = OptimizerState([whole], [whole_opt]).state_dict()
    assert loaded_optim.keys() == expected_optim.keys()
    for key, value in expected_optim.items():
        assert torch.equal(loaded_optim[key], value) if isinstance(value, torch.Tensor) else loaded_optim[key] == value


def test_rng_state_restores_generators(tmp_path):
    import random

    model, optimizer = _trained()
    states = {"model": ModelState([model]), "rng": rng_state(0)}
    torch.manual_seed(7)
    random.seed(7)
    CheckpointManager(tmp_path, states, interval=1).save(1)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(8)
    random.seed(8)
    CheckpointManager(tmp_path, states, interval=1).load()
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_rng_state_of_more_gpus_than_here_restores_those_there_are(monkeypatch):
    """A resume on a machine with fewer GPUs than the one that saved: torch's setter fails on a
    device index beyond its own, so only the states of the GPUs here are handed to it."""
    rng = rng_state(0).obj
    state = {**rng.state_dict(), "cuda": [torch.full((16,), 1, dtype=torch.uint8), torch.full((16,), 2, dtype=torch.uint8)]}
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    rng.load_state_dict(state)
    assert [id(s) for s in restored] == [id(state["cuda"][0])]


def test_only_folders_named_as_saved_are_steps(tmp_path):
    """A copy named "step-02" is no step: taken for step 2, retention would delete a step-2 that is
    not there (the save failing after it was published), and a load of step 2 would miss it."""
    model, optimizer = _trained()
    manager = _manager(tmp_path, model, optimizer, keep_latest_k=1)
    manager.save(4)
    shutil.copytree(tmp_path / "step-4", tmp_path / "step-02")
    manager.save(6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-02", "step-6"]
    assert manager.resume_step() == (6, [])


def test_constructor_errors(tmp_path):
    model, optimizer = _trained()
    with pytest.raises(ValueError, match="export_dtype 'float8' is not one of"):
        _manager(tmp_path, model, optimizer, export_dtype="float8")
    with pytest.raises(ValueError, match="async_mode 'sometimes'"):
        _manager(tmp_path, model, optimizer, async_mode="sometimes")
    with pytest.raises(ValueError, match="interval must be a positive integer, got 0"):
        _manager(tmp_path, model, optimizer, interval=0)
    with pytest.raises(ValueError, match="keep_latest_k must be an integer >= 0, got -1"):
        _manager(tmp_path, model, optimizer, keep_latest_k=-1)
    with pytest.raises(ValueError, match="exclude_from_loading names unknown state 'rng'"):
        _manager(tmp_path, model, optimizer, exclude_from_loading=("rng",))
    with pytest.raises(ValueError, match="state name 'a.b' must"):
        CheckpointManager(tmp_path, {"a.b": ModelState([model])}, interval=1)
    with pytest.raises(ValueError, match="last_save_model_only needs a ModelState"):
        CheckpointManager(tmp_path, {"x": Counter()}, interval=1, last_save_model_only=True)


@pytest.fixture
def saved(tmp_path):
    model, optimizer = _trained()
    _manager(tmp_path, model, optimizer).save(1)
    return tmp_path, tmp_path / "step-1"


def test_truncated_shard_is_named(saved):
    folder, step_dir = saved
    data = _data_file(step_dir)
    data.write_bytes(data.read_bytes()[:-100])
    model, optimizer = _trained(seed=1)
    with pytest.raises(ValueError, match=re.escape(f"data file {data} is truncated")):
        _manager(folder, model, optimizer).load()


@pytest.mark.parametrize("damage", [lambda size: b"\0" * size, lambda size: bytes(range(256)) * (size // 256 + 1)])
def test_corrupt_shard_bytes_are_named_in_one_line(saved, damage):
    folder, step_dir = saved
    data = _data_file(step_dir)
    data.write_bytes(damage(data.stat().st_size)[:data.stat().st_size])
    model, optimizer = _trained(seed=1)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint data file {data} is corrupt")) as error:
        _manager(folder, model, optimizer).load(1)
    assert "\n" not in str(error.value) and "weights_only` set to `False`" not in str(error.value)  # not torch's advice


def test_another_ranks_bug_shows_its_traceback():
    """DCP gathers another rank's exception without its traceback, as text frames: they come
    with the error, so a bug on rank 3 is found from rank 0's output."""
    import traceback

    from tessera.ckpt.dcp_io import raise_first_failure

    frames = traceback.StackSummary.from_list([("planner.py", 42, "resolve", "shard = shards[index]")])
    with pytest.raises(RuntimeError, match=r"failed on rank 3: TypeError\('a bug'\)") as error:
        raise_first_failure(CheckpointException("read", {3: (TypeError("a bug"), frames)}))
    assert "rank 3's traceback" in "".join(error.value.__notes__) and "planner.py" in "".join(error.value.__notes__)


@pytest.mark.parametrize("failure", [IndexError("pop from empty list"), KeyError(7), EOFError()])
def test_what_a_damaged_pickle_raises_is_a_corrupt_file(saved, monkeypatch, failure):
    """The unpickler's own errors on flipped bytes (its stack, its memo; measured) name the file."""
    folder, step_dir = saved

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(FileSystemReader, "read_data", fail)
    model, optimizer = _trained(seed=1)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint data file {_data_file(step_dir)} is corrupt")):
        _manager(folder, model, optimizer).load(1)


@pytest.mark.parametrize("failure", [TypeError("a bug"), torch.OutOfMemoryError("no memory")])
def test_read_failures_that_are_not_damage_keep_their_type(saved, monkeypatch, failure):
    """Only what damaged bytes raise is reported as a corrupt file (a ValueError: bad input): a
    bug or a lack of memory stays a RuntimeError, with the rank's own exception as its cause."""
    folder, _ = saved

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(FileSystemReader, "read_data", fail)
    model, optimizer = _trained(seed=1)
    with pytest.raises(RuntimeError, match=f"failed on rank 0: {type(failure).__name__}") as error:
        _manager(folder, model, optimizer).load(1)
    assert error.value.__cause__ is failure and "corrupt" not in str(error.value)


def test_missing_and_garbage_metadata(saved):
    folder, step_dir = saved
    model, optimizer = _trained(seed=1)
    (step_dir / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match=re.escape(f"checkpoint metadata {step_dir / '.metadata'} is unreadable")):
        _manager(folder, model, optimizer).load(1)
    (step_dir / ".metadata").unlink()
    with pytest.raises(ValueError, match=re.escape(f"{step_dir / '.metadata'} is missing")):
        _manager(folder, model, optimizer).load(1)
    assert _manager(folder, model, optimizer).load() is None  # incomplete: not a candidate


def test_shape_mismatch_names_key_and_shapes(saved):
    folder, _ = saved
    model, optimizer = _trained(dim=8)
    with pytest.raises(ValueError, match=re.escape("'model.embed.weight' has shape (6, 4) there but (8, 4) here")):
        _manager(folder, model, optimizer).load()


def test_missing_key_is_named(saved):
    folder, _ = saved
    model, optimizer = _trained(n_layers=4)
    with pytest.raises(ValueError, match="is missing key 'model.layers.3.weight'"):
        _manager(folder, model, optimizer).load()


class _Evil:
    """Unpickling this creates a file: the stand-in for arbitrary code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_pickled_code_in_metadata_is_refused(saved, tmp_path):
    folder, step_dir = saved
    marker = tmp_path / "pwned"
    (step_dir / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    model, optimizer = _trained(seed=1)
    with pytest.raises(ValueError, match="unreadable: refusing to load global (io|builtins).open"):
        _manager(folder, model, optimizer).load()
    assert not marker.exists()


def test_pickled_code_in_an_object_entry_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    model, optimizer = _trained()
    sd = {"model": model.state_dict(), "dataloader": {"dp_rank_0": _Evil(str(marker))}}
    dcp.save(sd, checkpoint_id=tmp_path / "ckpt" / "step-1", no_dist=True)
    states = {"model": ModelState([model]), "dataloader": RankLocalState(Counter(), "dp_rank_0")}
    with pytest.raises(ValueError, match="'dataloader.dp_rank_0' in checkpoint .* is not weights_only-safe"):
        CheckpointManager(tmp_path / "ckpt", states, interval=1).load()
    assert not marker.exists()


def test_unsafe_rank_state_fails_at_save(tmp_path):
    class Odd(Counter):
        def state_dict(self):
            return {"value": _Evil(os.devnull)}

    model, _ = _trained()
    manager = CheckpointManager(tmp_path, {"model": ModelState([model]), "x": RankLocalState(Odd(), "r0")}, interval=1)
    with pytest.raises(ValueError, match="state 'r0' is not weights_only-safe"):
        manager.save(1)
    assert _steps(tmp_path) == []


def test_whole_checkpoint_formats(saved, tmp_path):
    _, step_dir = saved
    whole = read_dcp(step_dir)
    assert set(whole) == {"model", "optimizer"}
    assert whole["optimizer"]["param_groups.embed.weight.lr"] == 1e-2
    assert set(read_dcp(step_dir, only="model")) == set(whole["model"])
    with pytest.raises(ValueError, match="has no state 'rng'; it holds \\['model', 'optimizer'\\]"):
        read_dcp(step_dir, only="rng")

    dcp_to_torch_save(step_dir, tmp_path / "whole.pt")
    loaded = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert torch.equal(loaded["model"]["head.bias"], whole["model"]["head.bias"])
    torch_save_to_dcp(tmp_path / "whole.pt", tmp_path / "again")
    again = read_dcp(tmp_path / "again")
    assert torch.equal(again["optimizer"]["state.head.bias.exp_avg"], whole["optimizer"]["state.head.bias.exp_avg"])
    with pytest.raises(ValueError, match="already exists; refusing to overwrite"):
        write_dcp({"x": torch.zeros(1)}, tmp_path / "again")
    with pytest.raises(FileNotFoundError, match="DCP checkpoint folder .*absent does not exist"):
        read_dcp(tmp_path / "absent")
    buffer = io.BytesIO()
    torch.save({"x": _Evil(str(tmp_path / "pwned"))}, buffer)
    (tmp_path / "evil.pt").write_bytes(buffer.getvalue())
    with pytest.raises(ValueError, match="evil.pt is not a weights_only-loadable"):
        torch_save_to_dcp(tmp_path / "evil.pt", tmp_path / "evil")
    assert not (tmp_path / "pwned").exists()


def _torch_save_on_a_full_disk(obj, f):
    """torch.save's writer on a full disk: the Python file's OSError, then its own RuntimeError."""
    f.write(b"PK")
    try:
        raise OSError(28, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def test_whole_checkpoint_write_failures_are_os_errors_naming_the_file(saved, tmp_path, monkeypatch):
    _, step_dir = saved
    out = tmp_path / "whole.pt"
    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", _torch_save_on_a_full_disk)
        with pytest.raises(OSError, match="No space left on device") as error:
            dcp_to_torch_save(step_dir, out)
    assert error.value.errno == 28 and error.value.filename == str(out)
    with pytest.raises(OSError) as error:  # the folder cannot be written (read-only, or missing)
        dcp_to_torch_save(step_dir, tmp_path / "missing" / "whole.pt")
    assert error.value.filename == str(tmp_path / "missing" / "whole.pt")


class _Record:
    """A first state that checks what wrote the checkpoint (as the trainer's train_state does)."""

    def __init__(self, model: str):
        self.model = model

    def state_dict(self):
        return {"model": self.model}

    def load_state_dict(self, state):
        if state["model"] != self.model:
            raise ValueError(f"checkpoint was written by a {state['model']} run, this run trains {self.model}")


def test_the_first_states_check_speaks_before_other_models_shapes(tmp_path):
    model, optimizer = _trained()
    states = {"record": _Record("small"), "model": ModelState([model]), "optimizer": OptimizerState([model], [optimizer])}
    CheckpointManager(tmp_path, states, interval=1).save(1)
    bigger, bigger_optimizer = _trained(dim=8)
    states = {"record": _Record("big"), "model": ModelState([bigger]),
              "optimizer": OptimizerState([bigger], [bigger_optimizer])}
    with pytest.raises(ValueError, match="^checkpoint was written by a small run, this run trains big$"):
        CheckpointManager(tmp_path, states, interval=1).load()


def test_metadata_naming_files_outside_the_folder_is_refused(saved):
    import dataclasses

    folder, step_dir = saved
    metadata = pickle.loads((step_dir / ".metadata").read_bytes())
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=f"../{info.relative_path}")
                             for index, info in metadata.storage_data.items()}
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    model, optimizer = _trained(seed=1)
    with pytest.raises(ValueError, match=r"step-1 is corrupt: its metadata names data file '\.\./.*', not a file in the folder"):
        _manager(folder, model, optimizer).load(1)


class Record:
    """A state whose "groups" key came later: older checkpoints lack it."""

    optional_keys = ("groups",)

    def __init__(self, groups=None, with_groups=True):
        self.groups, self.with_groups, self.loaded = groups, with_groups, None

    def state_dict(self):
        return {"step": 1, **({"groups": self.groups} if self.with_groups else {})}

    def load_state_dict(self, state):
        self.loaded = state


def test_optional_keys_left_out_when_an_older_checkpoint_lacks_them(tmp_path):
    CheckpointManager(tmp_path / "old", {"record": Record(with_groups=False)}, interval=1).save(1)
    CheckpointManager(tmp_path / "new", {"record": Record(["a", 1])}, interval=1).save(1)
    older, newer = Record(["b", 2]), Record(["b", 2])
    CheckpointManager(tmp_path / "old", {"record": older}, interval=1).load()
    CheckpointManager(tmp_path / "new", {"record": newer}, interval=1).load()
    assert older.loaded == {"step": 1} and newer.loaded == {"step": 1, "groups": ["a", 1]}


def test_a_part_may_hold_several_optimizers(tmp_path):
    """Muon for the matrices, AdamW for the rest of one part: saved and loaded by parameter name."""
    def built(seed):
        torch.manual_seed(seed)
        model = Toy()
        matrices = [p for p in model.parameters() if p.ndim == 2]
        optimizers = [torch.optim.SGD(matrices, lr=0.1, momentum=0.9),
                      torch.optim.AdamW([p for p in model.parameters() if p.ndim == 1], lr=0.01)]
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        for o in optimizers:
            o.step()
        return model, optimizers

    model, optimizers = built(0)
    states = {"model": ModelState([model]), "optimizer": OptimizerState([model], [optimizers])}
    CheckpointManager(tmp_path, states, interval=1).save(1)
    fresh, fresh_optimizers = built(1)
    CheckpointManager(tmp_path, {"model": ModelState([fresh]), "optimizer": OptimizerState([fresh], [fresh_optimizers])},
                      interval=1).load()
    for saved, loaded in zip(optimizers, fresh_optimizers):
        for p, q in zip([p for g in saved.param_groups for p in g["params"]], [q for g in loaded.param_groups for q in g["params"]]):
            for key, value in saved.state[p].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded.state[q][key])), key
