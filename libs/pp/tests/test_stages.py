import os
import subprocess
import sys

import pytest
import torch

from tessera.pp import (check_backend, check_schedule_csv, check_split, check_stage_count, even_split, splits_backward,
                        stage_count, stage_ids)


def test_even_split_weights_inputs_and_outputs_as_layers():
    # 6 blocks + 1 + 1 = 8 units over 2 stages: stage 0 holds the embedding and 3 blocks
    assert even_split(2, 6) == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2"],
        ["layers.3", "layers.4", "layers.5", "norm", "output"],
    ]


def test_uneven_split_gives_earlier_stages_the_extra_units():
    parts = even_split(4, 7, first_stage_less_layers=0, last_stage_less_layers=0)
    assert [sum(name.startswith("layers.") for name in p) for p in parts] == [2, 2, 2, 1]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]


def test_one_stage_holds_everything():
    assert even_split(1, 2) == [["tok_embeddings", "layers.0", "layers.1", "norm", "output"]]


@pytest.mark.parametrize("stages, layers, message", [
    (8, 2, "outnumber the model's 2 layers"),
    (3, 2, "exceed the 1 layers a stage holds"),
])
def test_too_many_stages_is_refused(stages, layers, message):
    with pytest.raises(ValueError, match=message):
        even_split(stages, layers, first_stage_less_layers=2 if stages == 3 else 1)


@pytest.mark.parametrize("schedule, layers_per_stage, expected", [
    ("1F1B", None, 2), ("GPipe", None, 2), ("Interleaved1F1B", None, 4), ("ZBVZeroBubble", None, 4),
    ("1F1B", 4, 2), ("Interleaved1F1B", 2, 4), ("interleaved1f1b", 2, 4),
])
def test_stage_count(schedule, layers_per_stage, expected):
    assert stage_count(2, schedule, 6, layers_per_stage=layers_per_stage) == expected


@pytest.mark.parametrize("schedule, layers_per_stage, message", [
    ("1F1B", 2, "runs one stage per rank, this is 2"),
    ("Interleaved1F1B", 4, "runs several stages per rank, this is 1"),
    ("DualPipeV", 1, "runs exactly 2 stages per rank, this is 4"),
    ("1F1B", 3, "does not divide by pipeline_parallel_degree 2"),
    ("Zigzag", None, "'Zigzag' is not one of"),
])
def test_bad_stage_counts_name_the_key(schedule, layers_per_stage, message):
    with pytest.raises(ValueError, match=message):
        stage_count(2, schedule, 6, layers_per_stage=layers_per_stage)


def test_looped_and_v_placement():
    assert [stage_ids(r, 2, 4, "Interleaved1F1B") for r in range(2)] == [(0, 2), (1, 3)]
    assert [stage_ids(r, 2, 4, "ZBVZeroBubble") for r in range(2)] == [(0, 3), (1, 2)]
    assert [stage_ids(r, 2, 2, "1F1B") for r in range(2)] == [(0,), (1,)]


@pytest.mark.parametrize("parts, message", [
    ([["tok_embeddings", "layers.0"], ["layers.1", "layers.9", "norm", "output"]], r"names \['layers.9'\]"),
    ([["tok_embeddings", "layers.0"], ["norm", "output"]], r"leaves out \['layers.1'\]"),
    ([["tok_embeddings", "layers.0", "layers.1"], ["layers.1", "norm", "output"]], "more than once"),
    ([["tok_embeddings", "layers.1"], ["layers.0", "norm", "output"]], "in model order"),
    ([["tok_embeddings", "layers.0", "layers.1", "norm", "output"], []], "empty stage"),
])
def test_explicit_split_is_checked(parts, message):
    with pytest.raises(ValueError, match=message):
        check_split(parts, 2)
    check_split([["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]], 2)


def test_an_explicit_stage_count_is_checked_like_a_computed_one():
    with pytest.raises(ValueError, match="the split names 3 stages, which does not divide by pipeline_parallel_degree 2"):
        check_stage_count(3, 2, "1F1B", "the split names 3 stages")
    with pytest.raises(ValueError, match="schedule ZBVZeroBubble runs exactly 2 stages per rank, this is 3"):
        check_stage_count(6, 2, "ZBVZeroBubble", "the split names 6 stages")
    check_stage_count(4, 2, "Interleaved1F1B", "the split names 4 stages")


def test_split_backward_by_name_or_by_the_csv_that_replaces_its_order(tmp_path):
    assert splits_backward("ZBVZeroBubble") and not splits_backward("1F1B")
    split, full, bad = (tmp_path / f"{n}.csv" for n in ("split", "full", "bad"))
    split.write_text("0F0,0I0,0W0\n1F0,1I0,1W0\n")
    full.write_text("0F0,0B0\n1F0,1B0\n")
    bad.write_text("0F0,0Q0\n")
    assert splits_backward("1F1B", str(split)) and not splits_backward("ZBVZeroBubble", str(full))
    with pytest.raises(ValueError, match="bad.csv: Invalid action string: 0Q0"):
        splits_backward("1F1B", str(bad))


def test_microbatch_counts_agree_with_torchs_schedule_constructors():
    """check_microbatches refuses exactly the counts torch's constructors refuse (built over a fake
    process group on stages of one Linear: nothing runs)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tessera.pp import check_microbatches, schedule_class

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        for schedule, per_rank in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 3),
                                   ("ZBVZeroBubble", 2), ("DualPipeV", 2)):
            for pp in (2, 4):
                n = pp * per_rank
                group = dist.new_group(list(range(pp)))
                ids = stage_ids(0, pp, n, schedule)
                stages = [PipelineStage(torch.nn.Linear(2, 2), s, n, torch.device("cpu"), group=group) for s in ids]
                for m in range(1, 13):
                    try:
                        schedule_class(schedule)(stages if per_rank > 1 else stages[0], n_microbatches=m, loss_fn=torch.sum)
                        torch_accepts = True
                    except ValueError:
                        torch_accepts = False
                    try:
                        check_microbatches(schedule, pp, n, m)
                        ours = True
                    except ValueError:
                        ours = False
                    assert ours == torch_accepts, (schedule, pp, m)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("release, device, refused", [
    ("2.11.0+cu130", "cpu", True), ("2.11.0+cu130", "cuda", False), ("2.12.1", "cpu", False), ("2.13.0+cpu", "cpu", False)])
def test_v_shaped_schedules_on_gloo_need_torch_2_12(monkeypatch, release, device, refused):
    monkeypatch.setattr(torch, "__version__", release)
    for schedule in ("zbvzerobubble", "DualPipeV"):
        if refused:
            with pytest.raises(ValueError, match="on CPU needs torch 2.12 or newer: torch 2.11.0"):
                check_backend(schedule, device)
        else:
            check_backend(schedule, device)
    check_backend("1F1B", device)  # one stage per rank: nothing sent to itself


# 1F1B's order for 2 ranks and 4 micro-batches, with full backwards (B) or split ones (I then W)
CSV_1F1B = "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"
CSV_SPLIT = "0F0,0F1,0I0,0W0,0F2,0I1,0W1,0F3,0I2,0W2,0I3,0W3\n1F0,1I0,1W0,1F1,1I1,1W1,1F2,1I2,1W2,1F3,1I3,1W3\n"


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "s.csv holds no actions$"),
        ("\n\n", "s.csv holds no actions$"),
        (CSV_1F1B.splitlines()[0], "s.csv has 1 row; pipeline_parallel_degree 2 needs one per pp rank$"),
        (CSV_1F1B + "0F0\n", "s.csv has 3 rows"),
        ("0F0,0X0\n1F0\n", "s.csv: Invalid action string: 0X0"),
        ("0F0,0SEND_F0\n1F0\n", r"row 1 \(pp rank 0\): 0SEND_F0 is not a compute action"),
        (CSV_1F1B.replace("1B3", "2B3"), r"row 2 \(pp rank 1\): 2B3 names stage 2; the pipeline has stages 0..1$"),
        (CSV_1F1B.replace("0F3", "0F4"), r"row 1 \(pp rank 0\): 0F4 names micro-batch 4; the step has 0..3$"),
        ("1F0,1B0\n0F0,0B0\n", r"row 1 \(pp rank 0\): 1F0: 1F1B places stage 1 on pp rank 1$"),
        ("0F0,0F1,0F2,0F3\n1F0,1F1,1F2,1F3\n", "torch cannot run this order: Invalid backward microbatches for stage 0: "
                                               "expected 4 total backwards, but got B=0"),  # forward only
        (CSV_1F1B.replace(",0B3", ""), "expected 4 total backwards, but got B=3"),
        (CSV_1F1B.replace("0F0,0F1,0B0", "0B0,0F0,0F1"), "microbatch 0 without first running Forward$"),
        (CSV_SPLIT.replace(",0W3", ""), "I and W must have equal counts"),
        # rank 1 starts with micro-batch 1, which rank 0 sends only after it has the gradient of 0
        ("0F0,0B0,0F1,0B1,0F2,0B2,0F3,0B3\n1F1,1B1,1F0,1B0,1F2,1B2,1F3,1B3\n", "torch cannot run this order: "
                                                                             "Malformed compute schedule"),
    ],
)
def test_a_schedule_csv_is_checked_whole_before_any_process_starts(tmp_path, text, message):
    path = tmp_path / "s.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        check_schedule_csv(str(path), "1F1B", 2, 2, 4)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("text", [CSV_1F1B, CSV_SPLIT, CSV_1F1B.replace("\n", ",\n")])  # trailing empty cells
def test_schedule_csvs_torch_runs_pass_the_check(tmp_path, text):
    path = tmp_path / "s.csv"
    path.write_text(text)
    check_schedule_csv(str(path), "1F1B", 2, 2, 4)


def test_torch_pipelining_loads_at_the_first_use_of_a_schedule():
    """Importing tessera.pp and splitting by numbers leave torch's pipelining (and the dynamo it
    loads, about a second per process) unloaded, for the launchers and planners of jobs without
    pipeline parallelism; a schedule's first use and Pipeline load it."""
    code = ("import sys\nimport tessera.pp as pp\npp.even_split(2, 4)\n"
            "print('torch.distributed.pipelining' in sys.modules, pp.is_single_stage('1F1B'),"
            " 'torch.distributed.pipelining' in sys.modules, pp.Pipeline.__name__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"})
    assert result.stdout.split() == ["False", "True", "True", "Pipeline"], result.stderr[-2000:]
