"""The trainer's float8 converter: "float8" and "quantize.linear.float8" in model.converters swap
the debug model's linears (output excepted), train close to fp32 in one process, and FSDP 2
(with and without float8 all-gather and the scale precompute) matches the single-process float8
run; bad [float8] values end the job plan with one line."""

import pytest
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from tessera.mesh.testing import run_on_ranks
from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.converters import ModelConverter, register_converter
from tessera.trainer.float8_converter import float8_options
from tessera.trainer.plan import make_plan
from tessera.trainer.train import train

TRAINED: list[nn.Module] = []  # the model, once per optimizer step (a hook sees it)
register_converter("remember_model", lambda config, dims, device: ModelConverter(
    "remember_model", lambda model: None, post_optimizer_hooks=(TRAINED.append,),
))

# 6 steps of the debug model (dim 256: every linear a multiple of 16) on 2 x 32 tokens: enough
# for the loss to fall through the batch-to-batch noise.
BASE = ["--training.seq_len", "32", "--training.steps", "6", "--optimizer.lr", "5e-3",
        "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1"]
# The FSDP runs, equal to their reference to float rounding at every step: a step, an update (with
# the scales precomputed from it) and a step on the updated weights, as the other parity tests.
# Tensor parallel keeps the 6 steps: its tolerance bounds a drift that grows with them.
FSDP_STEPS = ["--training.steps", "2"]
FLOAT8 = ["--model.converters", "float8,remember_model", "--float8.filter_fqns", "output"]
ALL_GATHER = ["--float8.enable_fsdp_float8_all_gather", "true", "--float8.precompute_float8_dynamic_scale_for_fsdp", "true"]


def _losses(argv):
    return [h["loss"] for h in train(load_config(argv))]


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return _losses([*BASE, "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path_factory.mktemp("fp32"))])


@pytest.fixture(scope="module")
def single_tensorwise(tmp_path_factory):
    dump = tmp_path_factory.mktemp("float8")
    return _losses([*BASE, *FLOAT8, "--training.local_batch_size", "2", "--job.dump_folder", str(dump)])


def test_tensorwise_converts_all_but_output_and_tracks_fp32(fp32, single_tensorwise):
    model = TRAINED[-1]
    converted = sorted(name for name, m in model.named_modules() if isinstance(m, Float8Linear))
    assert len(converted) == 6 * 7 and "output" not in converted  # 6 blocks x (wq, wk, wv, wo, w1, w2, w3)
    print(f"tensorwise {single_tensorwise} vs fp32 {fp32}: max rel {_rel(single_tensorwise, fp32):.1e}")
    assert _rel(single_tensorwise, fp32) <= 1e-2
    assert single_tensorwise[-1] < single_tensorwise[0] - 0.2


def test_rowwise_under_its_torchtitan_0_2_name_tracks_fp32(tmp_path, fp32):
    toml = tmp_path / "rowwise.toml"
    toml.write_text('[model]\nconverters = ["quantize.linear.float8"]\n\n[quantize.linear.float8]\nrecipe_name = "rowwise"\n')
    losses = _losses([*BASE, "--job.config_file", str(toml), "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path)])
    print(f"rowwise {losses} vs fp32 {fp32}: max rel {_rel(losses, fp32):.1e}")
    assert _rel(losses, fp32) <= 1e-2
    assert losses[-1] < losses[0] - 0.2


def _fsdp_runs(rank, world_size, dump):
    return {
        "plain": _losses([*BASE, *FSDP_STEPS, *FLOAT8, "--training.local_batch_size", "1",
                          "--job.dump_folder", f"{dump}/plain"]),
        "all_gather": _losses([*BASE, *FSDP_STEPS, *FLOAT8, *ALL_GATHER, "--training.local_batch_size", "1",
                               "--job.dump_folder", f"{dump}/all_gather"]),
        # the output projection float8 too: its FSDP group all-gathers float8 alone, which gloo
        # carries as bytes (tessera.fsdp)
        **{name: _losses([*BASE, *FSDP_STEPS, *FLOAT8, "--float8.filter_fqns", "tok_embeddings", *extra,
                          "--training.local_batch_size", "1", "--job.dump_folder", f"{dump}/{name}"])
           for name, extra in (("output plain", []), ("output all_gather", ALL_GATHER))},
        # float8 TP styles where gloo can carry them (see tessera.float8.tp_styles), plain ones else
        "tp2": _losses([*BASE, *FLOAT8, "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                        "1", "--training.local_batch_size", "2", "--job.dump_folder", f"{dump}/tp2"]),
    }


def test_fsdp2_and_tp2_match_single_process_float8(tmp_path, single_tensorwise):
    """Tensorwise float8 scales each activation by its own amax: an FSDP rank's over its own
    sequence, so the reference accumulates one-sequence micro-batches (the same scales, to float
    rounding); tensor parallel's rowwise inputs take each rank's hidden-dim shard's amax, so it
    is close to the two-sequence run, not equal."""
    accumulated = _losses([*BASE, *FSDP_STEPS, *FLOAT8, "--training.local_batch_size", "1",
                           "--training.global_batch_size", "2", "--job.dump_folder", str(tmp_path / "accumulated")])
    runs = run_on_ranks(_fsdp_runs, 2, str(tmp_path))[0]
    for name, reference, tolerance in (("plain", accumulated, 1e-5), ("all_gather", accumulated, 1e-5),
                                       ("tp2", single_tensorwise, 1e-3)):
        print(f"{name} {runs[name]} vs {reference}: max rel {_rel(runs[name], reference):.1e}")
        assert len(runs[name]) == len(reference), name
        assert _rel(runs[name], reference) <= tolerance
    assert _rel(runs["output all_gather"], runs["output plain"]) <= 1e-5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--float8.recipe_name", "blockwise"], r"config section \[float8\]: float8 recipe_name 'blockwise' is not one of"),
        (["--float8.recipe_name", "rowwise", *ALL_GATHER],
         r"\[float8\]: float8 enable_fsdp_float8_all_gather needs recipe_name 'tensorwise', not 'rowwise'"),
    ],
)
def test_bad_float8_keys_end_the_plan_with_one_line(argv, message):
    with pytest.raises(ConfigError, match=message) as error:
        make_plan(load_config([*FLOAT8, *argv]), world_size=2, device="cpu")
    assert "\n" not in str(error.value)


def test_torchtitan_auto_filter_flag_and_fsdp_only_switches():
    config = load_config([*FLOAT8, "--float8.filter_fqns", "output,auto_filter_small_kn", *ALL_GATHER])
    fsdp2 = make_plan(config, world_size=2, device="cpu").dims
    options = float8_options(config, fsdp2, "cpu")
    assert options.auto_filter_small_kn and options.filter_fqns == ("output",)
    assert options.enable_fsdp_float8_all_gather and options.precompute_float8_dynamic_scale_for_fsdp
    single = float8_options(config, make_plan(config, world_size=1, device="cpu").dims, "cpu")
    assert not single.enable_fsdp_float8_all_gather and not single.precompute_float8_dynamic_scale_for_fsdp


def test_a_section_its_converter_does_not_read_gets_a_warning(capsys):
    # torchtitan's configs carry [quantize.linear.float8] whether or not the converter runs
    config = load_config(["--model.converters", "float8", "--float8.recipe_name", "tensorwise",
                          "--quantize.linear.float8.recipe_name", "rowwise"])
    assert ("config section [quantize.linear.float8] has no effect: model.converters does not list "
            "'quantize.linear.float8'") in make_plan(config, world_size=1, device="cpu").warnings
    # said with the plan, not while the config loads: a later error stays one line
    with pytest.raises(ConfigError, match="^tensor_parallel_degree 3 does not divide n_heads=16$"):
        make_plan(load_config(["--quantize.linear.float8.recipe_name", "rowwise",
                               "--parallelism.tensor_parallel_degree", "3"]), world_size=3, device="cpu")
    assert capsys.readouterr().err == ""


def test_float8_with_its_table_unset_reads_torchtitan_0_2_s():
    """torchtitan 0.2.2's llama3_405b.toml lists "float8" and sets [quantize.linear.float8]: the
    output stays in bf16 and FSDP gathers in float8, as it says."""
    config = load_config(["--model.converters", "float8", "--quantize.linear.float8.filter_fqns", "output", *[
        arg.replace("--float8.", "--quantize.linear.float8.") for arg in ALL_GATHER]])
    plan = make_plan(config, world_size=2, device="cpu")
    assert any(w.startswith("model.converters 'float8' reads [quantize.linear.float8]") for w in plan.warnings)
    options = float8_options(config, plan.dims, "cpu")
    assert options.filter_fqns == ("output",) and options.enable_fsdp_float8_all_gather


def test_mxfp8_emulated_converts_and_tracks_fp32(tmp_path, fp32):
    losses = _losses([*BASE, "--model.converters", "quantize.linear.mx,remember_model",
                      "--quantize.linear.mx.recipe_name", "mxfp8_emulated_rceil",
                      "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path)])
    # torchao wraps the weights in its MX training tensor subclass, not the modules
    wrapped = [name for name, m in TRAINED[-1].named_modules()
               if isinstance(m, nn.Linear) and type(m.weight) is not nn.Parameter]
    print(f"mxfp8 emulated {losses} vs fp32 {fp32}: max rel {_rel(losses, fp32):.1e}")
    assert _rel(losses, fp32) <= 1e-2 and losses[-1] < losses[0] - 0.2
    assert len(wrapped) == 6 * 7 and "output" not in wrapped


def test_mx_recipes_that_need_a_blackwell_gpu_are_refused_on_cpu():
    with pytest.raises(ConfigError, match=r"\[quantize.linear.mx\]: mx recipe_name 'mxfp8_rceil' needs torchao's triton kernels"):
        make_plan(load_config(["--model.converters", "quantize.linear.mx"]), world_size=1, device="cpu")


MOE_MX = ["--model.name", "deepseek_v3", "--model.flavor", "tiny", "--model.converters", "quantize.grouped_mm.mx",
          "--quantize.grouped_mm.mx.fqns", "experts", "--quantize.grouped_mm.mx.recipe_name", "mxfp8_emulated_rceil",
          "--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16"]


@pytest.mark.parametrize(
    "argv, world_size, message",
    [
        (["--model.converters", "quantize.grouped_mm.float8", "--quantize.grouped_mm.float8.fqns", "experts"], 1,
         r"config section \[quantize.grouped_mm.float8\]: float8 grouped GEMMs \(torch._scaled_grouped_mm, torchao's triton "
         r"casts\) need a CUDA GPU of compute capability >= 9.0 and have no emulated mode; on cpu the MXFP8 recipe"),
        (["--quantize.grouped_mm.mx.recipe_name", "mxfp8"], 1,
         r"\[quantize.grouped_mm.mx\]: mx recipe_name 'mxfp8_rceil' needs torchao's triton kernels on a CUDA GPU"),
        (["--quantize.grouped_mm.mx.fqns", ""], 1, r"\[quantize.grouped_mm.mx\]: grouped_mm fqns is empty"),
        (["--training.dtype", "float32"], 1, r"quantize.grouped_mm.mx needs bfloat16 experts for torch's grouped GEMMs: "
                                             r"set training.dtype bfloat16$"),
        (["--training.mixed_precision_param", "float32", "--parallelism.data_parallel_shard_degree", "2"], 2,
         r"set training.mixed_precision_param bfloat16 \(FSDP computes in it\)"),
        (["--parallelism.tensor_parallel_degree", "2"], 2,
         r"quantize.grouped_mm.mx with parallelism.tensor_parallel_degree 2 is not supported yet"),
        (["--parallelism.pipeline_parallel_degree", "2"], 2,
         r"quantize.grouped_mm.mx with parallelism.pipeline_parallel_degree 2 is not supported yet"),
        (["--compile.enable", "true"], 1, r"quantize.grouped_mm.mx with compile.enable \(model\) is not supported yet"),
    ],
)
def test_grouped_mm_converters_refuse_what_they_cannot_run_in_the_plan(argv, world_size, message):
    with pytest.raises(ConfigError, match=message) as error:
        make_plan(load_config([*MOE_MX, *argv]), world_size=world_size, device="cpu")
    assert "\n" not in str(error.value)
