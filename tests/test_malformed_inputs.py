"""Malformed input across config, command line, layout, data, tokenizer, checkpoints, Hugging Face
files and the tools (convert, plan, estimate, pretokenize): each case exits non-zero with one line on stderr naming the culprit, no
traceback, and every file that existed before is byte-identical afterwards."""

import json
from pathlib import Path

import pytest
import torch

import convert
import estimate
import plan
import pretokenize
from tessera.ckpt import CheckpointManager, ModelState, save_hf
from tessera.ckpt.folders import LOCK_FILE
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
     "trainer", "blocker is a file, not a folder"),
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
    ("convert-output-folder", _convert("dcp-to-torch", setup=lambda tmp: [str(_dcp(tmp / "c")), str(_write(tmp / "out" / "x", "").parent)]), "convert",
     "is a folder"),
    ("convert-output-parent", _convert("dcp-to-torch", setup=lambda tmp: [str(_dcp(tmp / "c")), str(tmp / "no" / "o.pt")]),
     "convert", "does not exist"),
    ("convert-flavor", _convert("dcp-to-hf", "--model", "llama3", "--flavor", "huge",
                                setup=lambda tmp: [str(_dcp(tmp / "src")), str(tmp / "o")]), "convert", "unknown flavor 'huge'"),
    ("convert-hf-empty", _convert("hf-to-dcp", "--model", "llama3", "--flavor", "debugmodel",
                                  setup=lambda tmp: [str(_write(tmp / "hf" / "README", "").parent), str(tmp / "o")]), "convert",
     "holds neither model.safetensors"),
    ("convert-wrong-model", _convert("dcp-to-hf", "--model", "llama3", "--flavor", "debugmodel",
                                     setup=lambda tmp: [str(_dcp(tmp / "c")), str(tmp / "o")]), "convert", "lacks"),
]

# ---- the surfaces that landed since: pipelines, context/expert parallel, float8/MX, token shards,
# mixtures, Hugging Face folders and exports (issue 27)

PP2 = ["--nproc", "2", "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
       "--training.local_batch_size", "4", "--training.seq_len", "32"]
# 1F1B for 2 ranks and 4 micro-batches (F forward, B full backward)
CSV_1F1B = "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"


def schedule_csv(text):
    return lambda tmp: [*PP2, "--parallelism.pipeline_parallel_schedule_csv", str(_write(tmp / "s.csv", text))]


def pp2(*argv):
    return cli(*PP2, *argv)


def layout(world_size, *argv):
    return cli("--nproc", str(world_size), *argv)


def _shards(tmp: Path, damage=None) -> Path:
    """A valid token-shard folder of the default tokenizer (two shards), optionally damaged
    through its index: damage(index dict, folder) edits them."""
    from tessera.data import pretokenize

    docs = _write(tmp / "docs.txt", "\n\n".join(f"document {i} " + "alpha beta gamma " * 20 for i in range(12)))
    folder = tmp / "shards"
    pretokenize([docs], folder, shard_tokens=400)
    if damage is not None:
        index = json.loads((folder / "index.json").read_text())
        damage(index, folder)
        (folder / "index.json").write_text(json.dumps(index))
    return folder


def shards_run(damage, *argv):
    return run_with(*argv, setup=lambda tmp: ["--training.dataset_path", str(_shards(tmp, damage))])


def _set(**fields):
    return lambda index, folder: index.update(fields)


def _shard_name(name):
    def damage(index, folder):
        index["shards"][0]["name"] = name.format(folder=folder) if isinstance(name, str) else name
    return damage


def _escape(index, folder):
    """A complete shard outside the folder, which the index names."""
    elsewhere = folder.parent / "elsewhere"
    elsewhere.mkdir()
    for suffix in (".tokens", ".offsets"):
        (folder / f"shard-00000{suffix}").rename(elsewhere / f"shard-00000{suffix}")
    index["shards"][0]["name"] = "../elsewhere/shard-00000"


def _tokenizer_field(**fields):
    return lambda index, folder: index["tokenizer"].update(fields)


def _damaged_ids(index, folder):
    tokens = folder / "shard-00000.tokens"
    raw = bytearray(tokens.read_bytes())
    raw[2:4] = b"\xff\xff"  # token 1: id 65535, beyond the 2048 of the vocabulary
    tokens.write_bytes(bytes(raw))


def _no_documents(index, folder):
    for shard in index["shards"]:
        (folder / f"{shard['name']}.tokens").write_bytes(b"")
        (folder / f"{shard['name']}.offsets").write_bytes(bytes(8))
        shard.update(documents=0, tokens=0)
    index.update(documents=0, tokens=0)


def _truncated_tokens(index, folder):
    tokens = folder / "shard-00001.tokens"
    tokens.write_bytes(tokens.read_bytes()[:-2])


def _missing_offsets(index, folder):
    (folder / "shard-00001.offsets").unlink()


def mixture(*entries, setup=None):
    def make(tmp):
        extra = setup(tmp) if setup else []
        return [*SMALL, "--job.dump_folder", str(tmp / "dump"),
                "--training.dataset_mixture", ",".join(e.format(tmp=tmp) for e in entries), *extra]
    return make


def _hf_index(weight_map):
    """A Hugging Face folder of one real file and an index mapping names as given."""
    def setup(tmp):
        folder = tmp / "hf"
        save_hf({"model.norm.weight": torch.ones(2)}, folder)
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        content = weight_map if isinstance(weight_map, (str, bytes)) else json.dumps({"weight_map": weight_map})
        _write(folder / "model.safetensors.index.json", content)
        return ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf", "true"]
    return setup


def _dcp_escaping(tmp):
    """A checkpoint whose metadata names its data files outside its folder."""
    import dataclasses
    import pickle

    step = _dcp(tmp / "dump" / "checkpoint")
    metadata = pickle.loads((step / ".metadata").read_bytes())
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=f"../../{info.relative_path}")
                             for index, info in metadata.storage_data.items()}
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    return ["--checkpoint.enable", "true"]


def _export_exists(tmp):
    (tmp / "dump" / "checkpoint" / "step-3-hf").mkdir(parents=True)  # another run's export
    return ["--checkpoint.enable", "true", "--checkpoint.last_save_in_hf", "true", "--training.steps", "3"]


QWEN3_MOE = ["--model.name", "qwen3", "--model.flavor", "tiny_moe"]
DEEPSEEK = ["--model.name", "deepseek_v3"]
MX = ["--model.converters", "quantize.linear.mx", "--quantize.linear.mx.recipe_name", "mxfp8_emulated_rceil"]
GROUPED = ["--model.converters", "quantize.grouped_mm.mx", "--quantize.grouped_mm.mx.recipe_name", "mxfp8_emulated_rceil",
           "--quantize.grouped_mm.mx.fqns", "experts", "--training.dtype", "bfloat16"]

SURFACE_CASES = [
    # pipeline schedules: the whole CSV checked in the job plan, before any worker
    ("pp-csv-missing", pp2("--parallelism.pipeline_parallel_schedule_csv", "/no/such.csv"), "trainer",
     "parallelism.pipeline_parallel_schedule_csv /no/such.csv is not a file"),
    ("pp-csv-empty", schedule_csv(""), "trainer", "{tmp}/s.csv holds no actions"),
    ("pp-csv-blank-rows", schedule_csv("\n\n\n"), "trainer", "{tmp}/s.csv holds no actions"),
    ("pp-csv-one-row", schedule_csv(CSV_1F1B.splitlines()[0]), "trainer",
     "s.csv has 1 row; pipeline_parallel_degree 2 needs one per pp rank"),
    ("pp-csv-three-rows", schedule_csv(CSV_1F1B + "0F0\n"), "trainer", "s.csv has 3 rows"),
    ("pp-csv-bad-action", schedule_csv("0F0,0X0\n1F0\n"), "trainer", "s.csv: Invalid action string: 0X0"),
    ("pp-csv-comm-action", schedule_csv("0F0,0SEND_F0\n1F0\n"), "trainer", "0SEND_F0 is not a compute action"),
    ("pp-csv-stage-range", schedule_csv(CSV_1F1B.replace("1B3", "2B3")), "trainer",
     "2B3 names stage 2; the pipeline has stages 0..1"),
    ("pp-csv-microbatch-range", schedule_csv(CSV_1F1B.replace("0F3", "0F7")), "trainer",
     "0F7 names micro-batch 7; the step has 0..3"),
    ("pp-csv-wrong-rank", schedule_csv("1F0,1B0\n0F0,0B0\n"), "trainer", "1F1B places stage 1 on pp rank 1"),
    ("pp-csv-forward-only", schedule_csv("0F0,0F1,0F2,0F3\n1F0,1F1,1F2,1F3\n"), "trainer",
     "torch cannot run this order: Invalid backward microbatches for stage 0"),
    ("pp-csv-backward-missing", schedule_csv(CSV_1F1B.replace(",0B3", "")), "trainer", "but got B=3"),
    ("pp-csv-backward-first", schedule_csv(CSV_1F1B.replace("0F0,0F1,0B0", "0B0,0F0,0F1")), "trainer",
     "without first running Forward"),
    ("pp-csv-deadlock", schedule_csv("0F0,0B0,0F1,0B1,0F2,0B2,0F3,0B3\n1F1,1B1,1F0,1B0,1F2,1B2,1F3,1B3\n"), "trainer",
     "torch cannot run this order: Malformed compute schedule"),
    ("pp-csv-binary", schedule_csv(b"\xff\xfe\x00\x01"), "trainer", "parallelism.pipeline_parallel_schedule_csv"),
    ("pp-microbatch-size", pp2("--parallelism.pipeline_parallel_microbatch_size", "3"), "trainer",
     "pipeline_parallel_microbatch_size 3 does not divide training.local_batch_size 4"),
    ("pp-reduce-every-microbatch", pp2("--parallelism.fsdp_reduce_every_microbatch", "true"), "trainer",
     "fsdp_reduce_every_microbatch with pipeline parallel"),
    ("pp-reshard-always-split", pp2("--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble",
                                    "--parallelism.fsdp_reshard_after_forward", "always",
                                    "--parallelism.pipeline_parallel_layers_per_stage", "2"), "trainer",
     "'always' with schedule InterleavedZeroBubble trains with wrong gradients"),
    ("pp-parts-unknown", lambda tmp: [*config_file(
        '[parallelism]\nmodule_fqns_per_model_part = [["tok_embeddings", "layers.0", "layers.1", "layers.2"], '
        '["layers.3", "layers.4", "layers.9", "norm", "output"]]\n')(tmp), *PP2], "trainer",
     "module_fqns_per_model_part names ['layers.9']"),
    ("pp-layers-per-stage", pp2("--parallelism.pipeline_parallel_layers_per_stage", "1"), "trainer",
     "pipeline_parallel_layers_per_stage"),
    ("pp-ddp", layout(4, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree", "2",
                      "--parallelism.data_parallel_shard_degree", "1"), "trainer", "pipeline parallel with DDP"),
    # context parallel
    ("cp-deepseek", layout(2, *DEEPSEEK, "--parallelism.context_parallel_degree", "2"), "trainer",
     "context_parallel_degree > 1 is not supported yet for deepseek_v3/debugmodel: MLA's value heads"),
    ("cp-seq-len", layout(2, "--parallelism.context_parallel_degree", "2", "--training.seq_len", "30"), "trainer",
     "seq_len"),
    ("cp-alltoall-documents", layout(2, "--parallelism.context_parallel_degree", "2", "--model.attn_mask_type",
                                     "block_causal", "--parallelism.context_parallel_rotate_method", "alltoall"), "trainer",
     "context_parallel_rotate_method alltoall runs torch's ring on the flash kernel"),
    ("cp-validation-shape", layout(2, "--parallelism.context_parallel_degree", "2", "--validation.enable", "true",
                                   "--validation.seq_len", "64"), "trainer",
     "validation.local_batch_size / validation.seq_len other than training's are not supported"),
    # expert parallel
    ("ep-dense", layout(2, "--parallelism.expert_parallel_degree", "2"), "trainer",
     "expert_parallel_degree 2: llama3/debugmodel has no experts"),
    ("ep-not-dividing", layout(3, *DEEPSEEK, "--parallelism.expert_parallel_degree", "3"), "trainer",
     "8 experts do not divide over expert parallel degree 3"),
    ("ep-etp", layout(2, *QWEN3_MOE, "--parallelism.tensor_parallel_degree", "2",
                      "--parallelism.expert_tensor_parallel_degree", "4"), "trainer",
     "parallelism.expert_tensor_parallel_degree 4 must be 1 or tensor_parallel_degree 2"),
    ("ep-force-balance-dense", cli("--check", "--debug.moe_force_load_balance", "true"), "trainer",
     "debug.moe_force_load_balance: llama3/debugmodel has no experts"),
    ("ep-capacity-dense", cli("--check", "--parallelism.expert_capacity_factor", "1.25"), "trainer",
     "parallelism.expert_capacity_factor: llama3/debugmodel has no experts"),
    ("ep-capacity-factor", cli("--check", *QWEN3_MOE, "--parallelism.expert_capacity_factor", "0"), "trainer",
     "parallelism.expert_capacity_factor: 0.0 must be > 0"),
    # float8 / MX converters: nothing converted is an error, a pattern matching nothing a warning
    ("float8-filters-everything", cli("--check", "--model.converters", "float8", "--float8.filter_fqns", "layers,output"),
     "trainer", "model.converters float8 would convert no module of llama3/debugmodel (float8.filter_fqns ['layers', 'output'])"),
    ("float8-recipe", cli("--check", "--model.converters", "float8", "--float8.recipe_name", "blockwise"), "trainer",
     "float8 recipe_name 'blockwise' is not one of"),
    ("float8-all-gather-rowwise", layout(2, "--model.converters", "float8", "--float8.recipe_name", "rowwise",
                                         "--float8.enable_fsdp_float8_all_gather", "true"), "trainer",
     "enable_fsdp_float8_all_gather needs recipe_name 'tensorwise', not 'rowwise'"),
    ("mx-filters-everything", cli("--check", *MX, "--quantize.linear.mx.filter_fqns", "layers,output"), "trainer",
     "model.converters quantize.linear.mx would convert no module"),
    ("mx-tp", layout(2, *MX, "--parallelism.tensor_parallel_degree", "2"), "trainer",
     "model.converters quantize.linear.mx with tensor_parallel_degree > 1 is not supported"),
    ("mx-recipe-needs-gpu", cli("--check", "--model.converters", "quantize.linear.mx"), "trainer",
     "config section [quantize.linear.mx]"),
    ("grouped-mm-dense", cli("--check", *GROUPED), "trainer",
     "model.converters quantize.grouped_mm.mx would convert no module of llama3/debugmodel"),
    ("grouped-mm-fqns-typo", cli("--check", *GROUPED[:-4], "--quantize.grouped_mm.mx.fqns", "expertz", *GROUPED[-2:],
                                 *DEEPSEEK), "trainer",
     "would convert no module of deepseek_v3/debugmodel (quantize.grouped_mm.mx.fqns ['expertz'])"),
    ("grouped-mm-fqns-empty", cli("--check", *GROUPED[:-4], "--quantize.grouped_mm.mx.fqns", "", *GROUPED[-2:], *DEEPSEEK),
     "trainer", "grouped_mm fqns is empty"),
    ("grouped-mm-tp", layout(2, *GROUPED, *DEEPSEEK, "--parallelism.tensor_parallel_degree", "2"), "trainer",
     "model.converters quantize.grouped_mm.mx with parallelism.tensor_parallel_degree 2 is not supported yet"),
    ("grouped-mm-fp32", cli("--check", *GROUPED[:-2], "--training.dtype", "float32", *DEEPSEEK), "trainer",
     "needs bfloat16 experts"),
    ("grouped-mm-compile", cli("--check", *GROUPED, *DEEPSEEK, "--compile.enable", "true"), "trainer",
     "with compile.enable (model) is not supported yet"),
    # token shards
    ("shards-name-escapes", shards_run(_escape), "trainer",
     "index.json names shard '../elsewhere/shard-00000', not a file name in {tmp}/shards"),
    ("shards-name-absolute", shards_run(_shard_name("{folder}/shard-00000")), "trainer", "not a file name in {tmp}/shards"),
    ("shards-name-dotdot", shards_run(_shard_name("..")), "trainer", "names shard '..', not a file name"),
    ("shards-name-not-text", shards_run(_shard_name(7)), "trainer", "names shard 7, not a file name"),
    ("shards-dtype-float", shards_run(_set(dtype="<f2")), "trainer", "dtype '<f2' is not a token-id type (uint16 or uint32)"),
    ("shards-dtype-signed", shards_run(_set(dtype="<i2")), "trainer", "dtype '<i2' is not a token-id type"),
    ("shards-dtype-garbage", shards_run(_set(dtype="tokens")), "trainer", "index.json: dtype 'tokens' is not a token-id type"),
    ("shards-max-id", shards_run(_set(max_id=5000)), "trainer",
     "its shards hold token id 5000, beyond the vocabulary of 2048"),
    ("shards-vocab-mismatch", shards_run(_tokenizer_field(vocab_size=4096)), "trainer",
     "index says vocabulary 4096, tokenizer 'tessera-default' has 2048"),
    ("shards-other-tokenizer", shards_run(_tokenizer_field(fingerprint="0123")), "trainer",
     "were made by tokenizer 'tessera-default' (fingerprint 0123)"),
    ("shards-damaged-ids", shards_run(_damaged_ids, "--training.shuffle", "false"), "trainer",
     "shard-00000.tokens: token id 65535 at token 1 is beyond the vocabulary of 2048"),
    ("shards-no-documents", shards_run(_no_documents), "trainer", "dataset {tmp}/shards has no documents"),
    ("shards-truncated", shards_run(_truncated_tokens), "trainer", "shard-00001.tokens: truncated shard file"),
    ("shards-file-missing", shards_run(_missing_offsets), "trainer", "shard-00001.offsets is missing"),
    ("shards-format", shards_run(_set(format="something-else")), "trainer", "not a tessera-token-shards index of version 1"),
    ("shards-no-vocab", shards_run(_tokenizer_field(vocab_size="big")), "trainer",
     "index.json: tokenizer.vocab_size 'big' is not a non-negative integer"),
    # mixtures
    ("mixture-no-weight", mixture("{tmp}/a.txt"), "trainer", "expected 'path=weight'"),
    ("mixture-zero-weight", mixture("{tmp}/a.txt=0"), "trainer", "weight '0' must be a positive number"),
    ("mixture-negative-weight", mixture("{tmp}/a.txt=-1"), "trainer", "weight '-1' must be a positive number"),
    ("mixture-missing-dataset", mixture("/no/such/a.txt=1"), "trainer", "/no/such/a.txt"),
    ("mixture-bad-shards", mixture("{tmp}/shards=1", setup=lambda tmp: _shards(tmp, _set(dtype="<f4")) and []),
     "trainer", "dtype '<f4' is not a token-id type"),
    # Hugging Face folders and exports
    ("hf-index-escapes", run_with(setup=_hf_index({"model.norm.weight": "../model-00001-of-00001.safetensors"})), "trainer",
     "not a file name in the folder"),
    ("hf-index-not-json", run_with(setup=_hf_index("{not json")), "trainer", "model.safetensors.index.json is not a valid index"),
    ("hf-index-no-weight-map", run_with(setup=_hf_index(json.dumps({"metadata": {}}))), "trainer",
     "model.safetensors.index.json is not a valid index"),
    ("hf-index-lists-missing", run_with(setup=_hf_index({"model.norm.weight": "model-00001-of-00001.safetensors",
                                                         "lm_head.weight": "model-00001-of-00001.safetensors"})), "trainer",
     "'lm_head.weight' is listed in"),
    ("hf-export-exists", run_with(setup=_export_exists), "trainer",
     "step-3-hf already exists from another run, and this run (resuming from no checkpoint of {tmp}/dump/checkpoint) "
     "would export its own weights there"),
    # checkpoints
    ("checkpoint-metadata-escapes", run_with(setup=_dcp_escaping), "trainer",
     "its metadata names data file '../../__0_0.distcp', not a file in the folder"),
]

# ---- every tool's own arguments and inputs: tools/plan, tools/estimate, tools/pretokenize, tools/convert


def _text(name, content):
    return lambda tmp: str(_write(tmp / name, content))


def tool(*argv):
    """A tool's argv: `{tmp}` in an argument is the case's folder, a callable makes a file."""
    return lambda tmp: [a(tmp) if callable(a) else a.format(tmp=tmp) for a in argv]


def _hf_checkpoint(config):
    def make(tmp):
        save_hf({"model.norm.weight": torch.ones(4)}, tmp / "hf")
        _write(tmp / "hf" / "config.json", json.dumps(config))
        return str(tmp / "hf")
    return make


PLAN = ["--flavor", "8B", "--gpus", "8"]
TOOL_CASES = [
    ("plan-global-batch-zero", tool(*PLAN, "--global_batch", "0"), "plan", "--global_batch 0 must be >= 1"),
    ("plan-global-batch-negative", tool(*PLAN, "--global_batch", "-4"), "plan", "--global_batch -4 must be >= 1"),
    ("plan-tp-beyond-a-node", tool(*PLAN, "--tp", "16"), "plan", "--tp 16: 16 exceeds the 8 GPUs of a H100 SXM node"),
    ("plan-tp-not-dividing", tool("--flavor", "8B", "--gpus", "12", "--tp", "8"), "plan", "--tp 8: 8 does not divide --gpus 12"),
    ("plan-tp-zero", tool(*PLAN, "--tp", "0"), "plan", "--tp 0 must be >= 1"),
    ("plan-tp-words", tool(*PLAN, "--tp", "two"), "plan", "--tp 'two' is not a comma-separated list"),
    ("plan-flavor", tool("--flavor", "9B", "--gpus", "8"), "plan", "--flavor '9B' is not a flavor of llama3"),
    ("plan-model", tool("--model", "gpt2", *PLAN), "plan", "--model 'gpt2' is not one of"),
    ("plan-gpu", tool(*PLAN, "--gpu", "tpu"), "plan", "--gpu 'tpu' is not one of"),
    ("plan-gpus-zero", tool("--flavor", "8B", "--gpus", "0"), "plan", "--gpus 0 must be >= 1"),
    ("plan-seq-len-zero", tool(*PLAN, "--seq_len", "0"), "plan", "--seq_len 0 must be >= 1"),
    ("plan-efficiency", tool(*PLAN, "--efficiency", "1.5"), "plan", "--efficiency and --memory_fraction must be within (0, 1]"),
    ("plan-gpus-words", tool("--flavor", "8B", "--gpus", "eight"), "plan", "argument --gpus: invalid int value: 'eight'"),
    ("plan-no-fit", tool("--flavor", "405B", "--gpus", "1"), "plan", "no layout of llama3/405B fits 1 x H100 SXM"),
    ("estimate-world-size-zero", tool("--world_size", "0", "--formula"), "estimate", "--world_size '0' must be a positive integer"),
    ("estimate-world-size-words", tool("--world_size", "two"), "estimate", "--world_size 'two' must be a positive integer"),
    ("estimate-world-size-no-value", tool("--formula", "--world_size"), "estimate", "option --world_size needs a value"),
    ("estimate-formula-traced-model", tool("--model.name", "qwen3", "--formula"), "estimate",
     "model.name qwen3: the closed form covers llama2, llama3 only"),
    ("estimate-real-tensors", tool("--memory_estimation.disable_fake_mode", "true"), "estimate",
     "memory_estimation.disable_fake_mode: the estimator traces fake tensors only"),
    ("estimate-flavor-without-tokenizer", tool("--model.flavor", "9B", "--model.tokenizer_path", "{tmp}/absent.model"),
     "estimate", "model.flavor '9B' is not a flavor of llama3"),
    ("estimate-layout", tool("--world_size", "2", "--parallelism.tensor_parallel_degree", "4", "--formula"), "estimate",
     "world size 2 is not divisible"),
    ("estimate-unknown-key", tool("--training.nope", "1"), "estimate", "training.nope"),
    ("estimate-config-file", tool("--job.config_file", "{tmp}/absent.toml"), "estimate", "{tmp}/absent.toml"),
    ("pretokenize-workers", tool("--out", "{tmp}/o", "--workers", "0", _text("a.txt", "x")), "pretokenize",
     "workers must be a positive int, got 0"),
    ("pretokenize-shard-tokens", tool("--out", "{tmp}/o", "--shard-tokens", "0", _text("a.txt", "x")), "pretokenize",
     "shard_tokens must be a positive int, got 0"),
    ("pretokenize-missing-source", tool("--out", "{tmp}/o", "{tmp}/absent.jsonl"), "pretokenize",
     "dataset path not found: {tmp}/absent.jsonl"),
    ("pretokenize-tokenizer", tool("--out", "{tmp}/o", "--tokenizer", "{tmp}/absent.json", _text("a.txt", "x")),
     "pretokenize", "tokenizer file not found: {tmp}/absent.json"),
    ("pretokenize-no-field", tool("--out", "{tmp}/o", _text("a.jsonl", '{"text": "a"}\n{"body": "b"}\n')), "pretokenize",
     "{tmp}/a.jsonl:2: no 'text' field"),
    ("pretokenize-field-not-text", tool("--out", "{tmp}/o", _text("a.jsonl", '{"text": 5}\n')), "pretokenize",
     "{tmp}/a.jsonl:1: field 'text' is not a string"),
    ("pretokenize-not-utf8", tool("--out", "{tmp}/o", _text("a.txt", b"\x00\xff\xfe")), "pretokenize",
     "{tmp}/a.txt: not valid UTF-8"),
    ("pretokenize-out-is-a-file", tool("--out", _text("o", "x"), _text("a.txt", "x")), "pretokenize",
     "{tmp}/o exists and does not hold shards of these inputs"),
    ("convert-no-record", _convert("dcp-to-hf", setup=lambda tmp: [str(_dcp(tmp / "c")), str(tmp / "o")]), "convert",
     "has no model_args.json: pass --flavor (and --model) or --hf_config"),
    ("convert-hf-config-missing", _convert("dcp-to-hf", "--hf_config", "{tmp}/absent",
                                           setup=lambda tmp: [str(_dcp(tmp / "c")), str(tmp / "o")]), "convert",
     "{tmp}/absent"),
    ("convert-config-disagrees", _convert("hf-to-dcp", "--flavor", "debugmodel",
                                          setup=lambda tmp: [_hf_checkpoint({"model_type": "llama", "hidden_size": 7})(tmp),
                                                             str(tmp / "o")]), "convert", "config.json"),
    ("convert-unknown-model", _convert("dcp-to-hf", "--model", "gpt2", "--flavor", "x",
                                       setup=lambda tmp: [str(_dcp(tmp / "src")), str(tmp / "o")]), "convert", "gpt2"),
]
CASES += SURFACE_CASES + TOOL_CASES
PROGRAMS = {"trainer": trainer, "convert": convert.main, "plan": plan.main, "estimate": estimate.main,
            "pretokenize": pretokenize.main}


def _snapshot(folder: Path) -> dict:
    """The files, but a trainer's claim on its checkpoint folder (tessera.ckpt's lock file), which
    a run takes before it looks at the checkpoints there."""
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != LOCK_FILE}


def test_corpus_is_large_enough():
    assert len(CASES) - len(SURFACE_CASES) - len(TOOL_CASES) >= 60 and len(SURFACE_CASES) + len(TOOL_CASES) >= 60


@pytest.mark.parametrize("make, program, words", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_malformed_input_is_one_line_and_changes_nothing(tmp_path, capsys, make, program, words):
    argv = make(tmp_path)
    before = _snapshot(tmp_path)
    code = PROGRAMS[program](argv)
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert "\n" not in err and "Traceback" not in err and "error: " in err, err
    assert words.format(tmp=tmp_path) in err, err
    assert _snapshot(tmp_path) == before  # no file written, changed or deleted
