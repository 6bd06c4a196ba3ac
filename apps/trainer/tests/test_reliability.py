"""The trainer under faults (issue 13): extending a finished run, non-finite steps, unwritable
and full checkpoint folders, stop signals, orphaned ranks, and bad input that used to pass."""

import errno
import functools
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from tessera.ckpt import read_dcp
from tessera.data import load_dataset
from tessera.models import get_model_spec
from tessera.trainer import data_wiring
from tessera.trainer import validation as validation_module
from tessera.trainer import train as train_module
from tessera.trainer.checkpointing import Checkpointer
from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.faults import ERRORS_ENV
from tessera.trainer.main import main
from tessera.trainer.plan import make_plan
from tessera.trainer.train import train

torch.set_num_threads(1)

SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
         "--metrics.disable_color_printing", "true", "--lr_scheduler.warmup_steps", "2"]
CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
FULL = {"train_state", "model", "optimizer", "lr_scheduler", "dataloader", "rng"}
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")


def run(dump, *extra):
    return train(load_config([*SMALL, "--job.dump_folder", str(dump), *extra]))


def trainer(dump, *extra, **popen):
    """The trainer as a separate process (signals, resource limits); stdout and stderr go to
    <dump>.out and <dump>.err beside the dump folder."""
    with open(f"{dump}.out", "wb") as out, open(f"{dump}.err", "wb") as err:
        return subprocess.Popen([sys.executable, "-m", "tessera.trainer.main", *SMALL, "--job.dump_folder", str(dump),
                                 *extra], env=ENV, stdout=out, stderr=err, **popen)


def output(dump, stream="out"):
    return Path(f"{dump}.{stream}").read_text()


def wait_for(condition, proc, what, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"trainer exited before {what}: {output(proc.args[proc.args.index('--job.dump_folder') + 1], 'err')[-2000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


# ---- 1. extending a finished run ---------------------------------------------------------

def test_extending_a_finished_run_continues_it(tmp_path, capsys):
    run(tmp_path, "--training.steps", "4", *CKPT)  # checkpoint.last_save_model_only is on by default
    folder = tmp_path / "checkpoint"
    assert set(read_dcp(folder / "step-4")) == FULL
    assert set(read_dcp(folder / "step-4-model")) == {"model"}
    history = run(tmp_path, "--training.steps", "6", *CKPT)
    assert [h["step"] for h in history] == [5, 6]
    assert "training continues after step 4" in capsys.readouterr().out


def test_model_only_newest_checkpoint_resumes_from_the_newest_full_one(tmp_path, capsys):
    run(tmp_path, "--training.steps", "4", *CKPT)
    folder = tmp_path / "checkpoint"
    shutil.rmtree(folder / "step-4")
    (folder / "step-4-model").rename(folder / "step-4")  # the layout older versions wrote
    history = run(tmp_path, "--training.steps", "6", *CKPT)
    assert [h["step"] for h in history] == [3, 4, 5, 6]
    assert f"{folder / 'step-4'} holds only the model; resuming from the newest full checkpoint, step-2" in capsys.readouterr().out


# ---- 2. non-finite steps -----------------------------------------------------------------

def test_diverging_run_stops_after_max_skipped_steps(tmp_path, capsys):
    code = main([*SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "30", *CKPT, "--checkpoint.interval", "1",
                 "--optimizer.lr", "1e6", "--lr_scheduler.warmup_steps", "0", "--training.max_skipped_steps", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert "\n" not in err and err.startswith("error: step ") and "3 optimizer steps skipped" in err, err
    assert "training.max_skipped_steps = 2" in err
    for step in (tmp_path / "checkpoint").glob("step-*"):
        assert all(torch.isfinite(v).all() for v in read_dcp(step, only="model").values()), step


def test_non_finite_weights_are_never_checkpointed(tmp_path, capsys, monkeypatch):
    make_train_step = train_module.make_train_step

    def poisoned(parts, *args, **kwargs):
        step, calls = make_train_step(parts, *args, **kwargs), []

        def poisoning_step(batches):
            result = step(batches)
            calls.append(1)
            if len(calls) == 3:  # weights go bad while the gradient norm stayed finite
                with torch.no_grad():
                    next(parts[0].parameters()).fill_(float("nan"))
            return result

        return poisoning_step

    monkeypatch.setattr(train_module, "make_train_step", poisoned)
    code = main([*SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "6", *CKPT])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err == (f"error: step 4: model weights are not finite; not writing a checkpoint "
                   f"(the newest one in {tmp_path / 'checkpoint'} stays)")
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir() if p.name != ".lock") == ["step-2"]  # the run's claim


# ---- 3. unwritable and full checkpoint folders -------------------------------------------

def test_unwritable_checkpoint_folder_fails_before_the_first_step(tmp_path, capsys):
    (tmp_path / "blocker").write_text("a file where the checkpoint folder should be")
    code = main([*SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "4", *CKPT,
                 "--checkpoint.folder", "blocker/ckpt"])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.strip() == (f"error: checkpoint.folder {tmp_path / 'blocker' / 'ckpt'}: {tmp_path / 'blocker'} is a file, "
                           "not a folder")  # said by the plan, before any worker starts
    assert "step 1" not in out


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_dump_folder_fails_before_the_first_step(tmp_path, capsys):
    dump = tmp_path / "dump"
    dump.mkdir()
    dump.chmod(0o555)
    try:
        assert main([*SMALL, "--job.dump_folder", str(dump), "--training.steps", "4", *CKPT]) == 2
    finally:
        dump.chmod(0o755)
    err = capsys.readouterr().err.strip()
    assert err == f"error: checkpoint folder {dump / 'checkpoint'} is not writable: Permission denied"


def _limit_file_size():
    """A full disk, as far as the writer can tell: writes past 256 KiB fail (EFBIG)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_failed_save_names_the_folder_and_keeps_the_previous_checkpoint(tmp_path):
    dump = tmp_path / "run"
    run(dump, "--training.steps", "2", *CKPT)
    step2 = dump / "checkpoint" / "step-2"
    before = {p.name: p.read_bytes() for p in step2.iterdir()}
    proc = trainer(dump, "--training.steps", "4", *CKPT, preexec_fn=_limit_file_size)
    assert proc.wait(timeout=300) == 2
    assert output(dump, "err").strip() == f"error: cannot write checkpoint to {dump / 'checkpoint'}: File too large"
    assert {p.name: p.read_bytes() for p in step2.iterdir()} == before
    assert not (dump / "checkpoint" / "step-4").exists()


def test_a_background_save_failing_after_the_run_failed_leaves_the_run_s_error_alone(capsys):
    """A lost rank fails the run and then the background save's gather: raised at the final close,
    that second failure's traceback (80 lines under --nproc) buried the run's one-line error."""
    class FailingSave:
        def close(self):
            raise RuntimeError("gather_object: a peer rank is gone\n(torch's details)")
    checkpointer = types.SimpleNamespace(manager=FailingSave(), rank=0)
    checkpointer._say = functools.partial(Checkpointer._say, checkpointer)
    Checkpointer.close(checkpointer, after_failure=True)
    assert capsys.readouterr().out == "checkpoint: the background save failed too: gather_object: a peer rank is gone\n"
    with pytest.raises(RuntimeError, match="a peer rank is gone"):  # after a run that ended well it is the error
        Checkpointer.close(checkpointer)


def test_failed_async_save_stops_the_run_at_once_in_one_line(tmp_path, capsys, monkeypatch):
    """The background write of step 6 meets a full disk: the run stops within a step or two
    (not at the next save, after step 9) with one line, and step-3 stays intact."""
    from torch.distributed.checkpoint import filesystem

    write_item = filesystem._write_item

    def full_disk_at_step_6(transforms, stream, *args, **kwargs):
        if ".step-6.tmp" in str(getattr(stream, "name", "")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_item(transforms, stream, *args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", full_disk_at_step_6)
    code = main([*SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "9", *CKPT, "--checkpoint.interval", "3",
                 "--checkpoint.async_mode", "async"])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.strip() == f"error: cannot write checkpoint to {tmp_path / 'checkpoint'}: No space left on device"
    trained = [int(step) for step in re.findall(r"^step +(\d+)/9", out, re.M)]
    assert trained[:6] == [1, 2, 3, 4, 5, 6] and max(trained) < 9, trained
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir() if not p.name.startswith(".")) == ["step-3"]
    assert read_dcp(tmp_path / "checkpoint" / "step-3", only="train_state")["step"] == 3


# ---- 5. stop signals, orphaned ranks -----------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_stop_signal_saves_a_checkpoint_and_exits_0(tmp_path, sig):
    dump = tmp_path / "run"
    proc = trainer(dump, "--training.steps", "1000", *CKPT, "--checkpoint.interval", "500")
    try:
        wait_for(lambda: "step    2/1000" in output(dump), proc, "step 2")
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == 0, output(dump, "err")[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = [line for line in output(dump).splitlines() if line.startswith("stopped by")]
    assert len(stopped) == 1 and stopped[0].startswith(f"stopped by {sig.name} after step "), output(dump)[-2000:]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert stopped[0].endswith(": checkpoint saved")
    assert set(read_dcp(dump / "checkpoint" / f"step-{step}")) == FULL
    assert read_dcp(dump / "checkpoint" / f"step-{step}", only="train_state")["step"] == step


def test_stop_signal_to_the_nproc_launcher_reaches_every_rank(tmp_path):
    dump = tmp_path / "run"
    proc = trainer(dump, "--nproc", "2", "--parallelism.data_parallel_shard_degree", "2", "--training.steps", "1000",
                   *CKPT, "--checkpoint.interval", "500")
    try:
        wait_for(lambda: "step    2/1000" in output(dump), proc, "step 2")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, output(dump, "err")[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = [line for line in output(dump).splitlines() if line.startswith("stopped by SIGTERM after step ")]
    assert len(stopped) == 1 and stopped[0].endswith(": checkpoint saved"), output(dump)[-2000:]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert read_dcp(dump / "checkpoint" / f"step-{step}", only="train_state")["step"] == step
    assert output(dump, "err").strip().splitlines()[-1] == "2-process run stopped by SIGTERM"


def _processes_naming(text):
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_ranks_die_with_their_launcher(tmp_path):
    dump = tmp_path / "orphans"
    proc = trainer(dump, "--nproc", "2", "--training.steps", "100000", "--parallelism.data_parallel_shard_degree", "2")
    try:
        wait_for(lambda: re.search(r"step +1/100000", output(dump)), proc, "a training step")
        workers = [pid for pid in _processes_naming(str(dump)) if pid != proc.pid]
        assert len(workers) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while [pid for pid in workers if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)]:
            assert time.monotonic() < deadline, "ranks outlived their launcher"
            time.sleep(0.1)
    finally:
        for pid in _processes_naming(str(dump)):
            os.kill(pid, signal.SIGKILL)


def _state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_layout_that_does_not_fit_nproc_is_one_line_before_any_worker(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tessera.trainer.main", "--nproc", "3",
                           "--parallelism.data_parallel_shard_degree", "2", "--job.dump_folder", str(tmp_path)],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""  # no worker started: no banner, no rank's own error
    assert proc.stderr == "error: dp_replicate*dp_shard*cp*tp*pp = 1*2*1*1*1 = 2 does not equal the world size 3\n"


# ---- 4. bad input accepted silently or misreported ---------------------------------------

@pytest.mark.parametrize("content, message", [
    (b"", "holds no settings"),
    (b"# only a comment\n", "holds no settings"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "is not UTF-8 text"),
])
def test_unusable_config_file_is_named(tmp_path, content, message):
    path = tmp_path / "job.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"^config file {path} {message}"):
        load_config(["--job.config_file", str(path)])


@pytest.mark.parametrize("argv, message", [
    (["--training.steps", "--metrics.log_freq", "1"], "option --training.steps needs a value, got the option --metrics.log_freq"),
    (["--training.steps", "--metrics.log_freq=1"], "option --training.steps needs a value, got the option --metrics.log_freq"),
    (["--optimizer.lr", "nan"], "config key optimizer.lr: nan is not a finite number"),
    (["--optimizer.lr", "inf"], "config key optimizer.lr: inf is not a finite number"),
    (["--training.max_norm", "nan"], "config key training.max_norm: nan is not a finite number"),
    (["--training.steps", "x"], "config key training.steps: value 'x' is not an int"),
    (["--training.max_skipped_steps", "-1"], "config key training.max_skipped_steps: must be >= 0"),
    (["--job.stop_grace_seconds", "0"], "config key job.stop_grace_seconds: 0 must be >= 1"),
    (["--parallelism.context_parallel_load_balancer", ""],  # torchtitan: "cannot be an empty string"
     r"config key parallelism.context_parallel_load_balancer: '' is not one of \['headtail', None\]"),
    (["--checkpoint.enable", "--checkpoint.exclude_from_loading", "optimizer,nosuch"],
     r"config key checkpoint.exclude_from_loading: \['nosuch'\] not in .*"),
    (["--compile.enable", "--compile.components", ""], "config key compile.components is empty: compile.enable would compile nothing"),
    (["--job.save_config_file", "../job.toml"], "config key job.save_config_file: '../job.toml' must be a file name inside job.dump_folder"),
    (["--job.save_config_file", "/tmp/job.json"], "config key job.save_config_file: '/tmp/job.json' must be a file name inside job.dump_folder"),
])
def test_bad_command_line_values(argv, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        load_config(argv)


@pytest.mark.parametrize("argv, message", [  # options that would do nothing
    (["--checkpoint.exclude_from_loading", "optimizer"], "checkpoint.exclude_from_loading leaves states out of a resume: "
     "it needs checkpoint.enable = true (or an initial_load_path with initial_load_model_only = false)"),
    (["--checkpoint.enable", "--checkpoint.exclude_from_loading", "replicas"], "checkpoint.exclude_from_loading "
     "'replicas' names semi-sync fault tolerance's state, which this run does not have (fault_tolerance.semi_sync_method)"),
    (["--checkpoint.load_only"], "checkpoint.load_only acts on the run's checkpoints: it needs checkpoint.enable = true"),
    (["--checkpoint.enable_first_step_checkpoint"],
     "checkpoint.enable_first_step_checkpoint acts on the run's checkpoints: it needs checkpoint.enable = true"),
    (["--checkpoint.async_mode", "async"], "checkpoint.async_mode acts on the run's checkpoints: it needs checkpoint.enable = true"),
    (["--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.create_seed_checkpoint"],
     "checkpoint.load_only never saves, and checkpoint.create_seed_checkpoint only saves: set one of them"),
    (["--checkpoint.create_seed_checkpoint", "--checkpoint.initial_load_path", "/"], "checkpoint.create_seed_checkpoint "
     "saves the weights as initialised and never reads checkpoint.initial_load_path /: drop one of them"),
    (["--debug.fault_at_step", "2", "--debug.fault_rank", "1"],
     "debug.fault_rank 1 is not a rank of this 1-rank job: the fault would never fire"),
    (["--debug.fault_at_step", "7", "--training.steps", "6"],
     "debug.fault_at_step 7 is after the last step, training.steps 6: the fault would never fire"),
])
def test_an_option_that_would_do_nothing_is_refused(argv, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        make_plan(load_config(argv), 1, check_only=True)


def test_profiling_that_writes_no_trace_is_a_warning():
    plan = make_plan(load_config(["--profiling.enable_profiling", "--training.steps", "5"]), 1, check_only=True)
    assert "profiling.profile_freq 10 exceeds training.steps 5: no trace will be written" in plan.warnings


def test_nan_in_a_config_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[optimizer]\nlr = nan\n")
    with pytest.raises(ConfigError, match="^config key optimizer.lr: nan is not a finite number$"):
        load_config(["--job.config_file", str(path)])


def test_seq_len_above_the_flavors_context_length():
    context = get_model_spec("llama3").flavors["debugmodel"].max_seq_len
    message = rf"^training.seq_len {context + 1} exceeds the context length of llama3/debugmodel \({context}\)$"
    with pytest.raises(ConfigError, match=message):
        make_plan(load_config(["--training.seq_len", str(context + 1)]), 1, check_only=True)


# ---- 7. hangs ----------------------------------------------------------------------------

def _stall_rank_1_at_step_3(rank, world_size, dump):
    """Rank 1 stops answering before step 3 (the [debug] fault switch); rank 0 must fail within
    comm.train_timeout_seconds, rank 1 once it wakes to a broken group."""
    from tessera.trainer.faults import TrainingError

    try:
        train(load_config([*SMALL, "--job.dump_folder", str(dump), "--training.steps", "5", "--comm.train_timeout_seconds",
                           "2", "--parallelism.data_parallel_shard_degree", "2", "--training.dataloader.num_workers", "0",
                           "--debug.fault_at_step", "3", "--debug.fault_rank", "1", "--debug.fault_kind", "stall"]))
    except TrainingError as e:
        (Path(dump) / f"rank{rank}.err").write_text(str(e))
    else:
        (Path(dump) / f"rank{rank}.err").write_text("finished")


def test_stalled_rank_fails_the_step_within_the_train_timeout(tmp_path):
    from tessera.mesh.testing import run_on_ranks

    with pytest.raises(RuntimeError):  # the harness's own barrier meets the broken group; a hang would time out
        run_on_ranks(_stall_rank_1_at_step_3, 2, str(tmp_path), timeout_s=120)
    stalled = re.fullmatch(r"rank 0, step 3: (\w+) timed out \(comm.train_timeout_seconds = 2\): Timed out waiting .*",
                           (tmp_path / "rank0.err").read_text())
    assert stalled and hasattr(torch.distributed, stalled[1]), (tmp_path / "rank0.err").read_text()  # names the collective
    woke = (tmp_path / "rank1.err").read_text()
    assert re.fullmatch(r"rank 1, step 3: \w+ lost a peer rank \(it failed or timed out\) .*", woke), woke


def test_stop_grace_ends_a_process_that_cannot_stop(tmp_path):
    script = ("import os, signal, time\n"
              "from tessera.trainer.faults import StopSignals\n"
              "stop = StopSignals(1)\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "time.sleep(60)  # a save that hangs\n")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and time.monotonic() - started < 30
    message = "error: not stopped within 1s of SIGTERM (job.stop_grace_seconds); exiting without a checkpoint of this step"
    assert result.stderr.strip() == message
    # a rank of --nproc reports it, so the launcher ends the job with it, not as a stop that saved (exit 0)
    result = subprocess.run([sys.executable, "-c", script], env={**ENV, ERRORS_ENV: str(tmp_path), "RANK": "1"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and (tmp_path / "rank-1").read_text() == f"1\n{message}"


# ---- 8. validation on held-out documents --------------------------------------------------

def _record_datasets(monkeypatch):
    """The datasets the trainer builds loaders from: training first, then validation's."""
    seen, build = [], data_wiring.build_dataloader

    def recording(dataset, *args, **kwargs):
        seen.append(dataset)
        return build(dataset, *args, **kwargs)

    monkeypatch.setattr(data_wiring, "build_dataloader", recording)
    monkeypatch.setattr(validation_module, "build_dataloader", recording)
    return seen


VALIDATE = ["--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "1",
            "--training.dataloader.num_workers", "0"]


@pytest.mark.parametrize("source", ["default", "file"])
def test_validation_on_the_training_data_holds_documents_out_of_training(tmp_path, capsys, monkeypatch, source):
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(f"document {i} " + "word " * 40 for i in range(150)))
    data = [] if source == "default" else ["--training.dataset_path", str(path), "--validation.dataset_path", str(path)]
    seen = _record_datasets(monkeypatch)
    run(tmp_path / "run", "--training.steps", "2", *VALIDATE, *data)
    everything = load_dataset(None if source == "default" else path).documents
    held_out = 4 if source == "default" else 2  # 1% of 318 and of 150 documents, rounded up
    training, validation = seen[0], seen[1]
    assert validation.documents == everything[-held_out:] and training.documents == everything[:-held_out]
    assert not set(validation.documents) & set(training.documents)
    name = "default" if source == "default" else str(path)
    assert f"validation: held-out 1% of {name} ({held_out} documents), excluded from training" in capsys.readouterr().out


def test_a_separate_validation_dataset_is_used_whole(tmp_path, capsys, monkeypatch):
    path = tmp_path / "validation.txt"
    path.write_text("\n\n".join(f"validation {i} " + "text " * 40 for i in range(5)))
    seen = _record_datasets(monkeypatch)
    run(tmp_path / "run", "--training.steps", "2", *VALIDATE, "--validation.dataset_path", str(path))
    assert seen[0].documents == load_dataset().documents and seen[1].documents == load_dataset(path).documents
    assert f"validation: {path} (5 documents), apart from the training data" in capsys.readouterr().out


def test_resume_with_held_out_documents_is_exact(tmp_path):
    args = ["--training.steps", "4", *VALIDATE, *CKPT]
    numbers = lambda history: [{k: v for k, v in h.items() if k in ("step", "loss", "grad_norm", "lr", "validation_loss")}
                               for h in history if h["step"] > 2]
    uninterrupted = run(tmp_path, *args)
    shutil.rmtree(tmp_path / "checkpoint" / "step-4")
    resumed = run(tmp_path, *args)
    assert resumed[0]["step"] == 3 and numbers(resumed) == numbers(uninterrupted)
    assert any("validation_loss" in h for h in numbers(resumed))


def test_training_text_shorter_than_one_sequence_is_refused(tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("a few words only")
    assert main([*SMALL, "--job.dump_folder", str(tmp_path / "dump"), "--training.steps", "2",
                 "--training.dataset_path", str(text)]) == 2
    assert capsys.readouterr().err.strip() == f"error: dataset {text} holds fewer tokens than one sequence (seq_len + 1 = 33)"


def test_a_port_beyond_tcp_is_one_line(capsys):
    assert main(["--nproc", "2", "--port", "99999", "--check"]) == 2
    assert capsys.readouterr().err == "error: --port 99999 is not a TCP port (1 to 65535)\n"
