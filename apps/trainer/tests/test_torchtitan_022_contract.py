"""torchtitan 0.2.2's keys keep its meanings where its shipped train_configs and its own code
read them: what test_torchtitan_config does not already hold."""

import pytest

from tessera.trainer.check import describe
from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.plan import make_plan

# torchtitan/models/llama3_ft/train_configs/debug_model.toml's own keys: its [job] names the
# fault-tolerance extension whose [fault_tolerance] keys follow
LLAMA3_FT = """\
[job]
custom_config_module = "torchtitan.components.ft.config"

[fault_tolerance]
enable = true
sync_steps = 10
num_fragments = 2
semi_sync_method = "diloco"
process_group = "nccl"
process_group_timeout_ms = 10000
"""


def test_the_fault_tolerance_extension_s_keys_are_built_in(tmp_path):
    toml = tmp_path / "ft.toml"
    toml.write_text(LLAMA3_FT)
    ft = load_config(["--job.config_file", str(toml)]).fault_tolerance
    assert (ft.enable, ft.sync_steps, ft.num_fragments, ft.semi_sync_method) == (True, 10, 2, "diloco")
    with pytest.raises(ConfigError, match="^config key job.custom_config_module = 'my.config': Tessera's config schema"):
        load_config(["--job.config_file", str(toml), "--job.custom_config_module", "my.config"])


def test_llama3_ft_is_llama3():
    """torchtitan's fault-tolerant Llama 3 (its FT launches name it) is its llama3 with DiLoCo's
    fragments, which Tessera's fault tolerance cuts for any model."""
    config = load_config(["--model.name", "llama3_ft"])
    assert config.model.name == "llama3"
    assert make_plan(config, 1, "cpu").spec.name == "llama3"


def test_semi_sync_method_is_matched_as_torchtitan_matches_it():
    """torchtitan's FT manager lower-cases it ("DiLoCo", as the paper writes it)."""
    assert load_config(["--fault_tolerance.semi_sync_method", "DiLoCo"]).fault_tolerance.semi_sync_method == "diloco"
    with pytest.raises(ConfigError, match="semi_sync_method: 'streaming' is not one of"):
        load_config(["--fault_tolerance.semi_sync_method", "streaming"])


def test_expert_parallel_overlap_off_is_what_tessera_runs():
    """Tessera runs the all-to-alls in line under every schedule: false asks for just that."""
    config = load_config(["--parallelism.pipeline_parallel_expert_parallel_overlap", "false"])
    assert config.parallelism.pipeline_parallel_expert_parallel_overlap is False


def test_a_global_batch_of_zero_is_refused_as_torchtitan_refuses_it():
    with pytest.raises(ConfigError, match=r"^config key training.global_batch_size: 0 .* -1"):
        load_config(["--training.global_batch_size", "0"])
    assert make_plan(load_config(["--training.global_batch_size", "-2"]), 1, "cpu").batch.global_size == 8


@pytest.mark.parametrize("ratio, decay", [("0.8", 8), ("0.5", 5), ("none", 8)])
def test_check_states_the_decay_that_decay_ratio_gives(ratio, decay):
    """torchtitan's debug configs: 10 steps, 2 of warm-up, decay_ratio 0.8 decays over the last 8."""
    config = load_config(["--training.steps", "10", "--lr_scheduler.warmup_steps", "2",
                          "--lr_scheduler.decay_ratio", ratio])
    assert f"2 warm-up steps, linear decay over the last {decay} of 10 steps" in describe(make_plan(config, 1, "cpu"))


@pytest.mark.parametrize("name, flavor, base", [("llama3", "debugmodel_flex_attn", "debugmodel"),
                                                ("llama3", "8B_varlen", "8B"),
                                                ("deepseek_v3", "debugmodel_flex_attn", "debugmodel")])
def test_torchtitan_s_kernel_flavors_say_what_they_are_here(name, flavor, base):
    """Tessera's plan picks the attention kernel, so these torchtitan flavors are not its own."""
    config = load_config(["--model.name", name, "--model.flavor", flavor])
    with pytest.raises(ConfigError, match=f"^model.flavor '{flavor}' is not a flavor of {name}; torchtitan's {flavor} "
                                          f"is {base} with model.attn_mask_type = 'block_causal'"):
        make_plan(config, 1, "cpu")
    assert make_plan(load_config(["--model.name", name, "--model.flavor", base, "--model.attn_mask_type", "block_causal"]),
                     1, "cpu").attention
