"""The data order survives a change of data-parallel degree: a checkpoint written with dp 1
resumes with dp 2 and one written with dp 2 resumes with dp 1 (same global batch), and the
losses after the resume equal the uninterrupted run's. Shuffling and prefetching are on (the
defaults), so their state is what travels. For the embedded text corpus and for the same
documents as a folder of Parquet files (read a row group at a time, shuffled group-wise)."""

import shutil

import pytest
import torch

from tessera.data import load_dataset
from tessera.mesh.testing import run_on_ranks
from tessera.trainer.config import load_config
from tessera.trainer.train import train

torch.set_num_threads(1)  # as run_on_ranks sets in its workers: faster on a shared 2-core box

# Global batch 4 on every layout: dp 1 runs 2 micro-batches of 2, dp 2 one batch of 2 per rank.
BASE = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
        "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
        "--training.steps", "4", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
        "--checkpoint.last_save_model_only", "false"]
DP2 = ["--parallelism.data_parallel_shard_degree", "2"]


def losses(history):
    return [h["loss"] for h in history if "loss" in h]


def _train_on_ranks(rank, world_size, runs):
    histories = [train(load_config(argv)) for argv in runs]
    return histories if rank == 0 else None


def _resume_from(source, dump):
    """A new run folder holding only `source`'s step-2 checkpoint."""
    shutil.copytree(source / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    return ["--job.dump_folder", str(dump)]


def _parquet_corpus(folder):
    """The embedded corpus's documents as two Parquet files of 64-row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    documents = list(load_dataset())
    folder.mkdir()
    half = len(documents) // 2
    for i, part in enumerate((documents[:half], documents[half:])):
        pq.write_table(pa.table({"text": part}), folder / f"train-{i}.parquet", row_group_size=64)
    return ["--training.dataset_path", str(folder)]


@pytest.fixture(scope="module", params=["embedded_text", "parquet"])
def runs(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("data_resume")
    base = [*BASE, *(_parquet_corpus(tmp / "corpus") if request.param == "parquet" else [])]
    one = train(load_config([*base, "--job.dump_folder", str(tmp / "dp1")]))
    # Both 2-rank runs in one spawn: starting the processes costs more than the runs.
    one_to_two, two = run_on_ranks(_train_on_ranks, 2, [
        [*base, *DP2, *_resume_from(tmp / "dp1", tmp / "dp1_to_dp2")],
        [*base, *DP2, "--job.dump_folder", str(tmp / "dp2")],
    ])[0]
    two_to_one = train(load_config([*base, *_resume_from(tmp / "dp2", tmp / "dp2_to_dp1")]))
    return one, one_to_two, two, two_to_one


def test_dp1_checkpoint_resumes_on_dp2(runs):
    one, one_to_two, _, _ = runs
    assert len(losses(one)) == 4 and len(losses(one_to_two)) == 2
    assert losses(one_to_two) == pytest.approx(losses(one)[2:], rel=1e-5)


def test_dp2_checkpoint_resumes_on_dp1(runs):
    _, _, two, two_to_one = runs
    assert losses(two_to_one) == pytest.approx(losses(two)[2:], rel=1e-5)
    # and the two layouts trained on the same batches from the start
    assert losses(two) == pytest.approx(losses(runs[0]), rel=1e-5)
