"""The fault suite's one-process faults (SIGKILL at a step and mid-save, sync and async; SIGTERM;
a full disk and a read-only one, on a real tmpfs where this process may mount one; NaN), and one
fault each on pipeline, context and expert parallel runs, all end as they must: no data lost,
exact resumes, a diverged run stopped; and a killed rank recovered by torchft's replica groups
beside a checkpoint restart."""

import re

import pytest

import faults


def test_single_process_faults_lose_nothing(capsys):
    code = faults.main(["--only", "single", "--steps", "6"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = re.search(r"^(\d+) faults injected, (\d+) survived, 0 checkpoints lost$", out, re.M)
    tmpfs = "disk faults on a real tmpfs skipped" not in out
    assert summary and int(summary[1]) == int(summary[2]) == (8 if tmpfs else 6), out
    assert re.search(r"^nan-lr-1e6-single +True .* exit 1: step \d+: gradient norm nan; 3 optimizer steps skipped", out, re.M), out


def test_pipeline_context_and_expert_parallel_runs_resume_exactly(capsys):
    """One fault per layout (the tool's --only pp2,cp2,ep2 runs all nine, ~4 minutes)."""
    code = faults.main(["--only", "sigkill-step-pp2,sigterm-cp2,sigkill-mid-save-sync-ep2", "--steps", "6"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^3 faults injected, 3 survived, 0 checkpoints lost$", out, re.M), out
    for name in ("sigkill-step-pp2", "sigterm-cp2", "sigkill-mid-save-sync-ep2"):
        assert re.search(rf"^{name} +True +\d+ +0 +0 +0 ", out, re.M), out


def test_a_killed_rank_costs_no_steps_with_torchft_and_the_steps_since_the_checkpoint_with_a_restart(capsys, monkeypatch):
    """The recovery table's per-step torchft and checkpoint-restart rows (the DiLoCo row: `--only
    kill-rank`); a dead group is noticed after 1 s here."""
    monkeypatch.setenv("TESSERA_LIGHTHOUSE_ARGS", "--heartbeat_timeout_ms 1000")
    code = faults.main(["--only", "kill-rank-torchft-per-step,kill-rank-restart"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = re.findall(r"^(kill-rank-\S+) +True +(live|disk), step (\d+) +(\d+) +(\d+) +(-?[\d.]+)  (.+)$", out, re.M)
    assert [row[0] for row in rows] == ["kill-rank-torchft-per-step", "kill-rank-restart"], out
    torchft, restart = rows
    # live from the other group, or (back after it finished) from its final checkpoint: the same weights
    assert torchft[3] == "0" and torchft[6] == "groups equal", out
    # the restart resumed from step 8 and trained steps 9-13 again
    assert restart[1:4] == ("disk", "8", "5") and restart[6] == "= uninterrupted", out


def test_an_only_that_matches_no_fault_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        faults.main(["--only", "sigkill-stpe"])
    assert stop.value.code == 2
    assert "faults: error: --only 'sigkill-stpe' matches no fault" in capsys.readouterr().err
