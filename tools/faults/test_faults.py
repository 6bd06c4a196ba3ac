"""The fault suite's one-process faults (SIGKILL at a step and mid-save, sync and async; SIGTERM;
a full disk) all survive with no data lost and exact resumes."""

import faults


def test_single_process_faults_lose_nothing(capsys):
    assert faults.main(["--only", "single", "--steps", "6"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "5 faults injected, 5 survived, 0 checkpoints lost" in out
