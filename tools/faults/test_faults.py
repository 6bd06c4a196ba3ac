"""The fault suite's one-process faults (SIGKILL at a step and mid-save, sync and async; SIGTERM;
a full disk and a read-only one, on a real tmpfs where this process may mount one; NaN), and one
fault each on pipeline, context and expert parallel runs, all end as they must: no data lost,
exact resumes, a diverged run stopped; and a killed rank recovered by torchft's replica groups
beside a checkpoint restart."""

import re
import types
from pathlib import Path

import pytest

import faults
import recovery


def test_single_process_faults_lose_nothing(capsys):
    code = faults.main(["--only", "single", "--steps", "6"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = re.search(r"^(\d+) faults injected, (\d+) survived, 0 checkpoints lost$", out, re.M)
    tmpfs = "disk faults on a real tmpfs skipped" not in out
    assert summary and int(summary[1]) == int(summary[2]) == (8 if tmpfs else 6), out
    assert re.search(r"^nan-lr-1e6-single +True .* exit 1: step \d+: gradient norm nan; 3 optimizer steps skipped", out, re.M), out


def _one_fault_survives_exactly(capsys, name):
    """One fault on a two-rank layout, beside that layout's uninterrupted run (the tool's --only
    pp2,cp2,ep2 runs all nine, ~4 minutes)."""
    code = faults.main(["--only", name, "--steps", "6"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^1 faults injected, 1 survived, 0 checkpoints lost$", out, re.M), out
    assert re.search(rf"^{name} +True +\d+ +0 +0 +0 ", out, re.M), out


# a test per layout: a shard each (BUILD)
def test_a_pipeline_parallel_run_killed_at_a_step_resumes_exactly(capsys):
    _one_fault_survives_exactly(capsys, "sigkill-step-pp2")


def test_a_context_parallel_run_stopped_by_sigterm_resumes_exactly(capsys):
    _one_fault_survives_exactly(capsys, "sigterm-cp2")


def test_an_expert_parallel_run_killed_mid_save_resumes_exactly(capsys):
    _one_fault_survives_exactly(capsys, "sigkill-mid-save-sync-ep2")


def test_a_killed_rank_costs_no_steps_with_torchft_and_the_steps_since_the_checkpoint_with_a_restart(capsys, monkeypatch):
    """The recovery table's per-step torchft and checkpoint-restart rows (the DiLoCo row: `--only
    kill-rank`), over 8 steps instead of 60: rank 1 killed before step 7, a checkpoint every 4 steps,
    so the restart still trains steps again; a dead group is noticed after 1 s here."""
    monkeypatch.setenv("TESSERA_LIGHTHOUSE_ARGS", "--heartbeat_timeout_ms 1000")
    monkeypatch.setattr(recovery, "STEPS", 8)
    monkeypatch.setattr(recovery, "KILL_AT", 7)
    monkeypatch.setattr(recovery, "INTERVAL", 4)
    code = faults.main(["--only", "kill-rank-torchft-per-step,kill-rank-restart"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = re.findall(r"^(kill-rank-\S+) +True +(live|disk), step (\d+) +(\d+) +(\d+) +(-?[\d.]+)  (.+)$", out, re.M)
    assert [row[0] for row in rows] == ["kill-rank-torchft-per-step", "kill-rank-restart"], out
    torchft, restart = rows
    # live from the other group, or (back after it finished: with 8 steps, nearly always) from its
    # final checkpoint: the same weights (live recovery mid-run: apps/trainer's test_fault_tolerance)
    assert torchft[3] == "0" and torchft[6] == "groups equal", out
    # the restart resumed from step 4 and trained steps 5-6 again
    assert restart[1:4] == ("disk", "4", "2") and restart[6] == "= uninterrupted", out


@pytest.mark.parametrize("argv, message", [
    (["--only", "sigkill-stpe"], "--only: no fault or recovery name contains 'sigkill-stpe'; the names: sigkill-step-single, "),
    (["--only", "sigterm-single,nosuchfault"], "--only: no fault or recovery name contains 'nosuchfault'; "),  # not sigterm alone
    (["--only", "nosuchfault,"], "--only: no fault or recovery name contains 'nosuchfault'; "),  # not every fault
    (["--only", ","], "--only ',' names nothing; the names: "),
    (["--steps", "4"], "--steps must be >= 5: "),
    (["--steps", "0"], "--steps must be >= 5: "),
])
def test_bad_arguments_are_one_line_before_any_temporary_folder(capsys, monkeypatch, argv, message):
    def made(*args, **kwargs):
        raise AssertionError("a temporary folder was made before the arguments were checked")
    monkeypatch.setattr(faults.tempfile, "mkdtemp", made)
    with pytest.raises(SystemExit) as stop:
        faults.main(argv)
    assert stop.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()
    assert error.startswith(f"faults: error: {message}"), error


def test_a_crash_mid_run_removes_the_temporary_folder(monkeypatch):
    """A failure inside the suite (here: the first trainer run's start) left the folder behind."""
    made = []

    def crash(dump, *args, **kwargs):
        made.append(dump.parent)
        assert dump.parent.is_dir()
        raise RuntimeError("crashed mid-run")
    monkeypatch.setattr(faults, "_tmpfs_unavailable", lambda work: "not mounted in this test")
    monkeypatch.setattr(faults, "Run", crash)
    with pytest.raises(RuntimeError, match="crashed mid-run"):
        faults.main(["--only", "sigterm-single"])
    (work,) = made
    assert work.name.startswith("tessera-faults-") and not work.exists()


def test_a_failed_recovery_says_why_with_its_log():
    """A recovery that failed once in CI printed only its row ("-" recovered): now why, and the
    faulty run's last lines, follow the table."""
    row = {"recovery": "kill-rank-torchft-per-step", "survived": False, "recovered": "-", "lost": 0, "sat_out": 2,
           "wall lost": 8.4, "weights": "only group(s) 0 ended",
           "why": ["rank 1 never reached step 7 on its first attempt", "final weights: only group(s) 0 ended"],
           "tail": ["[replica 1] error: checkpoint folder is not writable", "[replica 0] run done: 8 steps"]}
    lines = recovery.table([row]).splitlines()
    assert lines[-3:] == [
        "kill-rank-torchft-per-step failed: rank 1 never reached step 7 on its first attempt; final weights: only "
        "group(s) 0 ended; the faulty run's last 2 lines:",
        "  [replica 1] error: checkpoint folder is not writable", "  [replica 0] run done: 8 steps"]


def test_a_restart_that_failed_says_why_with_its_log(monkeypatch, capsys):
    """A SIGTERM fault that failed once in CI printed only its row (survived False, no loss): the
    restart's ending and last lines now follow the table. Runs stand in for the trainer here: the
    reference and the faulty run each save step-2; the restart fails to start."""
    class Scripted(faults.Run):
        def __init__(self, dump, steps, extra, preexec_fn=None, tag="run"):
            self.dump, self.log, self.tag = dump, Path(f"{dump}.{tag}.log"), tag
            self.proc = types.SimpleNamespace(send_signal=lambda sig: None)
            lines = ["error: 2-process run could not start: address in use"] if tag == "restart" else [
                f"step {step}/{steps}  loss   8.0000" for step in (1, 2, 3)]
            self.log.write_text("\n".join(lines) + "\n")
            if tag != "restart":
                (dump / "checkpoint" / "step-2").mkdir(parents=True)
                (dump / "checkpoint" / "step-2" / ".metadata").write_bytes(b"")

        def wait_until(self, condition, timeout=600):
            return condition()

        def finish(self, timeout=600):
            code = 1 if self.tag == "restart" else 0
            self.ending = f"exit {code}"
            return code

    monkeypatch.setattr(faults, "_tmpfs_unavailable", lambda work: "not mounted in this test")
    monkeypatch.setattr(faults, "_lost", lambda step: False)
    monkeypatch.setattr(faults, "Run", Scripted)
    assert faults.main(["--only", "sigterm-single", "--steps", "6"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-3:-1] == ["sigterm-single failed: the restart's ending: exit 1, no step-6; its last 1 lines:",
                          "  error: 2-process run could not start: address in use"], out
