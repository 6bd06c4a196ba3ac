"""The job plan: every user error raised from config + world size alone (no process group, no
model, no data), `--check`, fail-once under --nproc, and bugs kept apart from bad input."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera import ckpt, fsdp, models
from tessera.mesh.testing import run_on_ranks
from tessera.trainer import config as config_module
from tessera.trainer.check import parameter_counts
from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.main import main
from tessera.trainer.plan import make_plan

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


SAC_OP = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]


def plan(world_size=1, *argv, device="cpu"):
    return make_plan(load_config(list(argv)), world_size, device)


def test_plan_resolves_layout_batch_and_model():
    p = plan(8, "--parallelism.tensor_parallel_degree", "2", "--training.global_batch_size", "32",
             "--training.local_batch_size", "2", "--training.seq_len", "128")
    assert (p.dims.dp_shard, p.dims.tp) == (4, 2)
    assert (p.batch.local, p.batch.dp, p.batch.accumulation, p.batch.global_size) == (2, 4, 4, 32)
    assert p.batch.tokens_per_device == 2 * 128 * 4 / 2  # tp peers share a dp rank's tokens
    assert p.model_args.vocab_size == 2048 and p.model_args.max_seq_len == 128
    assert p.loss.parallel and not p.precision.autocast and p.loss.scale == 1 / 4
    assert p.meshes.describe()  # described without any process group


@pytest.mark.parametrize(
    "world_size, argv, message",
    [
        (1, ["--model.flavor", "huge"], "model.flavor 'huge' is not a flavor of llama3"),
        (1, ["--model.name", "gpt9"], "unknown model 'gpt9'"),
        (4, ["--parallelism.tensor_parallel_degree", "3"], "world size 4 is not divisible"),
        (4, ["--parallelism.tensor_parallel_degree", "4", "--training.seq_len", "30"],
         "tensor_parallel_degree 4 does not divide seq_len=30"),
        (2, ["--training.global_batch_size", "6", "--training.local_batch_size", "4"], "global_batch_size 6 is not a multiple"),
        (1, ["--training.enable_cpu_offload", "true"], "enable_cpu_offload needs FSDP"),
        (1, ["--compile.enable", "true", "--compile.backend", "bogus"], "^compile.backend 'bogus' is not a torch.compile backend"),
        (1, ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "7"],
         "^activation_checkpoint.selective_ac_option 7: llama3/debugmodel has 6 blocks, so no block would be checkpointed$"),
        (2, ["--checkpoint.create_seed_checkpoint", "true"], "create_seed_checkpoint needs a single process, not 2"),
        (1, ["--checkpoint.initial_load_in_hf", "true"], "initial_load_in_hf reads a Hugging Face folder: set model.hf_assets_path"),
        (1, ["--profiling.enable_memory_snapshot", "true"], "enable_memory_snapshot records the CUDA caching allocator"),
        (2, ["--compile.enable", "true", "--parallelism.tensor_parallel_degree", "2",
             "--parallelism.enable_async_tensor_parallel", "true"], "missing here: CUDA$"),
        (1, ["--training.dataset_path", "/no/such/data.txt"], "training.dataset_path /no/such/data.txt does not exist"),
        (1, ["--training.dataset", "c4"], "dataset 'c4' is allenai/c4 on the Hugging Face hub"),
        (1, ["--model.tokenizer_path", "/no/such/tokenizer.model"], "/no/such/tokenizer.model"),
        (1, ["--job.dump_folder", "/etc/hostname"], "job.dump_folder /etc/hostname is not a folder"),
        (2, ["--parallelism.expert_parallel_degree", "2"], "expert_parallel_degree 2: llama3/debugmodel has no experts"),
        (3, ["--model.name", "deepseek_v3", "--parallelism.expert_parallel_degree", "3"],
         "^8 experts do not divide over expert parallel degree 3$"),
        (4, ["--model.name", "deepseek_v3", "--parallelism.tensor_parallel_degree", "2",
             "--parallelism.expert_parallel_degree", "3"], "ep=3 must be a multiple of cp\\*tp=2"),
        (2, ["--model.name", "qwen3", "--model.flavor", "tiny_moe", "--parallelism.tensor_parallel_degree", "2",
             "--parallelism.expert_tensor_parallel_degree", "4"],
         "^parallelism.expert_tensor_parallel_degree 4 must be 1 or tensor_parallel_degree 2$"),
        (1, ["--parallelism.expert_capacity_factor", "1.25"], "^parallelism.expert_capacity_factor: llama3/debugmodel has no experts$"),
        (1, ["--activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns", "router"],
         "applies only with activation_checkpoint.mode selective and selective_ac_option op \\(this run: 'none', 'op'\\)$"),
        (1, [*SAC_OP, "--activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns", "router"],
         r"^activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns: \['router'\] matches no linear of llama3/debugmodel$"),
        (1, ["--model.name", "deepseek_v3", *SAC_OP, "--activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
             "moe.router.gate,router.gates"],
         r"^activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns: \['router.gates'\] matches no linear of "
         "deepseek_v3/debugmodel$"),
        (1, [*SAC_OP, "--activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns", "ffn_norm"],
         "per_op_sac_force_recompute_mm_shapes_by_fqns: layers.0.ffn_norm is a RMSNorm, not a Linear"),
    ],
)
def test_every_user_error_comes_from_the_plan(world_size, argv, message):
    with pytest.raises(ConfigError, match=message):
        plan(world_size, *argv)


@pytest.mark.parametrize("release, refused", [("2.11.0+cu130", True), ("2.12.1", False), ("2.13.0+cpu", False)])
def test_v_shaped_schedules_on_cpu_need_torch_2_12(monkeypatch, release, refused):
    """torch 2.11's V schedules send between a rank's own stages, which gloo cannot (measured:
    'Pair is not connected' at the first step); the plan says so before any worker starts."""
    monkeypatch.setattr(torch, "__version__", release)
    argv = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]
    if refused:
        with pytest.raises(ConfigError, match="ZBVZeroBubble on CPU needs torch 2.12 or newer: torch 2.11.0"):
            plan(2, *argv)
    else:
        assert plan(2, *argv).pipeline.schedule == "ZBVZeroBubble"


def test_param_dtype_unset_is_torchtitan_s_on_cuda_and_float32_on_a_cpu():
    """torchtitan's shipped configs leave training.mixed_precision_param at its bfloat16 default."""
    params = {(device, argv): make_plan(load_config(list(argv)), 2, device, check_only=True).precision.param
              for device in ("cuda", "cpu") for argv in ((), ("--training.mixed_precision_param", "float32"))}
    assert params == {("cuda", ()): torch.bfloat16, ("cpu", ()): torch.float32,
                      ("cuda", ("--training.mixed_precision_param", "float32")): torch.float32,
                      ("cpu", ("--training.mixed_precision_param", "float32")): torch.float32}
    assert load_config([]).training.mixed_precision_param is None  # the config says unset; the plan decides


def test_force_recompute_names_reach_the_checkpointing_plan():
    """torchtitan's default (the router) plans on a dense model too; a name of a MoE model's
    linears is handed to the blocks' policy as given."""
    assert plan(1, *SAC_OP).checkpointing.force_recompute_fqns == ("moe.router.gate",)
    fqns = plan(1, "--model.name", "deepseek_v3", *SAC_OP, "--activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
                "shared_experts.w2").checkpointing.force_recompute_fqns
    assert fqns == ("shared_experts.w2",)


def test_moe_families_plan_tensor_parallel_but_not_a_replaced_colwise_style():
    for family in (["--model.name", "qwen3", "--model.flavor", "tiny_moe"], ["--model.name", "deepseek_v3"]):
        p = plan(2, *family, "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2")
        total, per_rank = parameter_counts(p)
        assert p.dims.tp == 2 and total / 2 < per_rank < total * 0.6  # experts split, router and latents whole
    p = plan(4, "--model.name", "deepseek_v3", "--parallelism.tensor_parallel_degree", "2",
             "--parallelism.expert_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2")
    assert (p.dims.tp, p.dims.ep, p.dims.dp_shard) == (2, 2, 2)  # etp = tp: ep inside dp_shard, beside tp
    assert p.meshes.shape_of("ep") == (2,) and p.meshes.shape_of("expert_fsdp") == (1,)
    p = plan(4, "--model.name", "deepseek_v3", "--parallelism.tensor_parallel_degree", "2",
             "--parallelism.expert_parallel_degree", "4", "--parallelism.expert_tensor_parallel_degree", "1")
    assert p.dims.ep_spans_tp and p.meshes.spans("ep") == (("dp_shard_in_ep", "tp"),)  # etp 1: tp ranks join ep
    # float8 tensorwise swaps in its own colwise style, which would all-reduce MLA's latent gradients
    with pytest.raises(ConfigError, match=r"^model.converters \['float8'\] with tensor_parallel_degree 2: deepseek_v3's"):
        plan(2, "--model.name", "deepseek_v3", "--parallelism.tensor_parallel_degree", "2", "--model.converters", "float8",
             device="cuda")


def test_a_role_no_library_styles_is_refused_by_the_plan():
    import dataclasses

    llama = models.get_model_spec("llama3")
    models.register_model_spec(dataclasses.replace(llama, name="llama3_sideways", tp_plan={**llama.tp_plan, "output": "sideways"}))
    with pytest.raises(ConfigError, match=r"tp_plan roles \['sideways'\] have no tensor-parallel style"):
        plan(2, "--model.name", "llama3_sideways", "--parallelism.tensor_parallel_degree", "2")
    plan(1, "--model.name", "llama3_sideways")  # roles matter only under tensor parallel


def test_check_only_plan_notes_files_it_cannot_see():
    config = load_config(["--job.config_file", str(CONFIGS / "llama3_405b.toml")])
    p = make_plan(config, 512, "cuda", check_only=True)
    assert any("tokenizer" in note and "vocab_size 128256" in note for note in p.notes)
    assert any("training.dataset_path" in note for note in p.notes)
    total, per_rank = parameter_counts(p)
    assert total == 405_853_388_800
    # TP 8 splits every matrix, FSDP 64 the rest; the norms (dim 16384, 253 of them) are only FSDP-split
    assert total / 512 < per_rank < total / 512 * 1.001
    # torchtitan's configs name hub data (c4) or its checkout's (c4_test): noted, the plan goes on
    for name, missing in (("c4", "allenai/c4 on the Hugging Face hub"), ("c4_test", "dataset 'c4_test' not found")):
        config = load_config(["--training.dataset", name, "--validation.enable", "true", "--validation.dataset", "c4_validation"])
        with pytest.raises(ConfigError, match=missing):
            make_plan(config, 1)
        notes = make_plan(config, 1, check_only=True).notes
        assert any(missing in note for note in notes) and any("c4_validation" in note for note in notes), notes


def test_check_only_plan_refuses_a_tokenizer_here_that_cannot_be_read(tmp_path):
    """Absent on this host: a note; present but broken: the run would fail on it too."""
    (tmp_path / "tokenizer.json").write_text("{not json")
    config = load_config(["--model.hf_assets_path", str(tmp_path)])
    with pytest.raises(ConfigError, match="tokenizer.json:1: not valid JSON"):
        make_plan(config, 1, check_only=True)


def test_check_prints_the_plan_and_exits_0(capsys):
    assert main(["--job.config_file", str(CONFIGS / "llama3_405b.toml"), "--check", "--check_world_size", "512"]) == 0
    out = capsys.readouterr().out
    assert "llama3/405B on 512" in out and "405,853,388,800 parameters" in out
    assert "dp_shard 64 x tp 8" in out and "tokens per device" in out and "per token" in out


def test_plans_of_one_model_share_its_meta_model():
    """The planner makes hundreds of plans of one model: it is built on the meta device once
    (plans only read it), whatever the layout."""
    from tessera.trainer import plan as plan_module

    plan_module._shared_meta_model.cache_clear()
    config = ["--job.config_file", str(CONFIGS / "llama3_70b.toml"), "--parallelism.pipeline_parallel_degree", "2",
              "--training.local_batch_size", "8"]
    for schedule in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
        make_plan(load_config([*config, "--parallelism.pipeline_parallel_schedule", schedule]), 128, "cuda", check_only=True)
    assert plan_module._shared_meta_model.cache_info().misses == 1 and plan_module._shared_meta_model.cache_info().hits >= 2


_LAYOUT_WORDS = {"FSDP": "dp_shard", "TP": "tp", "PP": "pp", "expert parallel": "ep"}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda path: path.stem)
def test_every_shipped_config_plans_the_layout_its_first_line_names(path):
    """Each shipped config (every family) plans on the GPUs its first line names, with that
    layout, on a host that has neither the GPUs nor the files it names (notes)."""
    first = path.read_text().splitlines()[0]
    found = re.search(r" on (\d+) GPUs \(([^)]*)\)", first)
    if found is None:
        assert "runs on CPU" in first, first
        plan = make_plan(load_config(["--job.config_file", str(path)]), 1)
        assert plan.dims.world_size == 1
        return
    world = int(found[1])
    plan = make_plan(load_config(["--job.config_file", str(path)]), world, "cuda", check_only=True)
    named = {_LAYOUT_WORDS[word]: int(n) for word, n in re.findall(r"(FSDP|TP|PP|expert parallel) (\d+)", found[2])}
    assert named and {dim: getattr(plan.dims, dim) for dim in named} == named, first
    assert plan.dims.world_size == world


def test_check_world_size_needs_check(capsys):
    assert main(["--check_world_size", "4"]) == 2
    assert capsys.readouterr().err.strip() == "error: --check_world_size needs --check"
    assert main(["--check_device", "cuda"]) == 2
    assert capsys.readouterr().err.strip() == "error: --check_device needs --check"
    assert main(["--check", "--check_device", "tpu"]) == 2
    assert capsys.readouterr().err.strip() == "error: --check_device 'tpu' is not one of cpu, cuda"


def test_check_plans_the_cluster_s_cuda_ranks_from_a_cpu_host(capsys):
    """A world size names a cluster's job: its plan is for CUDA (async TP, which needs CUDA, is
    checked from a login node); --check_device cpu plans for CPU ranks and says why it refuses."""
    argv = ["--job.config_file", str(CONFIGS / "llama3_405b.toml"), "--check", "--check_world_size", "512",
            "--parallelism.enable_async_tensor_parallel", "true", "--compile.enable", "true"]
    assert main(argv) == 0
    assert "llama3/405B on 512 cuda rank(s)" in capsys.readouterr().out
    assert main([*argv, "--check_device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: parallelism.enable_async_tensor_parallel needs CUDA") and err.count("\n") == 1
    assert main(["--check", "--check_device", "cuda", "--training.seq_len", "32"]) == 0
    assert "on 1 cuda rank(s)" in capsys.readouterr().out


def test_check_of_a_big_layout_on_one_rank_suggests_the_world_size(capsys):
    """Any degree that cannot fit one rank (a whole world's, or ep's over the FSDP ranks) gets the
    hint; a config error of another kind does not."""
    hint = "(planned for 1 rank: --check_world_size N plans the cluster's job)"
    assert main(["--job.config_file", str(CONFIGS / "llama3_70b.toml"), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: world size 1 is not divisible") and err.count("\n") == 1
    assert hint in err
    assert main(["--check", "--model.name", "deepseek_v3", "--parallelism.expert_parallel_degree", "8",
                 "--parallelism.data_parallel_shard_degree", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ep=8 must divide") and err.strip().endswith(hint)
    assert main(["--check", "--model.flavor", "nope"]) == 2
    assert hint not in capsys.readouterr().err


def test_an_output_folder_that_is_a_file_is_refused_before_training(tmp_path):
    """A run would fail there only at its first write (a trace, a checkpoint), hours in."""
    (tmp_path / "afile").write_text("")
    dump = ["--job.dump_folder", str(tmp_path)]
    for argv, key in ((["--profiling.enable_profiling", "true", "--profiling.save_traces_folder", "afile"], "profiling.save_traces_folder"),
                      (["--checkpoint.enable", "true", "--checkpoint.folder", "afile/ckpt"], "checkpoint.folder"),
                      (["--metrics.enable_tensorboard", "true", "--metrics.save_tb_folder", "afile"], "metrics.save_tb_folder")):
        with pytest.raises(ConfigError, match=f"^{re.escape(key)} .*: {re.escape(str(tmp_path / 'afile'))} is a file, not a folder$"):
            plan(1, *dump, *argv)
    plan(1, *dump, "--profiling.save_traces_folder", "afile")  # profiling off: nothing is written there


def test_a_cluster_s_gpu_only_converters_plan_from_a_cpu_host(capsys, monkeypatch):
    """MXFP8 and float8 grouped GEMMs need a GPU: a plan for CUDA ranks made here accepts them
    (the capability is the GPU's to tell), a plan for this host's CPU refuses them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU host, also where the suite has a GPU
    for converter, more in (("quantize.linear.mx", []), ("quantize.grouped_mm.float8", ["--quantize.grouped_mm.float8.fqns", "experts"])):
        argv = ["--check", "--check_world_size", "2", "--model.name", "deepseek_v3", "--model.converters", converter, *more]
        assert main(argv) == 0, capsys.readouterr().err
        assert "on 2 cuda rank(s)" in capsys.readouterr().out
        assert main([*argv, "--check_device", "cpu"]) == 2
        assert "on cpu" in capsys.readouterr().err


def test_selective_ac_every_0th_block_is_every_block_as_in_torchtitan():
    sac = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option"]
    assert [plan(1, *sac, n).checkpointing.selective_option for n in ("0", "2", "op")] == ["1", "2", "op"]


def test_check_into_a_closed_pipe_ends_quietly():
    """`--check | head -1`: the reader is gone before the plan is printed."""
    proc = subprocess.Popen([sys.executable, "-m", "tessera.trainer.main", "--check"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # long before the interpreter has imported torch and planned
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (0, "")


def test_layout_error_under_nproc_is_one_line_before_any_worker():
    argv = [sys.executable, "-m", "tessera.trainer.main", "--nproc", "4", "--parallelism.tensor_parallel_degree", "4",
            "--training.seq_len", "30"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: tensor_parallel_degree 4 does not divide seq_len=30", proc.stderr
    assert proc.stdout == ""  # no worker started, so no banner and no rank's own error


def test_a_data_error_every_rank_finds_is_one_line_from_the_launcher(tmp_path):
    """The ranks hand their error line to the launcher, which prints the first rank's once, with
    its exit status, and none of torch's own lines about the ranks it stopped."""
    short = tmp_path / "short.txt"
    short.write_text("hi\n")
    argv = [sys.executable, "-m", "tessera.trainer.main", "--nproc", "2", "--training.dataset_path", str(short),
            "--training.steps", "1", "--training.seq_len", "32", "--job.dump_folder", str(tmp_path / "dump")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: dataset {short} holds fewer tokens than one sequence (seq_len + 1 = 33)", proc.stderr


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    import tessera.trainer.train as train_module

    def broken(*args):
        raise ValueError("a bug, not bad input")

    monkeypatch.setattr(train_module, "build_parallel_model", broken)
    with pytest.raises(ValueError, match="a bug, not bad input"):
        main(["--training.steps", "1", "--job.dump_folder", str(tmp_path)])


def test_choices_come_from_the_libraries_that_implement_them():
    choices = config_module.CHOICES
    assert choices[("parallelism", "fsdp_reshard_after_forward")] is fsdp.RESHARD_POLICIES
    assert choices[("checkpoint", "async_mode")] is ckpt.ASYNC_MODES
    assert choices[("checkpoint", "export_dtype")] == tuple(ckpt.EXPORT_DTYPES)
    assert choices[("training", "mixed_precision_param")] == tuple(fsdp.MIXED_PRECISION_DTYPES)
    assert choices[("activation_checkpoint", "mode")] is models.AC_MODES


def test_pep604_optional_fields_parse(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[lr_scheduler]\ndecay_ratio = 0.5\n")
    assert load_config(["--job.config_file", str(toml)]).lr_scheduler.decay_ratio == 0.5
    assert load_config(["--lr_scheduler.decay_ratio", "null"]).lr_scheduler.decay_ratio is None
    with pytest.raises(ConfigError, match="decay_ratio: value 'x' is not a float or none"):
        load_config(["--lr_scheduler.decay_ratio", "x"])


class _NoConfig:
    """Stands in for JobPlan.config where the build and the step must not look: any read fails,
    naming what was read."""

    def __getattr__(self, name):
        raise AssertionError(f"read JobPlan.config.{name} after make_plan")


RESOLVED_LAYOUTS = {  # 2 ranks each: every parallelism, AC, accumulation, documents, MoE
    "fsdp": ["--activation_checkpoint.mode", "full", "--training.global_batch_size", "4",
             "--model.attn_mask_type", "block_causal", "--training.mixed_precision_param", "bfloat16"],
    "hsdp+selective": ["--parallelism.data_parallel_replicate_degree", "2", "--activation_checkpoint.mode", "selective"],
    "tp": ["--parallelism.tensor_parallel_degree", "2"],
    "pp": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"],
    "cp": ["--parallelism.context_parallel_degree", "2"],
    "ep": ["--model.name", "qwen3", "--model.flavor", "tiny_moe", "--parallelism.expert_parallel_degree", "2",
           "--debug.moe_force_load_balance", "true"],
}


def _step_without_config(rank, world_size):
    """One optimizer step and one evaluation of each layout, built from a plan whose config is
    gone: the build order and the step seam take every decision from the sub-plans."""
    import dataclasses

    import torch

    from tessera.mesh import build_meshes
    from tessera.trainer.family_hooks import FamilyHooks
    from tessera.trainer.optimizer import build_optimizers
    from tessera.trainer.parallelize import build_parallel_model
    from tessera.trainer.step import build_loss, make_train_step, step_functions

    losses = {}
    for name, argv in RESOLVED_LAYOUTS.items():
        full = make_plan(load_config(["--training.seq_len", "32", "--training.local_batch_size", "2", *argv]), world_size, "cpu")
        p = dataclasses.replace(full, config=_NoConfig())
        meshes = build_meshes(p.dims, "cpu")
        torch.manual_seed(0)
        loss_fn = build_loss(p)
        model = build_parallel_model(p, meshes, loss_fn)
        optimizers = build_optimizers(model.parts, p.optimizer)
        forward_backward, evaluate = step_functions(model.parts, model.pipeline, loss_fn, p, meshes, bos_id=1)
        family = FamilyHooks(p, model.parts, meshes)
        step = make_train_step(model.parts, optimizers.all, optimizers.scheduler, forward_backward, p,
                               (*p.post_optimizer_hooks, family), pp_mesh=meshes.pp)
        tokens = torch.randint(2, p.model_args.vocab_size, (p.batch.local, 33), generator=torch.Generator().manual_seed(1))
        batches = iter([(tokens[:, :-1], tokens[:, 1:])] * p.batch.accumulation)
        result = step(batches)
        losses[name] = (result.loss.item(), evaluate(tokens[:, :-1], tokens[:, 1:]).item())
    return losses


def test_build_and_step_read_only_the_resolved_plan():
    losses = run_on_ranks(_step_without_config, 2)[0]
    assert set(losses) == set(RESOLVED_LAYOUTS)
    for name, (train_loss, eval_loss) in losses.items():  # a step of random weights on random tokens: near ln(vocab)
        assert 5.0 < train_loss < 12.0 and 5.0 < eval_loss < 12.0, name


FAMILIES = {"llama3": [], "qwen3": ["--model.name", "qwen3", "--model.flavor", "tiny"],
            "qwen3_moe": ["--model.name", "qwen3", "--model.flavor", "tiny_moe"],
            "deepseek_v3": ["--model.name", "deepseek_v3", "--model.flavor", "tiny"],
            "gpt_oss": ["--model.name", "gpt_oss", "--model.flavor", "tiny"],
            "llama4": ["--model.name", "llama4", "--model.flavor", "tiny"]}
DEGREE_2 = {"fsdp": "data_parallel_shard_degree", "tp": "tensor_parallel_degree", "cp": "context_parallel_degree",
            "pp": "pipeline_parallel_degree", "ep": "expert_parallel_degree"}
# Each family x parallelism at degree 2 either runs, compared with one process by the test named,
# or is refused by the plan in the words given.
RUNS = {
    ("llama3", "fsdp"): "test_distributed_train", ("llama3", "tp"): "test_distributed_train",
    ("llama3", "cp"): "test_context_parallel_train", ("llama3", "pp"): "test_pipeline_train",
    ("qwen3", "fsdp"): "test_context_parallel_train", ("qwen3", "tp"): "test_moe_tp_train",
    ("qwen3", "cp"): "test_context_parallel_train", ("qwen3", "pp"): "test_pipeline_train",
    ("qwen3_moe", "fsdp"): "test_moe_train", ("qwen3_moe", "tp"): "test_moe_tp_train",
    ("qwen3_moe", "cp"): "test_context_parallel_train", ("qwen3_moe", "pp"): "test_moe_train",
    ("qwen3_moe", "ep"): "test_moe_train",
    ("deepseek_v3", "fsdp"): "test_moe_train", ("deepseek_v3", "tp"): "test_moe_tp_train",
    ("deepseek_v3", "pp"): "test_moe_train", ("deepseek_v3", "ep"): "test_moe_train",
    ("gpt_oss", "fsdp"): "test_moe_train", ("gpt_oss", "tp"): "test_moe_tp_train",
    ("gpt_oss", "cp"): "test_context_parallel_train", ("gpt_oss", "pp"): "test_moe_train",
    ("gpt_oss", "ep"): "test_moe_train",
    ("llama4", "fsdp"): "test_moe_train", ("llama4", "tp"): "test_moe_tp_train",
    ("llama4", "cp"): "test_context_parallel_train", ("llama4", "pp"): "test_moe_train",
    ("llama4", "ep"): "test_moe_train",
}
REFUSED = {
    ("llama3", "ep"): "llama3/debugmodel has no experts",
    ("qwen3", "ep"): "qwen3/tiny has no experts",
    ("deepseek_v3", "cp"): "context_parallel_degree > 1 is not supported yet for deepseek_v3/tiny: MLA's value heads",
}


REGISTERED = models.list_model_specs()  # at collection, before any test registers one of its own
# Registered models the table leaves out, and why.
SAME_MODEL_CODE = {"llama2": "llama3's decoder and sharding with other flavors: llama3's rows prove its layouts"}


def test_the_family_table_covers_every_family_and_parallelism():
    named = {argv[argv.index("--model.name") + 1] if argv else "llama3" for argv in FAMILIES.values()}
    assert sorted(named | set(SAME_MODEL_CODE)) == sorted(REGISTERED)
    assert sorted({**RUNS, **REFUSED}) == sorted((f, p) for f in FAMILIES for p in DEGREE_2)
    tests = Path(__file__).parent
    for (family, parallelism), test in RUNS.items():
        source = (tests / f"{test}.py").read_text()
        # the named test runs this family: its model (or flavor) is named there, llama3 being the default
        assert not FAMILIES[family] or f'"{FAMILIES[family][-1]}"' in source, (family, parallelism, test)


@pytest.mark.parametrize("family, parallelism", sorted({**RUNS, **REFUSED}), ids="-".join)
def test_every_family_and_parallelism_runs_or_is_refused_by_the_plan(family, parallelism):
    argv = [*FAMILIES[family], f"--parallelism.{DEGREE_2[parallelism]}", "2"]
    if (family, parallelism) in RUNS:
        assert getattr(plan(2, *argv).dims, "dp_shard" if parallelism == "fsdp" else parallelism) == 2
    else:
        with pytest.raises(ConfigError, match=re.escape(REFUSED[family, parallelism])):
            plan(2, *argv)


def test_a_warm_up_longer_than_the_schedule_is_shortened_and_said():
    p = plan(1, "--training.steps", "2", "--lr_scheduler.warmup_steps", "10")
    assert p.optimizer.warmup_steps == 2
    assert p.warnings == ("lr_scheduler.warmup_steps 10 exceeds the schedule's 2 steps; warming up over 2",)
    assert plan(1, "--training.steps", "20", "--lr_scheduler.warmup_steps", "10").warnings == ()
