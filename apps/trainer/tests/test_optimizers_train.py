"""Optimizer choices through the whole trainer: Muon (matrices) with AdamW (the rest) over
parameter groups, under FSDP 2, TP 2, FSDP 2 x TP 2, PP 2 and EP 2, against the same run on one
process and the same global batch: fp32 (Newton-Schulz in float32) losses and grad norms within
1e-5 relative, every parameter within 2e-5 absolute after the last step; AdamW's groups the same
under FSDP 2; a resume that moves FSDP 2 -> one process -> TP 2 continues the uninterrupted run
exactly; AdamW with bfloat16 moments the same under FSDP 2 x TP 2; and a resume with other groups
is refused in one line."""

import functools

import pytest
from final_params import assert_params_close, final_params

from tessera.mesh.testing import run_on_ranks
from tessera.trainer.config import load_config
from tessera.trainer.errors import ConfigError
from tessera.trainer.train import train

STEPS = 3
BASE = ["--training.seq_len", "32", "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1",
        "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "1", "--training.local_batch_size", "2"]
GROUPS = ["--optimizer.param_groups", "norms,biases,embeddings,weight_decay=0;output,lr_scale=0.5"]
MUON = ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32", *GROUPS]
BF16_MOMENTS = ["--optimizer.state_dtype", "bfloat16", "--optimizer.implementation", "for-loop"]
MOE = ["--model.name", "qwen3", "--model.flavor", "tiny_moe", "--optimizer.param_groups",
       "norms,biases,embeddings,weight_decay=0;output,lr_scale=0.5;experts,router,lr_scale=0.7"]

# ranks, arguments, data-parallel degree (the single-process run takes local batch x dp)
LAYOUTS = {
    "muon_fsdp2": (2, [*MUON, "--parallelism.data_parallel_shard_degree", "2"], 2),
    "muon_tp2": (2, [*MUON, "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"], 1),
    "muon_fsdp2_tp2": (4, [*MUON, "--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"], 2),
    "muon_pp2": (2, [*MUON, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"], 1),
    "muon_ep2_moe": (2, [*MUON, *MOE, "--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"], 2),
    "adamw_groups_fsdp2": (2, [*GROUPS, "--parallelism.data_parallel_shard_degree", "2"], 2),
    "adamw_bf16_moments_fsdp2_tp2": (4, [*BF16_MOMENTS, "--parallelism.data_parallel_shard_degree", "2",
                                         "--parallelism.tensor_parallel_degree", "2"], 2),
}
LAYOUT_KEYS = ("--parallelism.", "--training.local_batch_size")


def _train_rank(rank, world_size, argv):
    with final_params() as params:
        history = [(h["loss"], h["grad_norm"]) for h in train(load_config(argv))]
    return history, params


def _without_layout(argv):
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item.startswith(LAYOUT_KEYS):
            skip = True
        else:
            out.append(item)
    return out


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """single_process(argv): the single-process run's (history, parameters) for these arguments, run
    once per module (Muon's FSDP 2 and FSDP 2 x TP 2 share one, its TP 2 and PP 2 another) and
    never changed by the tests."""
    @functools.cache
    def run(argv: tuple[str, ...]):
        return _train_rank(0, 1, [*argv, "--job.dump_folder", str(tmp_path_factory.mktemp("one"))])

    return run


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_optimizer_layout_matches_single_process(tmp_path, single_process, layout):
    ranks, extra, dp = LAYOUTS[layout]
    reference, reference_params = single_process((*BASE, *_without_layout(extra), "--training.local_batch_size", str(2 * dp)))
    per_rank = run_on_ranks(_train_rank, ranks, [*BASE, *extra, "--job.dump_folder", str(tmp_path / layout)])
    for history, _ in per_rank:
        for (loss, norm), (ref_loss, ref_norm) in zip(history, reference, strict=True):
            assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5), layout
    merged = {key: value for _, params in per_rank for key, value in params.items()}  # pipeline stages hold other keys
    assert_params_close(merged, reference_params, 2e-5, layout)


def _resume(rank, world_size, argv):
    return [h["loss"] for h in train(load_config(argv))]


@pytest.mark.parametrize("optimizer", ["muon", "adamw_groups", "adamw_bf16_moments"])
def test_resume_across_layouts_continues_exactly(tmp_path, optimizer):
    extra = {"muon": MUON, "adamw_groups": GROUPS, "adamw_bf16_moments": BF16_MOMENTS}[optimizer]
    common = [*BASE, *extra, "--checkpoint.enable", "true", "--checkpoint.interval", "1", "--lr_scheduler.total_steps", "4"]
    whole = _resume(0, 1, [*common, "--training.steps", "4", "--job.dump_folder", str(tmp_path / "whole")])
    folder = ["--job.dump_folder", str(tmp_path / "moved")]
    losses = run_on_ranks(_resume, 2, [*common, *folder, "--training.steps", "2", "--training.local_batch_size", "1",
                                       "--parallelism.data_parallel_shard_degree", "2"])[0]
    losses += _resume(0, 1, [*common, *folder, "--training.steps", "3"])
    losses += run_on_ranks(_resume, 2, [*common, *folder, "--training.steps", "4", "--parallelism.tensor_parallel_degree", "2",
                                        "--parallelism.data_parallel_shard_degree", "1"])[0]
    assert losses == pytest.approx(whole, rel=1e-5)


def test_resume_with_other_groups_is_refused(tmp_path):
    common = [*BASE, "--checkpoint.enable", "true", "--checkpoint.interval", "1", "--job.dump_folder", str(tmp_path)]
    train(load_config([*common, *MUON, "--training.steps", "1"]))
    with pytest.raises(ConfigError, match=r"^checkpoint was written with optimizer groups \[norms,biases,embeddings,"
                                          r"weight_decay=0: 14 parameters, adamw weight_decay=0 lr_scale=1; .*this run has "
                                          r"\[default: all parameters, adamw weight_decay=0.1 lr_scale=1\]"):
        train(load_config([*common, "--training.steps", "2"]))
