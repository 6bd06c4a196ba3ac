"""Malformed input across config, command line, layout, data, tokenizer, checkpoints, Hugging Face
files and tools/convert: each case exits non-zero with one line on stderr naming the culprit, no
traceback, and every file that existed before is byte-identical afterwards."""

import json
from pathlib import Path

import pytest
import torch

import convert
from tessera.ckpt import CheckpointManager, ModelState, save_hf
from tessera.models import get_model_spec
from tessera.trainer.main import main as trainer

torch.set_num_threads(1)

SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "1"]
CONTEXT = get_model_spec("llama3").flavors["debugmodel"].max_seq_len


def _write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _dcp(folder: Path) -> Path:
    """A small, valid DCP checkpoint (a 2-layer Linear 'model')."""
    CheckpointManager(folder, {"model": ModelState([torch.nn.Linear(2, 2)])}, interval=1).save(1)
    return folder / "step-1"


# Each case: (id, make(tmp) -> argv, program, expected words on stderr). `{tmp}` in the expected
# words is the case's folder.
def config_file(content):
    return lambda tmp: ["--job.config_file", str(_write(tmp / "job.toml", content))]


def cli(*argv):
    return lambda tmp: [*argv]


def run_with(*argv, setup=None):
    """A training run that must fail before its first step."""
    def make(tmp):
        extra = setup(tmp) if setup else []
        return [*SMALL, "--job.dump_folder", str(tmp / "dump"), *argv, *extra]
    return make


def _checkpoint_run(damage):
    def setup(tmp):
        step = _dcp(tmp / "dump" / "checkpoint").parent / "step-1"
        damage(step)
        return ["--checkpoint.enable", "true"]
    return setup


def _run_checkpoint(tmp):
    _dcp(tmp / "dump" / "checkpoint")
    return []


def _blocked_checkpoint_folder(tmp):
    _write(tmp / "dump" / "blocker", "a file where the checkpoint folder should be")
    return []


def _hf_folder(content):
    def setup(tmp):
        folder = tmp / "hf"
        if content is not None:
            _write(folder / "model.safetensors", content)
        else:
            folder.mkdir()
        return ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf", "true"]
    return setup


def _hf_wrong_names(tmp):
    save_hf({"not.a.llama.weight": torch.zeros(2)}, tmp / "hf")
    return ["--checkpoint.initial_load_path", str(tmp / "hf"), "--checkpoint.initial_load_in_hf", "true"]


def _convert(command, *argv, setup=None):
    def make(tmp):
        extra = setup(tmp) if setup else []
        return [command, *[a.format(tmp=tmp) for a in argv], *extra]
    return make


CASES = [
    # config files
    ("config-missing", cli("--job.config_file", "/no/such.toml"), "trainer", "config file not found: /no/such.toml"),
    ("config-directory", lambda tmp: ["--job.config_file", str(tmp)], "trainer", "config file is a directory: {tmp}"),
    ("config-empty", config_file(""), "trainer", "config file {tmp}/job.toml holds no settings"),
    ("config-comment-only", config_file("# nothing\n"), "trainer", "holds no settings"),
    ("config-binary", config_file(b"\x89PNG\r\n\x1a\n\x00\xff\xfe"), "trainer", "config file {tmp}/job.toml is not UTF-8"),
    ("config-bad-toml", config_file("[training\nsteps = 3\n"), "trainer", "config file {tmp}/job.toml is not valid TOML"),
    ("config-top-level-key", config_file("steps = 3\n"), "trainer", "'steps' must be a [section] table"),
    ("config-unknown-section", config_file("[trainig]\nsteps = 3\n"), "trainer", "did you mean 'training'"),
    ("config-unknown-key", config_file("[training]\nstepz = 3\n"), "trainer", "unknown config key training.stepz"),
    ("config-wrong-type", config_file('[training]\nsteps = "ten"\n'), "trainer", "training.steps: value 'ten' is not an int"),
    ("config-nan", config_file("[optimizer]\nlr = nan\n"), "trainer", "optimizer.lr: nan is not a finite number"),
    ("config-list-type", config_file('[model]\nconverters = "float8"\n'), "trainer", "model.converters"),
    ("config-bool-type", config_file("[checkpoint]\nenable = 1\n"), "trainer", "checkpoint.enable: value 1 is not a bool"),
    # command line
    ("cli-not-int", cli("--training.steps", "abc"), "trainer", "training.steps: value 'abc' is not an int"),
    ("cli-not-float", cli("--optimizer.lr", "fast"), "trainer", "optimizer.lr: value 'fast' is not a float"),
    ("cli-nan", cli("--optimizer.lr", "nan"), "trainer", "optimizer.lr: nan is not a finite number"),
    ("cli-inf", cli("--training.max_norm", "inf"), "trainer", "training.max_norm: inf is not a finite number"),
    ("cli-no-value", cli("--training.steps"), "trainer", "option --training.steps needs a value"),
    ("cli-flag-as-value", cli("--training.steps", "--metrics.log_freq", "1"), "trainer",
     "option --training.steps needs a value, got the option --metrics.log_freq"),
    ("cli-positional", cli("oops"), "trainer", "unexpected argument 'oops'"),
    ("cli-no-key", cli("--training", "3"), "trainer", "must look like --section.key"),
    ("cli-unknown-section", cli("--trainig.steps", "3"), "trainer", "unknown config section [trainig]"),
    ("cli-unknown-key", cli("--training.stepz", "3"), "trainer", "unknown config key training.stepz"),
    ("cli-bad-bool", cli("--metrics.enable_tensorboard", "maybe"), "trainer", "is not a bool"),
    ("cli-table", cli("--training.dataloader", "3"), "trainer", "training.dataloader is a table"),
    ("cli-nproc-zero", cli("--nproc", "0"), "trainer", "--nproc '0' must be a positive integer"),
    ("cli-check-world-size-alone", cli("--check_world_size", "2"), "trainer", "--check_world_size needs --check"),
    # values
    ("steps-zero", cli("--training.steps", "0"), "trainer", "training.steps: 0 must be >= 1"),
    ("batch-negative", cli("--training.local_batch_size", "-1"), "trainer", "training.local_batch_size: -1 must be >= 1"),
    ("lr-negative", cli("--optimizer.lr", "-1"), "trainer", "optimizer.lr: must be >= 0"),
    ("decay-ratio", cli("--lr_scheduler.decay_ratio", "2"), "trainer", "lr_scheduler.decay_ratio: 2.0 must be within [0, 1]"),
    ("min-lr-factor", cli("--lr_scheduler.min_lr_factor", "2"), "trainer", "lr_scheduler.min_lr_factor"),
    ("max-norm-zero", cli("--training.max_norm", "0"), "trainer", "training.max_norm: 0.0 must be > 0"),
    ("optimizer-name", cli("--optimizer.name", "SGD"), "trainer", "optimizer.name: 'SGD' is not one of"),
    ("async-mode", cli("--checkpoint.async_mode", "sometimes"), "trainer", "checkpoint.async_mode: 'sometimes'"),
    ("ac-mode", cli("--activation_checkpoint.mode", "partial"), "trainer", "activation_checkpoint.mode: 'partial'"),
    ("skipped-steps", cli("--training.max_skipped_steps", "-1"), "trainer", "training.max_skipped_steps: must be >= 0"),
    ("stop-grace", cli("--job.stop_grace_seconds", "0"), "trainer", "job.stop_grace_seconds: 0 must be >= 1"),
    ("train-timeout", cli("--comm.train_timeout_seconds", "0"), "trainer", "comm.train_timeout_seconds: 0 must be >= 1"),
    ("validation-steps", cli("--validation.steps", "0"), "trainer", "validation.steps: 0 must be >= 1 or -1"),
    ("compile-components", cli("--compile.components", "model,optimizer"), "trainer", "compile.components: ['optimizer']"),
    ("converter", cli("--model.converters", "bogus"), "trainer", "model.converters: ['bogus'] not registered"),
    ("mixture-weight", cli("--training.dataset_mixture", "a.txt=x"), "trainer", "training.dataset_mixture"),
    # model and layout (checked by the job plan, before anything runs)
    ("flavor", cli("--check", "--model.flavor", "huge"), "trainer", "model.flavor 'huge' is not a flavor of llama3"),
    ("seq-len-above-context", cli("--check", "--training.seq_len", str(CONTEXT + 1)), "trainer",
     f"training.seq_len {CONTEXT + 1} exceeds the context length of llama3/debugmodel ({CONTEXT})"),
    ("tp-not-dividing", cli("--check", "--check_world_size", "3", "--parallelism.tensor_parallel_degree", "2"), "trainer",
     "world size 3 is not divisible by dp_replicate*cp*tp*pp"),
    ("dp-shard-too-big", cli("--check", "--check_world_size", "2", "--parallelism.data_parallel_shard_degree", "3"),
     "trainer", "does not equal the world size 2"),
    ("global-batch", cli("--check", "--training.global_batch_size", "3", "--training.local_batch_size", "2"), "trainer",
     "global_batch_size 3 is not a multiple"),
    ("pp-schedule", cli("--check", "--check_world_size", "2", "--parallelism.pipeline_parallel_degree", "2",
                        "--parallelism.pipeline_parallel_schedule", "Nope"), "trainer", "pipeline schedule 'Nope' is not one of"),
    ("tp-heads", cli("--check", "--check_world_size", "3", "--parallelism.tensor_parallel_degree", "3"), "trainer",
     "tensor_parallel_degree"),
    # data
    ("dataset-missing", run_with("--training.dataset_path", "/no/such/data.txt"), "trainer", "/no/such/data.txt"),
    ("dataset-suffix", run_with(setup=lambda tmp: ["--training.dataset_path", str(_write(tmp / "d.csv", "a,b\n"))]),
     "trainer", "d.csv"),
    ("dataset-empty", run_with(setup=lambda tmp: ["--training.dataset_path", str(_write(tmp / "d.txt", ""))]), "trainer",
     "d.txt"),
    ("dataset-bad-json", run_with(setup=lambda tmp: ["--training.dataset_path", str(_write(tmp / "d.jsonl", "{not json\n"))]),
     "trainer", "d.jsonl"),
    ("dataset-no-text-field", run_with(setup=lambda tmp: ["--training.dataset_path",
                                                            str(_write(tmp / "d.jsonl", json.dumps({"body": "x"}) + "\n"))]),
     "trainer", "d.jsonl"),
    ("dataset-shorter-than-a-sequence", run_with(setup=lambda tmp: ["--training.dataset_path", str(_write(tmp / "d.txt", "hi"))]),
     "trainer", "d.txt holds fewer tokens than one sequence"),
    ("validation-missing", run_with("--validation.enable", "true", "--validation.dataset_path", "/no/such/val.txt"),
     "trainer", "/no/such/val.txt"),
    ("dump-folder-is-file", run_with(setup=lambda tmp: ["--job.dump_folder", str(_write(tmp / "f", "x"))]), "trainer",
     "is not a folder"),
    # tokenizer
    ("tokenizer-missing", run_with("--model.tokenizer_path", "/no/such/tokenizer.model"), "trainer",
     "/no/such/tokenizer.model"),
    ("tokenizer-garbage", run_with(setup=lambda tmp: ["--model.tokenizer_path", str(_write(tmp / "t.model", "hello world\n"))]),
     "trainer", "t.model"),
    ("tokenizer-binary", run_with(setup=lambda tmp: ["--model.tokenizer_path", str(_write(tmp / "t.model", b"\xff\xfe\x00"))]),
     "trainer", "t.model"),
    # checkpoints
    ("initial-load-missing", run_with("--checkpoint.initial_load_path", "/no/such/ckpt"), "trainer", "/no/such/ckpt"),
    ("load-step-absent", run_with("--checkpoint.enable", "true", "--checkpoint.load_step", "3", setup=_run_checkpoint),
     "trainer", "no checkpoint for step 3"),
    ("checkpoint-folder-blocked", run_with("--checkpoint.enable", "true", "--checkpoint.folder", "blocker/ckpt",
                                           setup=_blocked_checkpoint_folder),
     "trainer", "blocker/ckpt is not writable: Not a directory"),
    ("checkpoint-garbled-metadata", run_with(setup=_checkpoint_run(lambda s: (s / ".metadata").write_bytes(b"junk"))), "trainer",
     "step-1/.metadata is unreadable"),
    ("checkpoint-other-model", run_with(setup=_checkpoint_run(lambda s: None)), "trainer", "step-1"),
    ("checkpoint-truncated", run_with(setup=_checkpoint_run(
        lambda s: [p.write_bytes(p.read_bytes()[:10]) for p in s.glob("*.distcp")])), "trainer", "step-1"),
    # Hugging Face files
    ("hf-no-files", run_with(setup=_hf_folder(None)), "trainer", "holds neither model.safetensors"),
    ("hf-garbage", run_with(setup=_hf_folder(b"\x00" * 16)), "trainer", "model.safetensors"),
    ("hf-header-too-long", run_with(setup=_hf_folder((10**12).to_bytes(8, "little") + b"{}")), "trainer", "model.safetensors"),
    ("hf-wrong-names", run_with(setup=_hf_wrong_names), "trainer", "hf"),
    # tools/convert
    ("convert-missing-src", _convert("dcp-to-torch", "/no/such/step", "{tmp}/o.pt"), "convert", "/no/such/step"),
    ("convert-output-exists", _convert("dcp-to-torch", setup=lambda tmp: [str(_dcp(tmp / "c")), str(_write(tmp / "o.pt", "x"))]),
     "convert", "already exists; pass --force"),
    ("convert-output-folder", _convert("dcp-to-torch", setup=lambda tmp: [str(_dcp(tmp / "c")), str(tmp)]), "convert",
     "is a folder"),
    ("convert-output-parent", _convert("dcp-to-torch", setup=lambda tmp: [str(_dcp(tmp / "c")), str(tmp / "no" / "o.pt")]),
     "convert", "does not exist"),
    ("convert-flavor", _convert("dcp-to-hf", "--model", "llama3", "--flavor", "huge", "{tmp}", "{tmp}/o"), "convert",
     "unknown flavor 'huge'"),
    ("convert-hf-empty", _convert("hf-to-dcp", "--model", "llama3", "--flavor", "debugmodel", "{tmp}", "{tmp}/o"), "convert",
     "holds neither model.safetensors"),
    ("convert-wrong-model", _convert("dcp-to-hf", "--model", "llama3", "--flavor", "debugmodel",
                                     setup=lambda tmp: [str(_dcp(tmp / "c")), str(tmp / "o")]), "convert", "lacks"),
]


def _snapshot(folder: Path) -> dict:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_corpus_is_large_enough():
    assert len(CASES) >= 60


@pytest.mark.parametrize("make, program, words", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_malformed_input_is_one_line_and_changes_nothing(tmp_path, capsys, make, program, words):
    argv = make(tmp_path)
    before = _snapshot(tmp_path)
    code = (trainer if program == "trainer" else convert.main)(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert "\n" not in err and "Traceback" not in err, err
    assert words.format(tmp=tmp_path) in err, err
    assert _snapshot(tmp_path) == before  # no file written, changed or deleted
