"""The planner against public recipes, and one-line errors for bad input."""

from __future__ import annotations

import pytest

import plan


def _degrees(c):
    return c.plan.dims.dp_shard, c.plan.dims.tp, c.plan.dims.pp


@pytest.mark.parametrize("flavor, gpus, recipe", [
    ("8B", 8, (8, 1, 1)),  # torchtitan: FSDP 8 on one H100 node
    ("70B", 256, (32, 8, 1)),  # FSDP 32 x TP 8
])
def test_public_recipes_in_top_3(flavor, gpus, recipe):
    args = plan.parse(["--flavor", flavor, "--gpus", str(gpus), "--gpu", "h100"])
    top = plan.candidates(args, plan.GPUS["h100"])[:3]
    assert recipe in [_degrees(c) for c in top]


def test_405b_recipe_fits_and_its_rank_is_stated(capsys):
    """FSDP 8 x TP 8 x PP 8 on 512 H100s fits; the step-time model ranks it below layouts without a
    pipeline (its 1F1B bubble costs more than the FSDP traffic it saves): stated, not hidden."""
    args = plan.parse(["--flavor", "405B", "--gpus", "512", "--gpu", "h100", "--global_batch", "64"])
    found = plan.candidates(args, plan.GPUS["h100"])
    ranks = [i for i, c in enumerate(found, 1) if _degrees(c) == (8, 8, 8)]
    print(f"405B FSDP 8 x TP 8 x PP 8: rank {ranks[0]} of {len(found)}")
    assert ranks


@pytest.mark.parametrize("argv, message", [
    (["--flavor", "9B", "--gpus", "8"], "--flavor '9B' is not a flavor of llama3"),
    (["--flavor", "8B", "--gpus", "0"], "--gpus 0 must be >= 1"),
    (["--flavor", "8B", "--gpus", "8", "--gpu", "tpu"], "--gpu 'tpu' is not one of"),
    (["--flavor", "8B"], "the following arguments are required: --gpus"),
    (["--flavor", "405B", "--gpus", "1"], "no layout of llama3/405B fits 1 x H100 SXM"),
])
def test_bad_input_one_line_exit_2(argv, message, capsys):
    assert plan.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
