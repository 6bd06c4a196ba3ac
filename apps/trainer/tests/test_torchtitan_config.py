"""torchtitan 0.2.2 users bring their config unchanged: every key of its JobConfig parses, the
unsupported ones are refused with a reason, the keys it shares mean the same, and the CLI
explains itself."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.trainer import cli_info
from tessera.trainer.config import ConfigError, JobConfig, get_key, load_config
from tessera.trainer.main import main
from tessera.trainer.parallelize import build_model
from tessera.trainer.plan import make_plan
from tessera.trainer.schema import declared
from tessera.trainer.train import train

KEYS = declared(JobConfig)  # "section.key" -> what its field declares

# The contract: torchtitan 0.2.2's JobConfig, every field (nested tables dotted).
TORCHTITAN_022_KEYS = """
job.config_file job.dump_folder job.description job.print_config job.save_config_file job.custom_config_module
profiling.enable_profiling profiling.save_traces_folder profiling.profile_freq profiling.profiler_active
profiling.profiler_warmup profiling.enable_memory_snapshot profiling.save_memory_snapshot_folder
metrics.log_freq metrics.enable_tensorboard metrics.disable_color_printing metrics.save_tb_folder
metrics.save_for_all_ranks metrics.enable_wandb
model.name model.flavor model.hf_assets_path model.tokenizer_path model.converters model.print_after_conversion
optimizer.name optimizer.lr optimizer.beta1 optimizer.beta2 optimizer.eps optimizer.weight_decay
optimizer.implementation optimizer.early_step_in_backward
lr_scheduler.warmup_steps lr_scheduler.total_steps lr_scheduler.decay_ratio lr_scheduler.decay_type
lr_scheduler.min_lr_factor
training.dataset training.dataset_path training.local_batch_size training.global_batch_size training.seq_len
training.max_norm training.steps training.enable_cpu_offload training.dtype training.mixed_precision_param
training.mixed_precision_reduce training.gc_freq training.gc_debug training.dataloader.num_workers
training.dataloader.persistent_workers training.dataloader.pin_memory training.dataloader.prefetch_factor
parallelism.data_parallel_replicate_degree parallelism.data_parallel_shard_degree
parallelism.fsdp_reshard_after_forward parallelism.tensor_parallel_degree parallelism.disable_loss_parallel
parallelism.enable_async_tensor_parallel parallelism.pipeline_parallel_degree parallelism.module_fqns_per_model_part
parallelism.pipeline_parallel_first_stage_less_layers parallelism.pipeline_parallel_last_stage_less_layers
parallelism.pipeline_parallel_layers_per_stage parallelism.pipeline_parallel_schedule
parallelism.pipeline_parallel_schedule_csv parallelism.pipeline_parallel_microbatch_size
parallelism.pipeline_parallel_expert_parallel_overlap parallelism.context_parallel_degree
parallelism.context_parallel_load_balancer parallelism.context_parallel_rotate_method
parallelism.expert_parallel_degree parallelism.expert_tensor_parallel_degree parallelism.expert_parallel_comm_backend
checkpoint.enable checkpoint.enable_ft_dataloader_checkpoints checkpoint.folder checkpoint.interval
checkpoint.initial_load_path checkpoint.initial_load_model_only checkpoint.initial_load_in_hf
checkpoint.initial_load_in_hf_quantized checkpoint.last_save_model_only checkpoint.last_save_in_hf
checkpoint.export_dtype checkpoint.async_mode checkpoint.keep_latest_k checkpoint.load_step
checkpoint.exclude_from_loading checkpoint.enable_first_step_checkpoint checkpoint.create_seed_checkpoint
checkpoint.load_only
activation_checkpoint.mode activation_checkpoint.selective_ac_option
activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns activation_checkpoint.early_stop
activation_checkpoint.memory_budget activation_checkpoint.visualize_memory_budget_pareto
activation_checkpoint.preserve_rng_state activation_checkpoint.determinism_check activation_checkpoint.debug
compile.enable compile.components compile.backend
quantize.linear.float8.enable_fsdp_float8_all_gather quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp
quantize.linear.float8.recipe_name quantize.linear.float8.filter_fqns quantize.linear.float8.emulate
quantize.linear.mx.mxfp8_dim1_cast_kernel_choice quantize.linear.mx.recipe_name quantize.linear.mx.filter_fqns
quantize.grouped_mm.float8.fqns quantize.grouped_mm.mx.recipe_name quantize.grouped_mm.mx.fqns
comm.init_timeout_seconds comm.train_timeout_seconds comm.trace_buf_size comm.save_traces_folder
comm.save_traces_file_prefix comm.mode
memory_estimation.enable memory_estimation.disable_fake_mode
fault_tolerance.enable fault_tolerance.process_group fault_tolerance.process_group_timeout_ms
fault_tolerance.replica_id fault_tolerance.group_size fault_tolerance.min_replica_size fault_tolerance.semi_sync_method
experimental.custom_import experimental.custom_args_module
validation.enable validation.dataset validation.dataset_path validation.local_batch_size validation.seq_len
validation.freq validation.steps validation.dataloader.num_workers validation.dataloader.persistent_workers
validation.dataloader.pin_memory validation.dataloader.prefetch_factor
debug.seed debug.deterministic debug.deterministic_warn_only debug.moe_force_load_balance
""".split()

SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
         "--lr_scheduler.warmup_steps", "2"]

# A value other than the default for each refused key, as typed on a command line.
_OTHER = {bool: lambda v: str(not v).lower(), int: lambda v: str(v + 1), float: lambda v: str(v / 2),
          str: lambda v: v + "x", list: lambda v: "something_else", type(None): lambda v: "7"}


def test_every_torchtitan_022_key_is_known_and_explained():
    assert len(TORCHTITAN_022_KEYS) == 149
    missing = sorted(set(TORCHTITAN_022_KEYS) - set(KEYS))
    assert not missing


@pytest.mark.parametrize("key", TORCHTITAN_022_KEYS)
def test_every_key_parses_at_its_default(key):
    default = get_key(JobConfig(), key)
    if default is None or isinstance(default, list) or key == "job.config_file":
        pytest.skip("unset or list default: written differently on a command line; type-checked by test_config")
    text = str(default).lower() if isinstance(default, bool) else str(default)
    value = get_key(load_config([f"--{key}", text]), key)
    assert value == default or (KEYS[key].path and value.endswith(default.lstrip(".")))


@pytest.mark.parametrize("key", sorted(key for key, facts in KEYS.items() if facts.refused))
def test_a_refused_key_names_itself_and_why(key):
    default = get_key(JobConfig(), key)
    with pytest.raises(ConfigError) as error:
        load_config([f"--{key}", _OTHER[type(default)](default)])
    message = str(error.value)
    assert message.startswith(f"config key {key} = ") and KEYS[key].refused in message and "\n" not in message


def test_help_lists_every_key_with_default_and_meaning(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for key in KEYS:
        assert f"--{key} (default " in out and KEYS[key].help in out
    assert main(["--help", "lr_scheduler"]) == 0
    section = capsys.readouterr().out
    assert "--lr_scheduler.decay_ratio" in section and "--training.steps" not in section
    assert main(["--help", "nosuch"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --help nosuch: no such config section")


def test_version_names_trainer_libraries_torch_and_commit(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    for name in cli_info.LIBRARIES:
        assert f" {name} 0." in out
    assert out.startswith(f"tessera trainer {cli_info.TRAINER_VERSION} |") and f"torch {torch.__version__}" in out
    assert "\n" not in out and " git " in out


def test_naming_the_commit_never_writes_into_the_checkout(tmp_path, monkeypatch):
    """`git describe --dirty` rewrote the index of a checkout whose files' stat had changed, at
    every run; the commit and whether it is dirty are read without that."""
    git = lambda *args: subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],  # noqa: E731
                                       check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    (tmp_path / "f").write_text("a")
    git("add", "f")
    git("commit", "-qm", "one")
    monkeypatch.setenv("BUILD_WORKSPACE_DIRECTORY", str(tmp_path))
    index = tmp_path / ".git" / "index"
    os.utime(tmp_path / "f", ns=(index.stat().st_mtime_ns + 10**9,) * 2)  # stat changed, content not
    before = index.stat().st_mtime_ns
    assert cli_info._git_commit() == git("rev-parse", "--short", "HEAD")
    (tmp_path / "f").write_text("b")
    assert cli_info._git_commit() == git("rev-parse", "--short", "HEAD") + "-dirty"
    assert index.stat().st_mtime_ns == before


def test_version_names_the_code_s_commit_from_any_folder(tmp_path, monkeypatch, capsys):
    source = Path(cli_info.__file__).resolve().parent
    described = subprocess.run(["git", "-C", str(source), "describe", "--always", "--dirty"], capture_output=True, text=True)
    monkeypatch.chdir(tmp_path)  # not a checkout
    monkeypatch.delenv("BUILD_WORKSPACE_DIRECTORY", raising=False)
    assert main(["--version"]) == 0
    expected = described.stdout.strip() if described.returncode == 0 else "unknown"
    assert capsys.readouterr().out.strip().endswith(f"| git {expected}")


def test_readme_key_table_is_current():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert cli_info.key_table() in readme, "regenerate with: python -m tessera.trainer.cli_info"


def test_c4_test_resolves_in_the_users_folder_and_c4_needs_a_path(tmp_path, monkeypatch):
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    folder = tmp_path / "tests/assets/c4_test"
    folder.mkdir(parents=True)
    (folder / "data.json").write_text("".join(json.dumps({"text": f"document {i} " * 50}) + "\n" for i in range(40)))
    assert make_plan(load_config(["--training.dataset", "c4_test"]), 1).dataset == str(folder)
    with pytest.raises(ConfigError, match="'c4' is allenai/c4 on the Hugging Face hub.*set dataset_path"):
        make_plan(load_config(["--training.dataset", "c4"]), 1)
    with pytest.raises(ConfigError, match=r"'c4_validation' is allenai/c4 \(validation split\)"):
        make_plan(load_config(["--validation.enable", "true", "--validation.dataset", "c4_validation"]), 1)
    history = train(load_config([*SMALL, "--training.dataset", "c4_test", "--training.steps", "2",
                                 "--job.dump_folder", str(tmp_path / "out")]))
    assert len(history) == 2


def test_training_dtype_bfloat16_keeps_parameters_in_bf16():
    plan = make_plan(load_config(["--training.dtype", "bfloat16"]), 1)
    model = build_model(plan)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored
    assert all(b.dtype in (torch.float32, torch.complex64) for b in model.buffers())  # RoPE tables stay exact


def test_profiler_traces_exactly_every_profile_freq_steps(tmp_path):
    train(load_config([*SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "10",
                       "--profiling.enable_profiling", "true", "--profiling.profile_freq", "4",
                       "--profiling.profiler_warmup", "1"]))
    assert sorted(p.name for p in (tmp_path / "profile_traces").iterdir()) == ["iteration_4", "iteration_8"]
    with pytest.raises(ConfigError, match="profiler_warmup 3 \\+ profiler_active 1 exceed profile_freq 1"):
        load_config(["--profiling.enable_profiling", "true", "--profiling.profile_freq", "1"])


def test_first_step_checkpoint_load_only_and_saved_lines(tmp_path, capsys):
    common = [*SMALL, "--job.dump_folder", str(tmp_path), "--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    train(load_config([*common, "--training.steps", "3", "--checkpoint.enable_first_step_checkpoint", "true"]))
    folder = tmp_path / "checkpoint"
    assert {"step-1", "step-3"} <= {p.name for p in folder.iterdir()}
    out = capsys.readouterr().out
    assert f"checkpoint: saved {folder / 'step-1'} in " in out
    # the run's last line: steps, tokens (2 x 32 per step), the logged losses' last and lowest, its newest checkpoint
    summary = out.strip().splitlines()[-1]
    losses = [float(x) for x in re.findall(r"^step +\d/3 +loss +([\d.]+)", out, re.M)]
    assert len(losses) == 3 and summary.startswith("run done: 3 steps, 192 tokens in "), out
    assert f"final loss {losses[-1]:.4f}, best {min(losses):.4f}" in summary and summary.endswith(f"checkpoint {folder / 'step-3'}")
    before = sorted(p.name for p in folder.iterdir())
    train(load_config([*common, "--training.steps", "6", "--checkpoint.load_only", "true"]))
    assert sorted(p.name for p in folder.iterdir()) == before  # resumed from step 3, saved nothing
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("; no checkpoint written")


def test_each_run_gets_its_own_tensorboard_folder_and_no_colour_off_a_terminal(tmp_path):
    args = [*SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "1", "--metrics.enable_tensorboard", "true",
            "--job.save_config_file", "saved/config.json"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.run([sys.executable, "-m", "tessera.trainer.main", *args], capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr
    assert "\x1b[" not in first.stdout  # captured output is not a terminal
    (tmp_path / "tb").rename(tmp_path / "tb_first")
    train(load_config(args))
    train(load_config(args))
    runs = list((tmp_path / "tb").iterdir())
    assert len(runs) == 2 or runs[0].name.count("-") == 1  # two runs in one second share a folder name
    assert json.loads((tmp_path / "saved/config.json").read_text())["training"]["steps"] == 1


def test_tensorboard_carries_torchtitan_s_tags_beside_its_own(tmp_path):
    """torchtitan 0.2.2's dashboards chart its own tag names: each scalar is written under both,
    with equal values (the CUDA allocator's tags only on CUDA)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tessera.trainer.metrics import TORCHTITAN_TAGS

    history = train(load_config([*SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "2",
                                 "--metrics.enable_tensorboard", "true", "--validation.enable", "true",
                                 "--validation.steps", "1", "--validation.freq", "2"]))
    events = EventAccumulator(str(next((tmp_path / "tb").iterdir())))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    cuda_only = {name for name in TORCHTITAN_TAGS if name.startswith("memory_")}
    for name, torchtitan_name in TORCHTITAN_TAGS.items():
        if name in cuda_only:
            assert torchtitan_name not in tags
            continue
        ours, theirs = events.Scalars(name), events.Scalars(torchtitan_name)
        assert [(e.step, e.value) for e in ours] == [(e.step, e.value) for e in theirs] != [], name
    losses = [e.value for e in events.Scalars("loss_metrics/global_avg_loss")]
    assert losses == pytest.approx([h["loss"] for h in history if "loss" in h])
    assert [e.value for e in events.Scalars("n_tokens_seen")] == [64, 128]  # 2 sequences x 32 tokens a step
    assert {"grad_norm", "tflops", "lr"} <= tags


def test_custom_import_registers_before_checks(tmp_path, monkeypatch):
    (tmp_path / "my_converters.py").write_text(
        "from tessera.trainer.converters import ModelConverter, register_converter\n"
        "register_converter('noop_for_test', lambda config, dims, device: ModelConverter(name='noop_for_test', convert=lambda m: None))\n"
    )
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    config = load_config(["--experimental.custom_import", "my_converters", "--model.converters", "noop_for_test"])
    assert config.model.converters == ["noop_for_test"]
    with pytest.raises(ConfigError, match="experimental.custom_import: cannot import 'no_such_module_here'"):
        load_config(["--experimental.custom_import", "no_such_module_here"])


def test_validation_shape_of_its_own(tmp_path):
    history = train(load_config([*SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "2",
                                 "--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "1",
                                 "--validation.seq_len", "64", "--validation.local_batch_size", "1"]))
    assert any("validation_loss" in h for h in history)
    with pytest.raises(ConfigError, match="validation.local_batch_size / validation.seq_len other than training's"):
        make_plan(load_config([*SMALL, "--validation.enable", "true", "--validation.seq_len", "64",
                               "--parallelism.context_parallel_degree", "2"]), 2)


# The layout of torchtitan 0.2.2's llama3 debug_model.toml, key for key (values as shipped).
TORCHTITAN_DEBUG_TOML = """
[job]
dump_folder = "./outputs"
description = "Llama 3 debug training"
print_config = false

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 10
enable_memory_snapshot = false
save_memory_snapshot_folder = "memory_snapshot"

[metrics]
log_freq = 1
disable_color_printing = false
enable_tensorboard = false
save_tb_folder = "tb"
enable_wandb = false

[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "./tests/assets/tokenizer"

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = 8
seq_len = 2048
max_norm = 1.0
steps = 10
dataset = "c4_test"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"
tensor_parallel_degree = 1
enable_async_tensor_parallel = false
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "Interleaved1F1B"
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 10
last_save_model_only = false
export_dtype = "float32"
async_mode = "disabled"

[activation_checkpoint]
mode = "selective"
selective_ac_option = '2'

[compile]
enable=false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[validation]
enable = false
dataset = "c4_validation"
freq = 5
steps = 10
"""


def torchtitan_checkout(root: Path, config: str, toml: str) -> Path:
    """A torchtitan checkout's layout under root: the config at its path, a Hugging Face
    tokenizer.json folder and the c4_test JSON lines (tests/assets), as its repository holds them."""
    from tessera.data import iter_documents, load_tokenizer, write_hf_tokenizer

    (root / config).parent.mkdir(parents=True)
    (root / config).write_text(toml)
    write_hf_tokenizer(load_tokenizer(), root / "tests/assets/tokenizer")
    c4 = root / "tests/assets/c4_test"
    c4.mkdir(parents=True)
    documents = [text for _, text in zip(range(200), iter_documents(None))]
    (c4 / "data.json").write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    return c4


def test_torchtitan_debug_config_and_assets_train_unchanged(tmp_path, monkeypatch):
    """The config, tokenizer and c4_test read from where the user stands. The file is untouched;
    the command line cuts the run to 2 steps of one sequence (CI's CPU time)."""
    c4 = torchtitan_checkout(tmp_path, "train_configs/debug_model.toml", TORCHTITAN_DEBUG_TOML)
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    config = load_config(["--job.config_file", "train_configs/debug_model.toml", "--training.steps", "2",
                          "--training.local_batch_size", "1"])
    plan = make_plan(config, 1)
    assert plan.dataset == str(c4) and config.model.hf_assets_path == str(tmp_path / "tests/assets/tokenizer")
    history = train(config)
    assert [h["step"] for h in history] == [1, 2] and all(0 < h["loss"] < 10 for h in history)
    assert (tmp_path / "outputs").is_dir()


# torchtitan 0.2.2's torchtitan/models/deepseek_v3/train_configs/debug_model.toml, verbatim
# (BSD-3-Clause, (c) Meta Platforms, Inc. and affiliates): 2 pipeline ranks with DualPipeV x EP 2,
# selective 'op' checkpointing, the profiler every step.
TORCHTITAN_DEEPSEEK_V3_DEBUG_TOML = """\
[job]
dump_folder = "./outputs"
description = "DeepSeek-V3 debug training"
print_config = false

[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 1
profiler_warmup = 0
enable_memory_snapshot = false
save_memory_snapshot_folder = "memory_snapshot"

[metrics]
log_freq = 1
disable_color_printing = false
enable_tensorboard = false
save_tb_folder = "tb"
enable_wandb = false

[model]
name = "deepseek_v3"
flavor = "debugmodel"
# test tokenizer, for debug purpose only
hf_assets_path = "./tests/assets/tokenizer"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 0  # lr scheduler warm up, normally 20% of the train steps
decay_ratio = 0.8  # lr scheduler decay ratio, 80% of the train steps
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = 4
seq_len = 4
max_norm = 1.0  # grad norm clipping
steps = 6
dataset = "c4_test"  # supported datasets: c4_test (2K), c4 (177M)
# dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default" # default / never / always
tensor_parallel_degree = 1
enable_async_tensor_parallel = false
pipeline_parallel_degree = 2
expert_parallel_degree = 2
context_parallel_degree = 1
pipeline_parallel_schedule = "DualPipeV"
expert_tensor_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 10
last_save_model_only = false
export_dtype = "float32"
async_mode = "disabled"  # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = 'op'  # 'int' = ac every positive int layer or 'op', ac based on ops policy

[compile]
enable=false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output", "router.gate"]

[quantize.grouped_mm.float8]
fqns = ["experts"]
"""


def test_torchtitan_deepseek_v3_debug_config_runs_unchanged_on_four_processes(tmp_path, monkeypatch):
    """Its layout (pp 2 x dp_shard 2 with EP 2 inside) on 4 local ranks from the user's folder,
    against the same config on one process (pp and ep 1, the same global batch of 8): losses and
    grad norms to the 4 decimals the log prints. The command line cuts the 6 steps to 2 (the
    profiler traces every step: seconds each on CPU); test_moe_train holds this layout to 1e-5."""
    config = "torchtitan/models/deepseek_v3/train_configs/debug_model.toml"
    torchtitan_checkout(tmp_path, config, TORCHTITAN_DEEPSEEK_V3_DEBUG_TOML)
    argv = ["--job.config_file", config, "--training.steps", "2"]
    proc = subprocess.run([sys.executable, "-m", "tessera.trainer.main", "--nproc", "4", *argv], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cpu x4 {'pp': 2, 'dp_shard': 2}" in proc.stdout and "AC selective (op)" in proc.stdout, proc.stdout
    logged = [tuple(map(float, m)) for m in re.findall(r"step \d/2  loss +(\S+)  grad_norm +(\S+)", proc.stdout)]
    assert sorted(p.name for p in (tmp_path / "outputs/profile_trace").iterdir()) == ["iteration_1", "iteration_2"]
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    single = train(load_config([*argv, "--parallelism.pipeline_parallel_degree", "1", "--parallelism.expert_parallel_degree",
                                "1", "--training.local_batch_size", "8", "--job.dump_folder", str(tmp_path / "single")]))
    assert len(logged) == len(single) == 2
    for (loss, norm), step in zip(logged, single):  # the log prints 4 decimals
        assert loss == pytest.approx(step["loss"], abs=1e-4) and norm == pytest.approx(step["grad_norm"], abs=1e-4)
