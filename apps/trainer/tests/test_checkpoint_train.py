"""Checkpoints through the trainer in one process: exact resume after a SIGKILL, load_step,
exclude_from_loading, keep_latest_k, the final model-only save, async saves, Hugging Face
export and import, and bad input."""

import dataclasses
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tessera.ckpt import load_hf, read_dcp, save_hf, write_dcp
from tessera.ckpt import manager as manager_module
from tessera.ckpt.folders import LOCK_FILE, claim
from tessera.data import build_dataloader, load_dataset, load_tokenizer
from tessera.models import get_model_spec
from tessera.trainer.config import load_config
from tessera.trainer.main import main
from tessera.trainer.step import cross_entropy
from tessera.trainer.train import train

# One thread: faster on a shared 2-core box, and the SIGKILL test's subprocess must compute
# bit for bit like this process (OMP_NUM_THREADS=1 there).
torch.set_num_threads(1)

SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.mixed_precision_param",
         "float32", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
         "--metrics.disable_color_printing", "true"]
CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false"]


def run(dump, *extra):
    return train(load_config([*SMALL, "--job.dump_folder", str(dump), *extra]))


def numbers(history):
    return [(h["step"], h["loss"], h["grad_norm"], h["lr"]) for h in history]


def steps_in(folder):
    """Everything in a checkpoint folder but the run's claim on it (tessera.ckpt's lock file)."""
    return sorted(p.name for p in Path(folder).iterdir() if p.name != LOCK_FILE)


def assert_same(a, b, where=""):
    """Nested checkpoint contents equal: tensors bit for bit (dtype too), objects by ==."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """4 steps, full checkpoints at steps 2 and 4: (history, dump folder). Tests copy it."""
    dump = tmp_path_factory.mktemp("run4")
    return run(dump, "--training.steps", "4", *CKPT), dump


def copy_steps(run4, dest, *steps):
    for step in steps:
        shutil.copytree(run4[1] / "checkpoint" / f"step-{step}", dest / "checkpoint" / f"step-{step}")
    return dest


def test_sigkill_then_resume_matches_the_uninterrupted_run(tmp_path):
    steps = 10
    argv = [*SMALL, "--training.steps", str(steps), "--checkpoint.enable", "true", "--checkpoint.interval", "2",
            "--checkpoint.last_save_model_only", "false", "--job.dump_folder", str(tmp_path / "run")]
    folder = tmp_path / "run" / "checkpoint"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    log = tmp_path / "killed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tessera.trainer.main", *argv], env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 300
        while not (folder / "step-4" / ".metadata").is_file():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step-4 checkpoint within 300 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    done = max(int(p.name[5:]) for p in folder.glob("step-*") if (p / ".metadata").is_file())
    assert 4 <= done < steps, f"the run was killed too late (newest checkpoint step-{done})"
    # A save that crashed half-way: data written, no .metadata (the kill may have left one too).
    partial = folder / f".step-{done + 2}.tmp"
    partial.mkdir(exist_ok=True)
    (partial / "__0_0.distcp").write_bytes(b"\0" * 1000)

    resumed = train(load_config(argv))
    reference = run(tmp_path / "reference", "--training.steps", str(steps))
    assert numbers(resumed) == numbers(reference)[done:]  # bit for bit: loss, grad norm and lr
    assert steps_in(folder) == sorted(f"step-{s}" for s in range(2, steps + 1, 2))  # leftover gone


def test_load_step_resumes_an_older_checkpoint_exactly(run4, tmp_path, capsys):
    dump = copy_steps(run4, tmp_path, 2, 4)
    resumed = run(dump, "--training.steps", "4", *CKPT, "--checkpoint.load_step", "2")
    assert numbers(resumed) == numbers(run4[0])[2:]
    # step-4 was there, of the run resumed over: set aside (kept), and this run's own saved
    folder = dump / "checkpoint"
    captured = capsys.readouterr()
    assert f"checkpoint: saved {folder / 'step-4'} in " in captured.out
    assert steps_in(folder) == ["step-2", "step-4", "step-4.superseded"]
    assert_same(read_dcp(folder / "step-4.superseded"), read_dcp(run4[1] / "checkpoint" / "step-4"))


def test_a_damaged_checkpoint_is_set_aside_and_its_export_kept_on_resume(run4, tmp_path, capsys):
    """step-4 lost its .metadata after it was written: the run resumes from step-2 and says why,
    saves step-4 anew beside the damaged folder, and keeps the step-4 export it finds."""
    dump = copy_steps(run4, tmp_path, 2, 4)
    folder = dump / "checkpoint"
    (folder / "step-4" / ".metadata").unlink()
    export = folder / "step-4-hf"
    (export / "model.safetensors").parent.mkdir()
    (export / "model.safetensors").write_bytes(b"the earlier export")
    resumed = run(dump, "--training.steps", "4", *CKPT, "--checkpoint.last_save_in_hf", "true")
    assert numbers(resumed) == numbers(run4[0])[2:]
    out = capsys.readouterr().out
    assert (f"loaded {folder / 'step-2'} (passing over step-4: no .metadata, damaged after it was written; set aside as "
            "step-N.incomplete when that step is saved again); training continues after step 2") in out
    assert f"{export} already exists, kept as it is (exports are never overwritten)" in out
    assert steps_in(folder) == ["step-2", "step-4", "step-4-hf", "step-4.incomplete"]
    assert (export / "model.safetensors").read_bytes() == b"the earlier export"


def test_a_rerun_at_training_steps_writes_only_the_missing_final_export(run4, tmp_path, capsys):
    """A crash right after the last checkpoint left its export out: the same command again trains
    nothing and writes it. The run's own checkpoint wins over initial_load_path, which it names."""
    dump = copy_steps(run4, tmp_path, 4)
    folder, initial = dump / "checkpoint", run4[1] / "checkpoint" / "step-2"
    assert run(dump, "--training.steps", "4", *CKPT, "--checkpoint.last_save_model_only", "true",
               "--checkpoint.initial_load_path", str(initial)) == []
    out = capsys.readouterr().out
    assert f"checkpoint.initial_load_path {initial} is not loaded: the run resumes its own checkpoints" in out
    assert steps_in(folder) == ["step-4", "step-4-model"]
    assert_same(read_dcp(folder / "step-4-model")["model"], read_dcp(folder / "step-4", only="model"))


def test_load_only_reads_from_a_folder_it_cannot_write(run4, tmp_path, monkeypatch):
    """load_only never saves: a read-only checkpoint folder (shared storage) must not stop it."""
    def unwritable(folder, size):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(manager_module, "check_writable", unwritable)
    dump = copy_steps(run4, tmp_path, 2)
    resumed = run(dump, "--training.steps", "4", *CKPT, "--checkpoint.load_only", "true")
    assert numbers(resumed) == numbers(run4[0])[2:]
    assert steps_in(dump / "checkpoint") == ["step-2"]


def decoded(step_dir, state, key):
    """A per-rank state as saved (RankLocalState stores torch.save bytes)."""
    return torch.load(io.BytesIO(read_dcp(step_dir, only=state)[key]), weights_only=True)


def test_rng_is_restored(run4, tmp_path):
    # Another seed: only restoring the rng state makes the generators equal the first run's.
    dump = copy_steps(run4, tmp_path, 2)
    resumed = run(dump, "--training.steps", "4", *CKPT, "--debug.seed", "5")
    assert numbers(resumed) == numbers(run4[0])[2:]
    rng = decoded(dump / "checkpoint" / "step-4", "rng", "rank_0")
    assert torch.equal(rng["torch"], decoded(run4[1] / "checkpoint" / "step-4", "rng", "rank_0")["torch"])
    torch.manual_seed(5)
    assert not torch.equal(rng["torch"], torch.get_rng_state())


def test_exclude_dataloader_restarts_the_data(run4, tmp_path):
    dump = copy_steps(run4, tmp_path, 2)
    resumed = run(dump, "--training.steps", "4", *CKPT, "--checkpoint.exclude_from_loading", "dataloader")
    assert [h["step"] for h in resumed] == [3, 4]  # the step counter was restored
    assert resumed[0]["loss"] != run4[0][2]["loss"]  # other data than the uninterrupted step 3
    # Two batches after the restart the loader stands where the first run stood after step 2.
    after_restart = decoded(dump / "checkpoint" / "step-4", "dataloader", "dp_rank_0")
    assert after_restart == decoded(run4[1] / "checkpoint" / "step-2", "dataloader", "dp_rank_0")
    assert after_restart != decoded(run4[1] / "checkpoint" / "step-4", "dataloader", "dp_rank_0")


def test_keep_latest_k(tmp_path):
    run(tmp_path, "--training.steps", "5", *CKPT, "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2")
    assert steps_in(tmp_path / "checkpoint") == ["step-4", "step-5"]


def test_last_save_model_only_in_bfloat16(run4, tmp_path):
    run(tmp_path, "--training.steps", "2", "--checkpoint.enable", "true", "--checkpoint.interval", "1",
        "--checkpoint.export_dtype", "bfloat16")
    folder = tmp_path / "checkpoint"
    assert set(read_dcp(folder / "step-1")) == {"train_state", "model", "optimizer", "lr_scheduler", "dataloader", "rng"}
    assert set(read_dcp(folder / "step-2")) == set(read_dcp(folder / "step-1"))  # the export goes beside it
    final = read_dcp(folder / "step-2-model")
    assert set(final) == {"model"}
    # Warmup (2 steps) does not depend on the horizon, so step 2 equals the 4-step run's step 2.
    full = read_dcp(run4[1] / "checkpoint" / "step-2", only="model")
    assert_same(final["model"], {key: value.to(torch.bfloat16) for key, value in full.items()})


def test_async_and_sync_saves_hold_the_same_tensors(run4, tmp_path):
    run(tmp_path, "--training.steps", "4", *CKPT, "--checkpoint.async_mode", "async")
    for step in (2, 4):
        async_saved = read_dcp(tmp_path / "checkpoint" / f"step-{step}")
        assert_same(async_saved, read_dcp(run4[1] / "checkpoint" / f"step-{step}"), f"step-{step}")


def test_resume_of_another_model_is_refused(run4, tmp_path, capsys):
    dump = copy_steps(run4, tmp_path, 2)
    assert main([*SMALL, "--job.dump_folder", str(dump), "--training.steps", "4", *CKPT, "--model.name", "llama2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: checkpoint was written by a llama3/debugmodel run, this run trains llama2/debugmodel (model.name/model.flavor)"
    # another family's tensors differ in shape: the record of the model is read first all the same
    assert main([*SMALL, "--job.dump_folder", str(dump), "--training.steps", "4", *CKPT, "--model.name", "deepseek_v3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint was written by a llama3/debugmodel run, this run trains deepseek_v3/"), err


def test_a_torchtitan_checkpoint_gives_its_weights_and_is_not_resumed(run4, tmp_path, capsys):
    """torchtitan's CheckpointManager writes the model's weights at the top level beside its
    other states (_flattened_model_states_sd): they load as initial weights, like the same weights
    in Tessera's layout; its other states are not Tessera's, so the folder is never resumed."""
    saved = read_dcp(run4[1] / "checkpoint" / "step-2")
    torchtitan = tmp_path / "torchtitan" / "checkpoint" / "step-2"
    write_dcp({**saved["model"], "optimizer": saved["optimizer"], "train_state": {"step": torch.tensor(2)},
               "freqs_cis": torch.zeros(32, 16)}, torchtitan)  # extra keys of torchtitan's models stay unread
    ours = run(tmp_path / "a", "--training.steps", "1", "--checkpoint.initial_load_path", str(run4[1] / "checkpoint" / "step-2"))
    theirs = run(tmp_path / "b", "--training.steps", "1", "--checkpoint.initial_load_path", str(torchtitan))
    assert numbers(theirs) == numbers(ours) != numbers(run(tmp_path / "c", "--training.steps", "1"))
    assert f"checkpoint: initial weights from torchtitan checkpoint {torchtitan}" in capsys.readouterr().out

    base = [*SMALL, "--training.steps", "3", "--checkpoint.enable", "true"]
    assert main([*base, "--job.dump_folder", str(tmp_path / "d"), "--checkpoint.initial_load_path", str(torchtitan),
                 "--checkpoint.initial_load_model_only", "false"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: checkpoint.initial_load_path {torchtitan} is a torchtitan checkpoint "
                                               "(the model's weights at its top level): only its weights load here; set "
                                               "checkpoint.initial_load_model_only true")
    assert main([*base, "--job.dump_folder", str(tmp_path / "torchtitan")]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {torchtitan} is a torchtitan checkpoint (the model's weights "
                                                      "at its top level), which this run cannot resume; start from its weights")
    assert steps_in(torchtitan.parent) == ["step-2"]


def test_initial_weights_of_another_model_of_the_same_shapes_are_said(run4, tmp_path, capsys):
    """Llama 2's and 3's debug models have the same tensors: the load succeeds, and says whose they
    are. The record is only for the remark: a damaged one (or an older trainer's) changes nothing."""
    step2 = run4[1] / "checkpoint" / "step-2"
    run(tmp_path / "a", "--training.steps", "1", "--checkpoint.initial_load_path", str(step2), "--model.name", "llama2")
    out = capsys.readouterr().out
    assert f"initial weights from {step2} (weights of a llama3/debugmodel model; this run builds llama2/debugmodel)" in out
    damaged = tmp_path / "step-2"
    shutil.copytree(step2, damaged)
    (damaged / "model_args.json").write_text("{")
    run(tmp_path / "b", "--training.steps", "1", "--checkpoint.initial_load_path", str(damaged), "--model.name", "llama2")
    assert f"initial weights from {damaged}\n" in capsys.readouterr().out


def test_a_resume_with_another_batch_says_so(run4, tmp_path, capsys):
    """Another data-parallel degree changes the batch where global_batch_size is -1: the resume
    is then not the run it continues (losses differ from step 1 on), which it says."""
    dump = copy_steps(run4, tmp_path, 2)
    run(dump, "--training.steps", "3", *CKPT, "--training.local_batch_size", "1")
    assert ("checkpoint: step-2 was trained on 2 sequences x 32 tokens per step, this run takes 1 x 32: to go on as "
            "that run would, set --training.global_batch_size 2") in capsys.readouterr().out
    shutil.rmtree(dump / "checkpoint" / "step-3")
    run(dump, "--training.steps", "3", *CKPT)
    assert "sequences x" not in capsys.readouterr().out


def test_the_keys_said_for_another_batch_give_a_valid_layout():
    """The global batch the checkpoint took, with a local batch this layout can split it into."""
    from tessera.trainer.checkpointing import _batch_keys
    from tessera.trainer.sub_plans import BatchPlan

    two_ranks = BatchPlan(local=2, dp=2, accumulation=1, seq_len=64, devices_per_batch=1)
    assert _batch_keys([2, 64], two_ranks, False) == "--training.global_batch_size 2 --training.local_batch_size 1"
    assert _batch_keys([8, 64], two_ranks, False) == "--training.global_batch_size 8"  # 2 micro-batches of 2 a rank
    assert _batch_keys([4, 32], two_ranks, False) == "--training.seq_len 32"
    assert _batch_keys([3, 64], two_ranks, False) == "--training.global_batch_size 3 on a data-parallel degree that divides it"
    assert _batch_keys([2, 64], two_ranks, True) == ("--training.global_batch_size 2 with a local_batch_size its "
                                                     "data-parallel ranks and pipeline micro-batches split it into")


def test_a_second_run_on_one_checkpoint_folder_is_refused(tmp_path, capsys):
    """Two runs writing one folder mixed their saves into a step folder marked complete (a double
    submit, a requeue while the old job lives): the later one is refused before it trains."""
    folder = tmp_path / "checkpoint"
    other_run = claim(folder)
    argv = [*SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "2", *CKPT]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (f"error: checkpoint folder {folder} is in use by process {os.getpid()} on "
                                               f"{socket.gethostname()}: two runs writing one folder would mix their "
                                               "checkpoints; wait for it to end or use another folder")
    other_run.close()
    assert main(argv) == 0
    assert steps_in(folder) == ["step-2"]


def llama3_debug():
    """The spec and the args the trainer builds from SMALL (the flavor's, seq_len 32)."""
    spec = get_model_spec("llama3")
    return spec, dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=32)


def test_last_save_in_hf_loads_back_like_the_dcp_checkpoint(tmp_path):
    run(tmp_path / "a", "--training.steps", "2", "--checkpoint.enable", "true", "--checkpoint.last_save_in_hf", "true")
    folder = tmp_path / "a" / "checkpoint"
    spec, args = llama3_debug()
    exported = load_hf(folder / "step-2-hf")
    assert "model.layers.0.self_attn.q_proj.weight" in exported  # Hugging Face names
    assert_same(spec.hf_adapter.from_hf(exported, args), read_dcp(folder / "step-2", only="model"))

    from_hf = run(tmp_path / "b", "--training.steps", "1", "--checkpoint.initial_load_path", str(folder / "step-2-hf"),
                  "--checkpoint.initial_load_in_hf", "true")
    from_dcp = run(tmp_path / "c", "--training.steps", "1", "--checkpoint.initial_load_path", str(folder / "step-2"))
    fresh = run(tmp_path / "d", "--training.steps", "1")
    assert numbers(from_hf) == numbers(from_dcp) != numbers(fresh)


def test_a_full_disk_during_the_hf_export_is_one_line_and_keeps_the_checkpoint(tmp_path, capsys, monkeypatch):
    def no_space(tensors, filename, metadata=None):
        raise OSError(28, "No space left on device", str(filename))

    monkeypatch.setattr("tessera.ckpt.hf.save_file", no_space)
    dump = tmp_path / "dump"
    assert main([*SMALL, "--job.dump_folder", str(dump), "--training.steps", "2", "--checkpoint.enable", "true",
                 "--checkpoint.last_save_in_hf", "true"]) == 2
    folder = dump / "checkpoint"
    assert capsys.readouterr().err.strip() == \
        f"error: [Errno 28] cannot write Hugging Face export {folder}/step-2-hf: No space left on device"
    assert steps_in(folder) == ["step-2", "step-2-model"]  # the DCP saves, whole; no export and no .tmp
    assert set(read_dcp(folder / "step-2")) >= {"model", "optimizer"}


def test_hugging_face_llama_file_gives_the_original_logits(tmp_path):
    spec, args = llama3_debug()
    torch.manual_seed(3)  # not the trainer's seed: its own initial weights would not match
    original = spec.build(args)
    save_hf(spec.hf_adapter.to_hf(original.state_dict(), args), tmp_path / "hf")
    inputs, labels = next(build_dataloader(load_dataset(None), load_tokenizer(), 32, 2))
    with torch.no_grad():
        logits = original(inputs)
        reloaded = spec.build(args)
        reloaded.load_state_dict(spec.hf_adapter.from_hf(load_hf(tmp_path / "hf"), args))
        assert torch.equal(reloaded(inputs), logits)
    history = run(tmp_path / "run", "--training.steps", "1", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
                  "--checkpoint.initial_load_in_hf", "true", "--training.shuffle", "false")  # the batch above: file order
    assert history[0]["loss"] == cross_entropy(logits, labels).item()


def _wrong_shape_hf(dump):
    spec, args = llama3_debug()
    state_dict = spec.hf_adapter.to_hf(spec.build(args).state_dict(), args)
    state_dict["model.norm.weight"] = state_dict["model.norm.weight"][:-1]
    save_hf(state_dict, dump / "hf")


def _truncate_data(step_dir):
    data = sorted(step_dir.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:1000])


def _garble_metadata(step_dir):
    (step_dir / ".metadata").write_bytes(b"not a pickle")


@pytest.mark.parametrize(
    "extra, damage, message",
    [
        (["--checkpoint.load_step", "3"], None, "no checkpoint for step 3 in {folder}; available steps: [2, 4]"),
        ([], _truncate_data, "checkpoint {folder}/step-4 is corrupt: data file"),
        ([], _garble_metadata, "checkpoint metadata {folder}/step-4/.metadata is unreadable"),
        (["--checkpoint.initial_load_path", "/no/such/ckpt", "--checkpoint.folder", "other"], None,
         "checkpoint.initial_load_path /no/such/ckpt does not exist"),
        (["--checkpoint.create_seed_checkpoint", "true", "--checkpoint.folder", "seed"], "seed",
         "seed checkpoint {dump}/seed/step-0 already exists"),
        (["--checkpoint.enable", "false", "--checkpoint.load_step", "2"], None,
         "checkpoint.load_step needs checkpoint.enable = true"),
        (["--training.steps", "3"], None,
         "{folder}/step-4 is at step 4, past training.steps 3: this run would train nothing"),
        (["--training.steps", "3", "--checkpoint.folder", "other", "--checkpoint.initial_load_path", "{dump}/checkpoint/step-4",
          "--checkpoint.initial_load_model_only", "false"], None,
         "{folder}/step-4 is at step 4, past training.steps 3: this run would train nothing"),
        (["--training.steps", "4", "--checkpoint.folder", "other", "--checkpoint.initial_load_path", "{dump}/checkpoint/step-4",
          "--checkpoint.initial_load_model_only", "false"], None,
         "{folder}/step-4 is at step 4, at training.steps 4: this run would train nothing"),
        (["--checkpoint.folder", "other", "--checkpoint.initial_load_path", "{dump}/hf", "--checkpoint.initial_load_in_hf",
          "true"], "hf", "Hugging Face checkpoint {dump}/hf: 'norm.weight' has shape (255,) but the model needs (256,)"),
        (["--checkpoint.exclude_from_loading", "train_state"], None,
         "checkpoint.exclude_from_loading 'train_state' would restart this run at step 0 over its own checkpoints in "
         "{folder}, which are never overwritten"),
    ],
)
def test_bad_checkpoints_fail_in_one_line_and_change_nothing(run4, tmp_path, capsys, extra, damage, message):
    dump = copy_steps(run4, tmp_path, 2, 4)
    folder = dump / "checkpoint"
    if damage == "seed":
        (dump / "seed" / "step-0").mkdir(parents=True)
    elif damage == "hf":
        _wrong_shape_hf(dump)
    elif damage is not None:
        damage(folder / "step-4")
    # the files: a refused run may leave the folder it claimed (empty but for the claim's lock file)
    files = lambda: {p: p.stat().st_size for p in sorted(dump.rglob("*")) if p.is_file() and p.name != LOCK_FILE}  # noqa: E731
    before = files()
    extra = [arg.format(dump=dump) for arg in extra]
    assert main([*SMALL, "--job.dump_folder", str(dump), "--training.steps", "6", *CKPT, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert message.format(folder=folder, dump=dump) in err, err
    assert files() == before  # nothing written or deleted
