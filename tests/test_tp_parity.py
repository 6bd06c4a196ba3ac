"""Tensor parallel (with and without sequence / loss parallel) and FSDP x TP training of a
shrunk debug Llama match one process step for step.

Tolerances (fp32): loss and grad norm within 1e-5 relative, every parameter within 1e-5
absolute after 3 AdamW steps with clipping (measured: loss and norm <= 2.2e-7, parameters
<= 2.3e-6, from Adam's sensitivity to near-zero gradients).
"""

import dataclasses

import pytest

from parity import ARGS, SPEC, Layout, clipping_reference, max_diffs, run_layouts
from tessera.tp import check_tp_degree


def _tp_layouts(tp):
    """Pure TP of degree tp with sequence parallel on/off and loss parallel on/off."""
    return {
        f"tp{tp}{'' if sp else '_no_sp'}{'_loss_parallel' if lp else ''}": Layout(
            tp=tp, data_parallel=None, sequence_parallel=sp, loss_parallel=lp
        )
        for sp in (True, False)
        for lp in (True, False)
    }


TWO_RANKS = _tp_layouts(2)
FOUR_RANKS = {
    **_tp_layouts(4),
    # FSDP over the TP-sharded model; without SP the norm weights are FSDP-only DTensors on the
    # dp mesh next to (dp, tp) DTensors: the grad-norm clip sees two meshes
    "fsdp2_tp2_loss_parallel": Layout(dp_shard=2, tp=2, loss_parallel=True),
    "fsdp2_tp2_no_sp": Layout(dp_shard=2, tp=2, sequence_parallel=False),
}


@pytest.fixture(scope="module")
def ref():
    return clipping_reference()


@pytest.fixture(scope="module")
def runs():
    return {**run_layouts(TWO_RANKS), **run_layouts(FOUR_RANKS)}


@pytest.mark.parametrize("name", [*TWO_RANKS, *FOUR_RANKS])
def test_layout_matches_single_process(runs, ref, name):
    loss, norm, param = max_diffs(runs[name][0], ref)
    assert loss <= 1e-5 and norm <= 1e-5 and param <= 1e-5, (loss, norm, param)
    for other in runs[name][1:]:
        assert other["loss"] == pytest.approx(runs[name][0]["loss"], rel=1e-6)
        assert other["norm"] == pytest.approx(runs[name][0]["norm"], rel=1e-6)


@pytest.mark.parametrize(
    "tp, args, culprit",
    [
        (3, ARGS, "n_heads=8"),
        (8, ARGS, "n_kv_heads=4"),
        (2, dataclasses.replace(ARGS, vocab_size=255), "vocab_size=255"),
    ],
)
def test_tp_degree_not_dividing_the_model_is_a_clear_error(tp, args, culprit):
    with pytest.raises(ValueError, match=f"tensor_parallel_degree {tp} does not divide {culprit}"):
        check_tp_degree(tp, SPEC.tp_divisible(args))
