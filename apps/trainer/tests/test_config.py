import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.trainer.cli_info import help_text
from tessera.trainer.config import ConfigError, JobConfig, idle_options, load_config, parse_overrides
from tessera.trainer.main import main
from tessera.trainer.schema import check_declared, declared, get_key, key, table

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_defaults_train_the_debug_model():
    config = load_config([])
    assert (config.model.name, config.model.flavor) == ("llama3", "debugmodel")
    assert config.training.dataset == "default" and config.model.tokenizer_path == ""


@pytest.mark.parametrize("name", ["debug_model.toml", "llama3_8b.toml", "llama3_70b.toml", "llama3_405b.toml"])
def test_shipped_configs_parse(name):
    config = load_config(["--job.config_file", str(CONFIGS / name)])
    assert config.model.name == "llama3"


def test_toml_then_cli_overrides(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text('[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1\n[checkpoint]\nexclude_from_loading = ["dataloader"]\n')
    config = load_config([
        "--job.config_file", str(toml), "--training.steps", "9", "--metrics.log_freq=3",
        "--lr_scheduler.decay_ratio", "none", "--parallelism.disable_loss_parallel", "true",
        "--compile.components", "model, loss",
    ])
    assert config.training.steps == 9  # CLI wins over the file
    assert config.training.seq_len == 64
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
    assert config.metrics.log_freq == 3
    assert config.lr_scheduler.decay_ratio is None
    assert config.parallelism.disable_loss_parallel is True
    assert config.compile.components == ["model", "loss"]
    assert config.checkpoint.exclude_from_loading == ["dataloader"]


def test_relative_paths_resolve_against_the_users_directory(tmp_path, monkeypatch):
    (tmp_path / "c.toml").write_text('[training]\ndataset_path = "data/x.txt"\n')
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    config = load_config(["--job.config_file", "c.toml", "--job.dump_folder", "out"])
    assert config.training.dataset_path == str(tmp_path / "data/x.txt")
    assert config.job.dump_folder == str(tmp_path / "out")
    assert config.job.config_file == str(tmp_path / "c.toml")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trainig.steps", "3"], r"unknown config section \[trainig\]; did you mean 'training'\?"),
        (["--training.step", "3"], r"unknown config key training.step; did you mean 'steps'\?"),
        (["--training.steps", "abc"], r"config key training.steps: value 'abc' is not an int"),
        (["--optimizer.lr", "fast"], r"config key optimizer.lr: value 'fast' is not a float"),
        (["--metrics.enable_tensorboard", "maybe"], r"metrics.enable_tensorboard: value 'maybe' is not a bool"),
        (["--training.steps"], r"option --training.steps needs a value"),
        (["--compile.no_bogus"], r"^unknown config key compile.no_bogus$"),  # not "needs a value"
        (["--training.dataset_mixture", "a=b"], r"dataset mixture entry 'a=b': weight 'b' must be"),  # as written, unresolved
        (["steps=3"], r"unexpected argument 'steps=3'"),
        (["--steps", "3"], r"must look like --section.key"),
        (["--lr_scheduler.decay_type", "cosin"], r"lr_scheduler.decay_type: 'cosin' is not one of"),
        (["--training.steps", "0"], r"training.steps: 0 must be >= 1"),
        (["--training.mixed_precision_param", "fp8"], r"mixed_precision_param: 'fp8' is not one of"),
        (["--lr_scheduler.decay_ratio", "1.5"], r"decay_ratio: 1.5 must be within \[0, 1\]"),
        (["--job.config_file", "/nonexistent/x.toml"], r"config file not found: /nonexistent/x.toml"),
        (["--model.converters", "fp4"], r"model.converters: \['fp4'\] not registered"),
        (["--training.max_norm", "0"], r"training.max_norm: 0.0 must be > 0"),
        (["--validation.steps", "0"], r"validation.steps: 0 must be >= 1 or -1"),
        (["--compile.components", "modle"], r"compile.components: \['modle'\] not in"),
    ],
)
def test_errors_name_the_culprit(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(argv)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[training]\nsteps = 'ten'\n", r"training.steps: value 'ten' is not an int"),
        ("[training]\nstepz = 1\n", r"unknown config key training.stepz; did you mean 'steps'"),
        ("[modle]\nname = 'x'\n", r"unknown config section \[modle\]; did you mean 'model'"),
        ("[training\n", r"is not valid TOML"),
        ("steps = 3\n", r"'steps' must be a \[section\] table"),
        ("[checkpoint]\nexclude_from_loading = 'model'\n", r"exclude_from_loading: value 'model' is not a list of strings"),
        ("[metrics]\nenable_tensorboard = 1\n", r"enable_tensorboard: value 1 is not a bool"),
        # torchtitan's flux config: its model, not its first key of its own, is what Tessera lacks
        ("[model]\nname = 'flux'\n[training]\nclassifier_free_guidance_prob = 0.1\n",
         r"bad.toml: unknown model 'flux'; registered: \['deepseek_v3', "),
        ("[model]\nname = 'llama3'\n[training]\nclassifier_free_guidance_prob = 0.1\n",
         r"^unknown config key training.classifier_free_guidance_prob$"),
    ],
)
def test_toml_errors(tmp_path, text, message):
    toml = tmp_path / "bad.toml"
    toml.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(["--job.config_file", str(toml)])


def test_every_section_has_defaults():
    sections = {"job", "model", "optimizer", "lr_scheduler", "training", "loss", "parallelism", "checkpoint",
                "activation_checkpoint", "compile", "float8", "quantize", "metrics", "profiling", "comm",
                "memory_estimation", "fault_tolerance", "validation", "experimental", "debug"}
    assert set(vars(JobConfig())) == sections


def test_parse_overrides_keeps_order():
    assert parse_overrides(["--a.b", "1", "--a.b=2"]) == [("a", "b", "1"), ("a", "b", "2")]


def test_torchtitan_command_line_spellings():
    """tyro's, as torchtitan's docs write them: a bool key alone is true, its no_ (or no-) form
    false, hyphens stand for underscores; other keys still need a value."""
    config = load_config(["--checkpoint.enable", "--compile.no-enable", "--training.local-batch-size", "3",
                          "--metrics.enable_tensorboard", "--activation_checkpoint.no_preserve_rng_state"])
    assert (config.checkpoint.enable, config.compile.enable, config.training.local_batch_size) == (True, False, 3)
    assert config.metrics.enable_tensorboard and not config.activation_checkpoint.preserve_rng_state
    assert parse_overrides(["--checkpoint.enable", "false", "--job.config-file", "x.toml"]) == [
        ("checkpoint", "enable", "false"), ("job", "config_file", "x.toml")]
    for argv, message in ((["--checkpoint.no_enable=true"], "takes no value: it sets checkpoint.enable false"),
                          (["--checkpoint.no_folder", "x"], "unknown config key checkpoint.no_folder"),  # not a bool
                          (["--checkpoint.folder", "--checkpoint.enable"], "needs a value, got the option")):
        with pytest.raises(ConfigError, match=message):
            load_config(argv)


def test_every_key_declares_a_help_line():
    keys = declared(JobConfig)
    assert len(keys) > 150 and all(facts.help and "\n" not in facts.help for facts in keys.values())

    @dataclasses.dataclass
    class Undeclared:
        plain: int = 0

    with pytest.raises(TypeError, match="config key plain is not declared"):
        declared(Undeclared)


@dataclasses.dataclass
class _Section:
    size: int = key(1, "a size", bound=">= 1")
    kind: str = key("a", "a kind", choices=("a", "b"))
    kinds: list[str] = key([], "kinds", choices=("a", "b"))
    legacy: bool = key(False, "an old switch", refused="gone")


@dataclasses.dataclass
class _Config:
    section: _Section = table(_Section)


@pytest.mark.parametrize("name, value, message", [
    ("size", 0, "^config key section.size: 0 must be >= 1$"),
    ("kind", "c", r"^config key section.kind: 'c' is not one of \['a', 'b'\]$"),
    ("kinds", ["a", "c"], r"^config key section.kinds: \['c'\] not in \['a', 'b'\]$"),
    ("legacy", True, "^config key section.legacy = True: gone$"),
])
def test_the_declarations_drive_validation(name, value, message):
    config = _Config()
    setattr(config.section, name, value)
    with pytest.raises(ConfigError, match=message):
        check_declared(config)
    if name == "legacy":  # a caller implementing a refused key accepts it
        check_declared(config, accepted=frozenset({"section.legacy"}))


_OUTSIDE = {">= 1": "0", ">= 0": "-1", "> 0": "0", "within [0, 1]": "1.5"}  # a value outside each of schema.BOUNDS


@pytest.mark.parametrize("name", [name for name, facts in declared(JobConfig).items() if facts.bound])
def test_every_declared_bound_is_enforced(name):
    bound = declared(JobConfig)[name].bound
    with pytest.raises(ConfigError, match=f"^config key {name}: .*must be {re.escape(bound)}$"):
        load_config([f"--{name}", _OUTSIDE[bound]])


@pytest.mark.parametrize("name", [name for name, facts in declared(JobConfig).items() if facts.choices])
def test_every_declared_choice_rejects_a_typo(name):
    with pytest.raises(ConfigError, match=f"^config key {name}"):
        load_config([f"--{name}", "typo"])


_SWITCHED = {name: facts.needs for name, facts in declared(JobConfig).items() if facts.needs}


@pytest.mark.parametrize("name", sorted(_SWITCHED))
def test_help_marks_a_key_that_acts_only_with_its_switch(name):
    """The switch is a bool key; the mark is on the key's help line and on no switch's own."""
    assert isinstance(get_key(JobConfig(), _SWITCHED[name]), bool) and _SWITCHED[name] not in _SWITCHED
    line = next(line for line in help_text(name.split(".")[0]).splitlines() if line.startswith(f"  --{name} "))
    assert line.endswith(f" [only with {_SWITCHED[name]}]")


def _typed(value) -> str:
    """A value as the command line spells it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


@pytest.mark.parametrize("name", sorted(_SWITCHED))
def test_a_typed_key_its_switch_leaves_idle_is_a_warning(name, tmp_path):
    """Typed with its switch off (even at its default), a key is named; with the switch on, or set
    only in a config file (torchtitan's carry such keys), it is not."""
    argv = [f"--{name}", _typed(get_key(JobConfig(), name))]
    config = load_config(argv)
    assert idle_options(config, argv) == [f"--{name} has no effect: {_SWITCHED[name]} is false"]
    default, (section, _, key_name) = get_key(JobConfig(), name), name.partition(".")
    if default is not None:  # (TOML has no None)
        (tmp_path / "job.toml").write_text(f"[{section}]\n{key_name} = {json.dumps(default)}\n")
        from_file = ["--job.config_file", str(tmp_path / "job.toml")]
        assert idle_options(load_config(from_file), from_file) == []
    owner, _, switch = _SWITCHED[name].rpartition(".")
    setattr(get_key(config, owner), switch, True)
    assert idle_options(config, argv) == []


def test_the_idle_option_warning_follows_the_plan(capsys, tmp_path):
    """--check lists it with the plan's warnings; a later error is still the only line on stderr."""
    assert main(["--check", "--checkpoint.interval", "5"]) == 0
    assert "  warning     --checkpoint.interval has no effect: checkpoint.enable is false" in capsys.readouterr().out.splitlines()
    assert main(["--checkpoint.interval", "5", "--parallelism.tensor_parallel_degree", "3",
                 "--job.dump_folder", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: world size 1 is not divisible by dp_replicate*cp*tp*pp = 1*1*3*1 = 3, so dp_shard=-1 cannot fill the rest"]


def test_the_float8_converters_do_not_import_the_config():
    """The config imports the converters' sections; the converters import neither it nor torchao."""
    code = ("import sys, tessera.trainer.float8_converter; "
            "print(sorted(m for m in ('tessera.trainer.config', 'torchao') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "[]"
