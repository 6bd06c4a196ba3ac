"""The trainer under context parallel on local gloo ranks, against its single-process run on the
same global batch: fp32 losses, grad norms and validation losses within 1e-5 relative, parameters
after the last step within 1e-5 absolute. Several runs share one set of processes to keep the
suite fast."""

import json

import pytest
from final_params import ADAMW_ATOL, assert_params_close, final_params

from tessera.mesh.testing import run_on_ranks
from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.plan import make_plan
from tessera.trainer.train import train

TOL = 1e-5
# two steps: a step, an update and a step on the updated weights, then validation on them
BASE = ["--training.seq_len", "32", "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1",
        "--training.steps", "2", "--lr_scheduler.warmup_steps", "1", "--model.flavor", "debugmodel",
        "--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "1"]
CP2 = ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
RING = ["--parallelism.context_parallel_rotate_method", "alltoall"]  # K/V passed rank to rank, not gathered once


def _numbers(history):
    return [(h["loss"], h["grad_norm"]) if "loss" in h else h["validation_loss"] for h in history]


def _run(argv):
    """(numbers, parameters this rank holds after the last step)."""
    with final_params() as params:
        numbers = _numbers(train(load_config(argv)))
    return numbers, params


def _runs(rank, world_size, runs):
    return {name: _run(argv) for name, argv in runs.items()}


def _check(results_by_rank, reference, params_atol=1e-5):
    """Every rank reports the reference numbers; parameters joined over the ranks (pipeline
    stages hold different ones) equal the reference's within `params_atol`."""
    ref_numbers, ref_params = reference
    for name in results_by_rank[0]:
        joined = {}
        for rank_results in results_by_rank:
            history, params = rank_results[name]
            assert len(history) == len(ref_numbers), name
            for got, want in zip(history, ref_numbers):
                assert got == pytest.approx(want, rel=TOL), name
            joined.update(params)
        assert_params_close(joined, ref_params, params_atol, name)


def _reference(tmp_path, local_batch, *extra):
    return _run([*BASE, *extra, "--training.local_batch_size", str(local_batch), "--job.dump_folder", str(tmp_path / "single")])


def test_cp2_with_and_without_load_balancing_both_rotations_matches_one_process(tmp_path):
    runs = {
        "cp2": [*BASE, *CP2, "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path / "cp2")],
        "cp2 contiguous": [*BASE, *CP2, "--training.local_batch_size", "2", "--parallelism.context_parallel_load_balancer",
                           "none", "--job.dump_folder", str(tmp_path / "contiguous")],
        "cp2 alltoall": [*BASE, *CP2, *RING, "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path / "ring")],
        "cp2 alltoall contiguous": [*BASE, *CP2, *RING, "--training.local_batch_size", "2",
                                    "--parallelism.context_parallel_load_balancer", "none", "--job.dump_folder", str(tmp_path / "ring1")],
    }
    _check(run_on_ranks(_runs, 2, runs), _reference(tmp_path, 2))


def test_block_causal_masks_under_cp2_and_tp2_match_one_process(tmp_path):
    short_documents = tmp_path / "short.jsonl"  # a few words each: every 32-token window packs several
    short_documents.write_text("".join(
        json.dumps({"text": f"note {i}: the {'quick' if i % 2 else 'lazy'} fox {'ran' * (i % 5)} at {i * 7}"}) + "\n"
        for i in range(400)))
    block = ["--model.attn_mask_type", "block_causal", "--training.dataset_path", str(short_documents),
             "--validation.dataset_path", str(short_documents)]
    reference = _reference(tmp_path, 2, *block)
    causal = _reference(tmp_path / "causal", 2, *block[2:])[0]
    # the masks change the numbers by far more than the parity tolerance below
    changes = [abs(masked[0] - plain[0]) for masked, plain in zip(reference[0], causal) if isinstance(plain, tuple)]
    assert max(changes) > 10 * TOL * causal[0][0], changes
    runs = {
        "cp2": [*BASE, *block, *CP2, "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path / "cp2")],
        "tp2": [*BASE, *block, "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path / "tp2")],
    }
    _check(run_on_ranks(_runs, 2, runs), reference)


def test_cp2_with_fsdp2_with_tp2_and_with_pp2_matches_one_process(tmp_path):
    # global batch 4: dp 2 x 2 sequences with FSDP, else 4 sequences on one data-parallel rank
    runs = {
        "fsdp2 cp2": [*BASE, "--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                      "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path / "fsdp")],
        "tp2 cp2": [*BASE, *CP2, "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4",
                    "--job.dump_folder", str(tmp_path / "tp")],
        "pp2 cp2": [*BASE, *CP2, "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                    "--job.dump_folder", str(tmp_path / "pp")],
        "fsdp2 cp2 alltoall": [*BASE, *RING, "--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                               "2", "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path / "fsdp_ring")],
    }
    _check(run_on_ranks(_runs, 4, runs), _reference(tmp_path, 4))


@pytest.mark.parametrize("extra, message", [
    (["--training.seq_len", "34"], r"seq_len 34 does not divide into 4 = 2 \* context_parallel_degree"),
    (["--parallelism.context_parallel_load_balancer", "ptrr"], "context_parallel_load_balancer: 'ptrr' is not one of"),
    (["--parallelism.context_parallel_rotate_method", "ring"], "context_parallel_rotate_method: 'ring' is not one of"),
    ([*RING, "--model.attn_mask_type", "block_causal"], "alltoall runs torch's ring on the flash kernel, which takes no document mask"),
])
def test_bad_context_parallel_configs_name_the_key(extra, message):
    with pytest.raises(ConfigError, match=message):
        make_plan(load_config([*BASE, *CP2, *extra]), 2, "cpu")


def test_the_kernel_follows_the_masks_and_the_device():
    """torch's ring on the flash kernel wherever it runs; all-gather-KV for document masks and for
    fp32 attention on CUDA, which the flash kernels do not take (alltoall there: one line)."""
    bf16 = ["--training.mixed_precision_param", "bfloat16"]

    def exchange(flags, device):
        return make_plan(load_config([*BASE, *CP2, *flags]), 2, device, check_only=True).attention.cp_exchange

    assert exchange([], "cpu") == "ring"
    assert exchange(bf16, "cuda") == "ring"
    assert exchange([], "cuda") == "gather"
    assert exchange(["--model.attn_mask_type", "block_causal"], "cpu") == "gather"
    plan = make_plan(load_config([*BASE, *CP2, "--model.attn_mask_type", "block_causal"]), 2, "cpu")
    assert plan.attention.describe() == "causal + document -> blocked | context parallel: all-gather-KV"
    with pytest.raises(ConfigError, match="on CUDA no fp32"):
        make_plan(load_config([*BASE, *CP2, *RING]), 2, "cuda")
    make_plan(load_config([*BASE, *CP2, *RING, *bf16]), 2, "cuda")


@pytest.mark.parametrize("flavor", ["tiny", "tiny_moe"])
def test_qwen3_dense_and_moe_under_cp2_and_fsdp2_match_one_process(tmp_path, flavor):
    """Qwen3's q/k norms act per head, so sharding the sequence leaves them whole; its MoE layers
    route each token alone. Parameters within ADAMW_ATOL (AdamW and rounding: final_params.py)."""
    qwen3 = ["--model.name", "qwen3", "--model.flavor", flavor]
    runs = {"cp2": [*BASE, *CP2, *qwen3, "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path / "cp2")],
            "fsdp2": [*BASE, *qwen3, "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "1",
                      "--job.dump_folder", str(tmp_path / "fsdp2")]}
    _check(run_on_ranks(_runs, 2, runs), _reference(tmp_path, 2, *qwen3), params_atol=ADAMW_ATOL)


def test_gpt_oss_windows_and_sinks_under_cp2_match_one_process(tmp_path):
    """GPT-OSS's layers all have sinks and every other one a window of 128 keys: context parallel
    runs them through the all-gather-KV exchange. The sequence (160) is longer than the window, so
    the second rank's queries see keys of the first rank's shard up to the window's start only."""
    gpt_oss = ["--model.name", "gpt_oss", "--model.flavor", "tiny", "--training.seq_len", "160"]
    plan = make_plan(load_config([*BASE, *CP2, *gpt_oss]), 2, "cpu")
    assert plan.attention.describe().endswith("| context parallel: all-gather-KV")
    runs = {"cp2": [*BASE, *CP2, *gpt_oss, "--training.local_batch_size", "1", "--job.dump_folder", str(tmp_path / "cp2")]}
    _check(run_on_ranks(_runs, 2, runs), _reference(tmp_path, 1, *gpt_oss), params_atol=ADAMW_ATOL)


def test_llama4_chunks_and_nope_temperature_under_cp2_match_one_process(tmp_path):
    """Llama 4's chunked RoPE layers (chunks of 32) and its global NoPE layer, whose queries the
    positions scale: with CP 2 on 64 tokens (load-balanced halves) each rank's queries take their
    own positions' rotations and temperatures, and the chunks cross the ranks' shards."""
    llama4 = ["--model.name", "llama4", "--model.flavor", "tiny", "--training.seq_len", "64"]
    plan = make_plan(load_config([*BASE, *CP2, *llama4]), 2, "cpu")
    assert plan.attention.describe().endswith("| context parallel: all-gather-KV")
    runs = {"cp2": [*BASE, *CP2, *llama4, "--training.local_batch_size", "1", "--job.dump_folder", str(tmp_path / "cp2")]}
    _check(run_on_ranks(_runs, 2, runs), _reference(tmp_path, 1, *llama4), params_atol=ADAMW_ATOL)
