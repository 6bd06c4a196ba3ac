"""compare against runs written by TensorBoard's and wandb's own writers: the table's differences
are the values' (computed here from what was logged), the PNG is written, torchtitan's tag names
are read as Tessera's, a W&B offline run reads as a TensorBoard one, and bad input is one line with
exit 2."""

import math

import pytest
from torch.utils.tensorboard import SummaryWriter

import compare

LOSSES = {"a": [8.0, 7.5, 7.0, 6.8], "b": [8.0, 7.4, 7.2, 6.5]}


def _run(folder, losses, tags=("loss", "tokens_seen")):
    writer = SummaryWriter(log_dir=str(folder / "tb" / "20261204-000000"))
    for step, loss in enumerate(losses, start=1):
        writer.add_scalar(tags[0], loss, step)
        writer.add_scalar(tags[1], 64 * step, step)
        writer.add_scalar("grad_norm", 1.0 / step, step)
    writer.close()
    return folder


def test_table_and_png_of_two_runs_one_in_torchtitan_s_tags(tmp_path, capsys):
    a = _run(tmp_path / "a", LOSSES["a"])
    b = _run(tmp_path / "b", LOSSES["b"], tags=("loss_metrics/global_avg_loss", "n_tokens_seen"))
    out = tmp_path / "loss.png"
    assert compare.main([str(a), str(b), "--scalar", "loss", "--scalar", "grad_norm", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    loss_table, grad_norm_table = text.split("grad_norm:")
    rows = {line.split()[0]: line.split()[1:] for line in loss_table.splitlines() if line.startswith("  ") and "steps" not in line}
    diffs = [abs(x - y) for x, y in zip(LOSSES["a"], LOSSES["b"])]
    steps, last, lowest, max_diff, mean_diff = rows["b"]
    assert (int(steps), float(last), float(lowest)) == (4, 6.5, 6.5)
    assert float(max_diff) == pytest.approx(max(diffs), rel=1e-5) and float(mean_diff) == pytest.approx(sum(diffs) / 4, rel=1e-5)
    assert rows["a"][3:] == ["0", "0"]  # the first run against itself
    assert "b" in grad_norm_table
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_a_wandb_offline_run_reads_as_what_was_logged(tmp_path, monkeypatch, capsys):
    """Long enough for records to span the log's 32 KiB blocks; compared with a TensorBoard run."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name))
    losses = [8.0 - step / 1000 for step in range(1, 801)]
    run = wandb.init(project="compare-test", dir=tmp_path / "wandb_run" / "tb" / "20261204-000000")
    for step, loss in enumerate(losses, start=1):
        run.log({"loss_metrics/global_avg_loss": loss, "n_tokens_seen": 64 * step, "note": "text"}, step=step)
    run.finish()
    wandb.teardown()
    (log,) = (tmp_path / "wandb_run").rglob("run-*.wandb")
    assert log.stat().st_size > 3 * 32 * 1024
    scalars = compare.run_scalars(tmp_path / "wandb_run")
    assert scalars == {"loss_metrics/global_avg_loss": dict(enumerate(losses, start=1)),
                       "n_tokens_seen": {step: 64.0 * step for step in range(1, 801)}}
    tensorboard = _run(tmp_path / "tensorboard", losses[:4])
    assert compare.main([str(tensorboard), str(log.parent), "--names", "tb,wandb", "--out", str(tmp_path / "x.png")]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert rows["wandb"][:3] == ["800", "7.2", "7.2"] and float(rows["wandb"][3]) < 1e-6  # float32 in TensorBoard


def test_the_newest_of_several_runs_is_read_and_named(tmp_path, capsys):
    _run(tmp_path / "dump", [9.0, 9.0])
    newest = SummaryWriter(log_dir=str(tmp_path / "dump" / "tb" / "20261204-000100"))
    newest.add_scalar("loss", 1.0, 1)
    newest.close()
    assert compare.main([str(tmp_path / "dump"), "--out", str(tmp_path / "x.png")]) == 0
    out = capsys.readouterr().out
    assert "2 TensorBoard runs below it; reading the newest" in out and "20261204-000100" in out
    assert math.isclose(float(next(l for l in out.splitlines() if l.startswith("  dump")).split()[2]), 1.0)


@pytest.mark.parametrize("argv, message", [
    (["{tmp}/missing"], "missing: no such run folder"),
    (["{tmp}"], "no TensorBoard event files or W&B runs below it (was metrics.enable_tensorboard or "
                "metrics.enable_wandb on?)"),
    (["{run}", "--scalar", "los"], "no scalar 'los' (it logs grad_norm, loss, tokens_seen)"),
    (["{run}", "{run}", "--names", "one"], "--names gives 1 names for 2 runs"),
    (["{tmp}/missing", "--out", "x.xyz"], "--out x.xyz: its suffix must name an image format, one of "),  # before any run is read
    (["{run}", "--out", "{tmp}/compare"], "empty/compare: its suffix must name an image format, one of "),  # matplotlib would add .png
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    run = _run(tmp_path / "run", [1.0])
    (tmp_path / "empty").mkdir()
    argv = [arg.format(tmp=tmp_path / "empty", run=run) for arg in argv]
    assert compare.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("compare: error: ") and message in err and err.count("\n") == 1


def test_an_out_format_needing_a_missing_program_is_one_line_and_no_file(tmp_path, monkeypatch, capsys):
    """.pgf: matplotlib runs xelatex (here off PATH) to typeset the text; it was a RuntimeError
    traceback after every run was read, leaving a partial file."""
    run = _run(tmp_path / "run", [1.0])
    monkeypatch.setenv("PATH", str(tmp_path / "no-programs"))
    out = tmp_path / "loss.pgf"
    assert compare.main([str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"compare: error: --out {out}: matplotlib cannot write PGF code for LaTeX here: 'xelatex' "
                          "not found") and err.count("\n") == 1, err
    assert not out.exists()
