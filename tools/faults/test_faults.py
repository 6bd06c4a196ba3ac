"""The fault suite's one-process faults (SIGKILL at a step and mid-save, sync and async; SIGTERM;
a full disk and a read-only one, on a real tmpfs where this process may mount one; NaN), and one
fault each on pipeline, context and expert parallel runs, all end as they must: no data lost,
exact resumes, a diverged run stopped."""

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


def test_an_only_that_matches_no_fault_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        faults.main(["--only", "sigkill-stpe"])
    assert stop.value.code == 2
    assert "faults: error: --only 'sigkill-stpe' matches no fault" in capsys.readouterr().err
