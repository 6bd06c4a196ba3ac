"""DeepSeek-V3's multi-token prediction in the trainer (flavor tiny_mtp: one module, weighted by
loss.mtp_scale 0.3), each layout against one process on the same global batch (8 sequences of 32
tokens, 2 steps; fp32: losses and grad norms within 1e-5 relative, parameters within ADAMW_ATOL):
FSDP 2, EP 2, TP 2, PP 2 (1F1B with gradient accumulation; DualPipeV, whose V puts both copies of
the shared embedding on one rank) and PP 2 x EP 2 (DualPipeV with selective 'op' checkpointing).
Under PP the last stage keeps a copy of the embedding (tessera.pp's shared_with_last_stage), saved
under the embedding's own name: a PP 2 checkpoint resumes on one process and one process's under
PP 2, each step as the uninterrupted run, and PP 2's Hugging Face export holds the MTP layer. The
job plan refuses in one line what multi-token prediction does not run with."""

import shutil

import pytest
import torch
from final_params import ADAMW_ATOL, assert_params_close, final_params

from tessera.ckpt import load_hf
from tessera.mesh.testing import run_on_ranks
from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.plan import make_plan
from tessera.trainer.train import train

TOL = 1e-5
BASE = ["--model.name", "deepseek_v3", "--model.flavor", "tiny_mtp", "--training.seq_len", "32", "--training.steps", "2",
        "--training.global_batch_size", "8", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1"]
CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.last_save_model_only", "false"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
DUALPIPEV = ["--parallelism.pipeline_parallel_schedule", "DualPipeV"]
TWO_RANKS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"],
    "ep2": ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2",
            "--training.local_batch_size", "4"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
            "--training.local_batch_size", "8"],
    # two micro-batches of 4 per step, each through the pipeline: the copies' gradients accumulate
    "pp2": [*PP2, "--training.local_batch_size", "4", *CKPT, "--checkpoint.last_save_in_hf", "true"],
    "pp2_dualpipev": [*PP2, *DUALPIPEV, "--training.local_batch_size", "8"],
}
FOUR_RANKS = {
    "pp2_ep2_dualpipev_sac_op": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
                                 *DUALPIPEV, "--training.local_batch_size", "4", "--activation_checkpoint.mode", "selective",
                                 "--activation_checkpoint.selective_ac_option", "op"],
}


def _run(argv):
    with final_params() as params:
        history = train(load_config(argv))
    return [(step["step"], step["loss"], step["grad_norm"]) for step in history], params


def _layouts(rank, world_size, runs):
    return {name: _run(argv) for name, argv in runs.items()}


def _spawned(world_size, runs) -> dict:
    """Each run's history (rank 0's) and the parameters of all ranks (each holds its own stages')."""
    per_rank = run_on_ranks(_layouts, world_size, runs)
    return {name: (per_rank[0][name][0], {k: v for ranks in per_rank for k, v in ranks[name][1].items()}) for name in runs}


def _resumed(tmp, source, name, extra):
    """argv continuing `source`'s run from its step-1 checkpoint in a folder of its own."""
    shutil.copytree(tmp / source / "checkpoint" / "step-1", tmp / name / "checkpoint" / "step-1")
    return [*BASE, *extra, "--job.dump_folder", str(tmp / name), "--checkpoint.enable", "true"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process run (saving step 1), the two-rank layouts and PP 2 resuming it in one
    spawn, then one process resuming PP 2's step 1, and the four-rank layout."""
    tmp = tmp_path_factory.mktemp("mtp")
    single = ["--training.local_batch_size", "8"]
    results = {"single": _run([*BASE, *single, *CKPT, "--job.dump_folder", str(tmp / "single")])}
    two = {name: [*BASE, *flags, "--job.dump_folder", str(tmp / name)] for name, flags in TWO_RANKS.items()}
    two["pp2_from_single"] = _resumed(tmp, "single", "pp2_from_single", [*PP2, "--training.local_batch_size", "4"])
    results |= _spawned(2, two)
    results["single_from_pp2"] = _run(_resumed(tmp, "pp2", "single_from_pp2", single))
    results |= _spawned(4, {name: [*BASE, *flags, "--job.dump_folder", str(tmp / name)] for name, flags in FOUR_RANKS.items()})
    return tmp, results


@pytest.mark.parametrize("layout", [*TWO_RANKS, *FOUR_RANKS])
def test_layout_matches_single_process(runs, layout):
    _, results = runs
    (history, params), (reference, reference_params) = results[layout], results["single"]
    assert [step for step, _, _ in history] == [1, 2]
    for (_, loss, norm), (_, want_loss, want_norm) in zip(history, reference):
        assert loss == pytest.approx(want_loss, rel=TOL), layout
        assert norm == pytest.approx(want_norm, rel=TOL), layout
    assert_params_close(params, reference_params, ADAMW_ATOL, layout)


def test_checkpoints_resume_across_pipeline_layouts(runs):
    """Step 2 from the other layout's step-1 checkpoint, as the uninterrupted runs trained it."""
    _, results = runs
    for name, source in (("pp2_from_single", "single"), ("single_from_pp2", "pp2")):
        (history, _), (uninterrupted, _) = results[name], results[source]
        assert [step for step, _, _ in history] == [2], name
        assert history[0][1:] == pytest.approx(uninterrupted[1][1:], rel=TOL), name


def test_pipeline_export_holds_the_mtp_layer(runs):
    tmp, results = runs
    exported, params = load_hf(tmp / "pp2" / "checkpoint" / "step-2-hf"), results["pp2"][1]
    for hf, key in (("model.layers.6.eh_proj.weight", "layers.6.eh_proj.weight"),
                    ("model.layers.6.shared_head.norm.weight", "layers.6.mtp_norm.weight"),
                    ("model.layers.6.embed_tokens.weight", "tok_embeddings.weight"),
                    ("model.layers.6.shared_head.head.weight", "output.weight")):
        assert torch.equal(exported[hf], params[key]), hf
    assert torch.equal(exported["model.embed_tokens.weight"], params["tok_embeddings.weight"])


@pytest.mark.parametrize("flags, message", [
    (["--parallelism.context_parallel_degree", "2"], "context_parallel_degree > 1 is not supported yet for deepseek_v3/"
                                                     "tiny_mtp: multi-token prediction's later tokens cross"),
    (["--training.loss_chunk_size", "64"], "training.loss_chunk_size with multi-token prediction (deepseek_v3/tiny_mtp)"),
    (["--model.flavor", "tiny", "--loss.mtp_scale", "0.1"], "loss.mtp_scale weighs multi-token prediction, which "
                                                            "deepseek_v3/tiny does not have"),
    ([*PP2, "--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0,layers.1,layers.2,layers.3,layers.4,"
      "layers.5,layers.6;norm,output"], "multi-token prediction's layers.6 must be on the last stage"),
])
def test_plan_refuses_what_mtp_cannot_run_with(flags, message):
    with pytest.raises(ConfigError) as error:
        make_plan(load_config([*BASE, "--training.local_batch_size", "4", *flags]), 2, "cpu")
    assert message in str(error.value) and "\n" not in str(error.value)
