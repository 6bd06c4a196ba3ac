"""The test harness keeps the ranks of a world size up between calls, yet every call starts as a
fresh rank would: the same pids twice, but no environment, seed or working directory left over;
a failure or a rank that dies takes the ranks down and the next call gets new ones."""

import os
import time

import pytest
import torch

from tessera.mesh.testing import run_on_ranks


def _leave_state_behind(rank, world_size, folder):
    seen = {"pid": os.getpid(), "draw": torch.rand(3), "env": os.environ.get("LEFT_BEHIND"),
            "cwd": os.getcwd(), "dtype": torch.get_default_dtype()}
    os.environ["LEFT_BEHIND"] = "yes"
    os.chdir(folder)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(rank + 7)
    return seen


def _pid(rank, world_size):
    return os.getpid()


def _die_on_rank_1(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def _fail_on_rank_0(rank, world_size):
    if rank == 0:
        raise ValueError("boom on rank 0")
    return rank


def test_ranks_are_reused_and_each_call_starts_fresh(tmp_path):
    first = run_on_ranks(_leave_state_behind, 2, str(tmp_path))
    second = run_on_ranks(_leave_state_behind, 2, str(tmp_path))
    assert [r["pid"] for r in first] == [r["pid"] for r in second]
    for a, b in zip(first, second):
        assert torch.equal(a["draw"], b["draw"])
        assert b["env"] is None and b["cwd"] == a["cwd"] != str(tmp_path) and b["dtype"] == torch.float32


def test_a_rank_that_dies_is_reported_at_once_and_replaced():
    before = run_on_ranks(_pid, 2)
    start = time.monotonic()
    with pytest.raises(RuntimeError):  # rank 1's death, or rank 0's barrier meeting it, whichever is seen first
        run_on_ranks(_die_on_rank_1, 2, timeout_s=120)
    assert time.monotonic() - start < 60  # not the timeout
    after = run_on_ranks(_pid, 2)
    assert not set(before) & set(after)


def test_a_failure_takes_the_ranks_down():
    before = run_on_ranks(_pid, 2)
    with pytest.raises(RuntimeError, match="boom on rank 0"):
        run_on_ranks(_fail_on_rank_0, 2)
    assert not set(before) & set(run_on_ranks(_pid, 2))


def test_what_cannot_travel_fails_in_the_caller():
    with pytest.raises(Exception):
        run_on_ranks(lambda rank, world_size: rank, 2)
