"""metrics.enable_wandb: the W&B run gets what TensorBoard gets (the same tags, Tessera's and
torchtitan's, at the same steps, validation included), offline where nothing configures W&B, its
files under the run's metrics folder as torchtitan puts them; it ends with the training and leaves
no wandb process behind; without the package the plan says how to get it."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tessera.trainer import train as train_module
from tessera.trainer import wandb_logger
from tessera.trainer.config import load_config
from tessera.trainer.metrics import TORCHTITAN_TAGS
from tessera.trainer.train import train
from tessera.trainer.wandb_logger import read_run, run_records

SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
         "--lr_scheduler.warmup_steps", "2"]


def _wandb_children() -> list[str]:
    """This process's wandb-core service processes (a zombie is one not waited for, so it counts)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended meanwhile
            continue
        name, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if name == "wandb-core" and int(fields[1]) == os.getpid():
            found.append(stat.parent.name)
    return found


def _ended(dump: Path) -> tuple[Path, int]:
    """The run's W&B folder and exit code, once no wandb process of this one is left."""
    deadline = time.monotonic() + 5
    while _wandb_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _wandb_children()
    (log,) = dump.glob("tb/*/wandb/*run-*/run-*.wandb")  # not latest-run, a link to it
    (exit_code,) = [r.exit.exit_code for r in run_records(log.parent) if r.WhichOneof("record_type") == "exit"]
    return log.parent, exit_code


@pytest.fixture
def fresh_host(tmp_path, monkeypatch):
    """No WANDB_* variable and no login (an absent netrc file), as on a new cluster node; wandb's own
    folders in tmp. wandb's settings, loaded once a process, are dropped afterwards."""
    import wandb

    for name in [name for name in os.environ if name.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    for name, folder in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / folder))
    yield
    wandb.teardown()


def test_wandb_run_holds_the_console_losses_and_tensorboard_s_scalars(tmp_path, fresh_host, capsys):
    dump = tmp_path / "dump"
    train(load_config([*SMALL, "--job.dump_folder", str(dump), "--training.steps", "3",
                       "--metrics.enable_tensorboard", "true", "--metrics.enable_wandb", "true",
                       "--validation.enable", "true", "--validation.steps", "1", "--validation.freq", "2"]))
    run_folder, exit_code = _ended(dump)
    # torchtitan's layout: dump/save_tb_folder/<start time>/wandb/<run>, offline as nothing said otherwise
    metrics_folder = run_folder.parent.parent
    assert run_folder.name.startswith("offline-run-") and metrics_folder.parent == dump / "tb" and exit_code == 0
    (run,) = [r.run for r in run_records(run_folder) if r.WhichOneof("record_type") == "run"]
    config = {item.key: item.value_json for item in run.config.update}
    assert run.project == "torchtitan" and '"steps":3' in config["training"]

    scalars = read_run(run_folder)
    out = capsys.readouterr().out
    console = dict(re.findall(r"^step +(\d)/3 +loss +([\d.]+)", out, re.M))
    assert {str(step): f"{loss:.4f}" for step, loss in scalars["loss"].items()} == console and len(console) == 3
    assert sorted(scalars["validation_metrics/loss"]) == [1, 2]
    for name, torchtitan_name in TORCHTITAN_TAGS.items():
        assert scalars.get(torchtitan_name) == scalars.get(name), name  # the CUDA memory tags: neither here

    events = EventAccumulator(str(metrics_folder), size_guidance={"scalars": 0})
    events.Reload()
    tensorboard = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    assert sorted(tensorboard) == sorted(scalars)
    for tag, values in tensorboard.items():
        assert scalars[tag] == pytest.approx(values, rel=1e-6), tag  # TensorBoard keeps float32


@pytest.mark.parametrize("setting", ["none", "WANDB_MODE", "WANDB_API_KEY", "netrc"])
def test_offline_only_where_nothing_says_how_to_reach_wandb(tmp_path, fresh_host, monkeypatch, setting):
    from urllib.parse import urlsplit

    from wandb.sdk import wandb_setup

    if setting in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.setenv(setting, "online" if setting == "WANDB_MODE" else "k" * 40)
    if setting == "netrc":  # what `wandb login` writes
        host = urlsplit(wandb_setup.singleton().settings.base_url).netloc
        (tmp_path / "netrc").write_text(f"machine {host}\n  login user\n  password {'k' * 40}\n")
    assert wandb_logger._mode() == ("offline" if setting == "none" else None)


def test_a_run_that_fails_ends_its_wandb_run_as_failed(tmp_path, fresh_host, monkeypatch):
    def fail_at_step_2(step, *args):
        if step == 2:
            raise RuntimeError("injected")

    monkeypatch.setattr(train_module, "collect_garbage", fail_at_step_2)
    with pytest.raises(RuntimeError, match="injected"):
        train(load_config([*SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "3", "--metrics.enable_wandb", "true"]))
    run_folder, exit_code = _ended(tmp_path)
    assert exit_code == 1 and sorted(read_run(run_folder)["loss"]) == [1]


def test_without_the_package_the_plan_says_pip_install_wandb():
    """In a process where `import wandb` fails: --check notes it, a run is refused in one line, exit 2,
    and without enable_wandb the trainer plans as ever."""
    script = ("import sys; sys.modules['wandb'] = None\n"
              "from tessera.trainer.main import main\n"
              "assert main(['--check']) == 0\n"
              "assert main(['--check', '--metrics.enable_wandb', 'true']) == 0\n"
              "sys.exit(main(['--metrics.enable_wandb', 'true']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    message = "metrics.enable_wandb needs the wandb package, which is not installed: pip install wandb"
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"error: {message}\n"
    assert f"note        {message}" in done.stdout
