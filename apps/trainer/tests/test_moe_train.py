"""MoE families in the trainer: DeepSeek-V3 (MLA, sigmoid group-limited routing, shared experts),
Qwen3-MoE and GPT-OSS (experts of its own layout: biases, clamped SwiGLU, interleaved gate/up)
train, report per-layer expert load, update their router bias after every optimizer step on the
tokens of all data-parallel ranks, and match the single-process run under FSDP (fp32: losses and
grad norms within 1e-5 relative, parameters within ADAMW_ATOL)."""

import functools

import pytest
from final_params import ADAMW_ATOL, assert_params_close, final_params

from tessera.mesh.testing import run_on_ranks
from tessera.trainer.config import load_config
from tessera.trainer.train import train

STEPS = 2  # a step, an update (the router bias's too) and a step on the updated weights
BASE = ["--training.seq_len", "32", "--metrics.log_freq", "1", "--training.steps", str(STEPS),
        "--lr_scheduler.warmup_steps", "1"]
FAMILIES = {"deepseek_v3": ["--model.name", "deepseek_v3", "--model.flavor", "tiny"],
            "qwen3_moe": ["--model.name", "qwen3", "--model.flavor", "tiny_moe"],
            "gpt_oss": ["--model.name", "gpt_oss", "--model.flavor", "tiny"],
            "llama4": ["--model.name", "llama4", "--model.flavor", "tiny"]}


def _train_rank(rank, world_size, argv):
    with final_params() as params:
        history = train(load_config(argv))
    return history, params  # under pipeline parallel, this rank's stages only


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """single_process(family, global_batch): the single-process run's (history, parameters), run
    once per module for each pair (several layouts share a reference) and never changed by the tests."""
    @functools.cache
    def run(family, batch):
        dump = tmp_path_factory.mktemp(f"single_{family}_{batch}")
        return _train_rank(0, 1, [*BASE, *FAMILIES[family], "--job.dump_folder", str(dump),
                                  "--training.local_batch_size", str(batch)])

    return run


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_family_trains_and_reports_expert_load(single_process, family):
    history, params = single_process(family, 8)  # the default local batch: the run the pipeline layouts compare with
    assert len(history) == STEPS
    imbalance = {key: value for key, value in history[-1].items() if key.endswith("/imbalance")}
    assert imbalance and all(value >= 1.0 for value in imbalance.values())
    biases = {name: value for name, value in params.items() if name.endswith("expert_bias")}
    assert biases and any(bias.abs().sum() > 0 for bias in biases.values())  # the router bias moved


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_family_under_fsdp_matches_single_process(tmp_path, single_process, family):
    argv = [*BASE, *FAMILIES[family]]
    reference, reference_params = single_process(family, 4)
    per_rank = run_on_ranks(_train_rank, 2, [*argv, "--job.dump_folder", str(tmp_path / "fsdp2"),
                                            "--training.local_batch_size", "2", "--parallelism.data_parallel_shard_degree", "2"])
    for history, _ in per_rank:
        for step, ref in zip(history, reference):
            assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5)
            assert step["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
            assert step["moe/layers.1.moe/load_max"] == ref["moe/layers.1.moe/load_max"]  # loads summed over ranks
    assert_params_close(per_rank[0][1], reference_params, ADAMW_ATOL, family)


EP_LAYOUTS = {  # ranks, extra flags, data-parallel ranks (ep lies inside dp_shard), local batch
    "ep2": (2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"], 2, 1),
    "fsdp2_ep2": (4, ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.expert_parallel_degree", "2"], 4, 1),
    # torchtitan's DeepSeek-V3 debug layout: 2 pipeline ranks (V-shaped stages) x EP 2
    "pp2_ep2_dualpipev": (4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
                              "--parallelism.pipeline_parallel_schedule", "DualPipeV"], 2, 4),
    # ... with its selective 'op' checkpointing: DualPipeV's weight pass is a second backward per block
    "pp2_ep2_dualpipev_sac_op": (4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
                                     "--parallelism.pipeline_parallel_schedule", "DualPipeV",
                                     "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
                                 2, 4),
}


EP_CASES = [("deepseek_v3", layout) for layout in sorted(EP_LAYOUTS)] + [("qwen3_moe", "pp2_ep2_dualpipev"),
                                                                        ("gpt_oss", "ep2"), ("gpt_oss", "pp2_ep2_dualpipev"),
                                                                        ("llama4", "ep2"), ("llama4", "pp2_ep2_dualpipev")]


@pytest.mark.parametrize("family, layout", EP_CASES, ids=[f"{f}-{layout}" for f, layout in EP_CASES])
def test_expert_parallel_matches_single_process(tmp_path, single_process, family, layout):
    ranks, extra, dp, local = EP_LAYOUTS[layout]
    argv = [*BASE, *FAMILIES[family]]
    reference, reference_params = single_process(family, dp * local)
    per_rank = run_on_ranks(_train_rank, ranks, [*argv, *extra, "--job.dump_folder", str(tmp_path / layout),
                                                "--training.local_batch_size", str(local)])
    for history, _ in per_rank:
        for step, ref in zip(history, reference):
            assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5)
            assert step["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
            # each rank reports its own stages' layers; the pipeline's shape inference counts no tokens
            loads = {key: value for key, value in step.items() if key.startswith("moe/")}
            assert loads and loads == {key: ref[key] for key in loads}
    joined = {key: value for _, params in per_rank for key, value in params.items()}
    assert_params_close(joined, reference_params, ADAMW_ATOL, layout)


def test_forced_load_balance_gives_every_expert_the_same_load(tmp_path):
    history, _ = _train_rank(0, 1, [*BASE, *FAMILIES["deepseek_v3"], "--job.dump_folder", str(tmp_path),
                                    "--debug.moe_force_load_balance", "true", "--training.steps", "1"])
    loads = {key: value for key, value in history[-1].items() if key.startswith("moe/")}
    assert loads and all(value == 1.0 for key, value in loads.items() if key.endswith("/imbalance"))


def test_sequence_balance_loss_under_accumulation_equals_one_big_batch(tmp_path, monkeypatch, single_process):
    """DeepSeek-V3's sequence-wise balance loss (aux_loss_alpha) is scaled with the micro-batch
    loss (the family's set_loss_scale): 2 accumulated micro-batches equal one of twice the size."""
    import dataclasses

    from tessera.models import get_model_spec

    without, _ = single_process("deepseek_v3", 4)
    flavors = get_model_spec("deepseek_v3").flavors
    tiny = flavors["tiny"]
    monkeypatch.setitem(flavors, "tiny", dataclasses.replace(tiny, moe=dataclasses.replace(tiny.moe, aux_loss_alpha=0.5)))
    argv = [*BASE, *FAMILIES["deepseek_v3"]]
    big = train(load_config([*argv, "--job.dump_folder", str(tmp_path / "big"), "--training.local_batch_size", "4"]))
    accumulated = train(load_config([*argv, "--job.dump_folder", str(tmp_path / "acc"), "--training.local_batch_size", "2",
                                     "--training.global_batch_size", "4"]))
    assert big[0]["grad_norm"] != pytest.approx(without[0]["grad_norm"], rel=1e-3)  # the balance loss acts
    for x, y in zip(big, accumulated):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)


def test_a_resume_routing_other_micro_batches_under_a_capacity_says_so(tmp_path, capsys):
    """With a capacity, which slots an expert drops depends on the tokens a rank routes at once:
    a resume with the same global batch in other micro-batches differs from the run it continues,
    and says so."""
    argv = [*BASE, *FAMILIES["qwen3_moe"], "--parallelism.expert_capacity_factor", "1.0", "--checkpoint.enable", "true",
            "--checkpoint.interval", "1", "--job.dump_folder", str(tmp_path), "--lr_scheduler.total_steps", "2"]
    train(load_config([*argv, "--training.steps", "1", "--training.local_batch_size", "2"]))
    capsys.readouterr()
    train(load_config([*argv, "--training.steps", "2", "--training.local_batch_size", "1", "--training.global_batch_size", "2"]))
    out = capsys.readouterr().out
    assert "step-1's ranks routed 64 tokens at once, this run's 32, so other slots are dropped" in out
    assert "sequences x" not in out  # the same global batch
