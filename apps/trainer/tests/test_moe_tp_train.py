"""Tensor parallel (with sequence and loss parallel) for the Qwen3, DeepSeek-V3 and GPT-OSS families:
QK-norm on local heads (Qwen3), MLA's latent projections run whole on every rank (DeepSeek-V3),
biased projections, sinks split with the heads and experts whose down bias each rank adds its
share of (GPT-OSS), and the MoE layer with its experts split on hidden features match the
single-process run at TP 2 (each family), FSDP 2 x TP 2, PP 2 x TP 2 and with expert parallel, TP 2 x EP 2 (experts
split over both) and TP 2 x EP 4 (expert_tensor_parallel_degree 1) (DeepSeek-V3); fp32: losses and grad norms
within 1e-5 relative, parameters within 2e-5 absolute as for Llama's TP layouts (the sharded
matmuls sum in another order); expert loads count every token once.

The learning rate is 3e-4: at the default 8e-4 Qwen3's third step is a spike (grad norm 8 -> 21)
where 1e-7 rounding differences grow to 2e-5, between two single-process runs too (in-process
vs a spawned one-thread worker: 7.5e-6). AdamW's normalised steps would hide a gradient off by a
constant factor, so a second test compares every gradient of one step directly."""

import functools

import pytest
import torch
from final_params import assert_params_close, final_params
from torch.distributed.tensor import DTensor

from tessera.mesh import build_meshes
from tessera.mesh.testing import run_on_ranks
from tessera.trainer.config import load_config
from tessera.trainer.parallelize import build_parallel_model
from tessera.trainer.plan import make_plan
from tessera.trainer.step import build_loss, plain_forward_backward
from tessera.trainer.train import train

STEPS = 2  # a step, an update and a step on the updated weights
BASE = ["--training.seq_len", "32", "--metrics.log_freq", "1", "--training.steps", str(STEPS),
        "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "3e-4"]
FAMILIES = {"qwen3": ["--model.name", "qwen3", "--model.flavor", "tiny"],
            "qwen3_moe": ["--model.name", "qwen3", "--model.flavor", "tiny_moe"],
            "deepseek_v3": ["--model.name", "deepseek_v3", "--model.flavor", "tiny"],
            "gpt_oss": ["--model.name", "gpt_oss", "--model.flavor", "tiny"],
            "llama4": ["--model.name", "llama4", "--model.flavor", "tiny"]}
LAYOUTS = {  # ranks, flags, data-parallel ranks
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"], 1),
    "fsdp2_tp2": (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"], 2),
    "pp2_tp2": (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                    "--parallelism.pipeline_parallel_degree", "2"], 1),
    # expert_tensor_parallel_degree = tp: each expert split over tp, the experts over ep (inside dp_shard)
    "tp2_ep2": (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                    "--parallelism.expert_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2"], 2),
    # expert_tensor_parallel_degree = 1: the ep group is dp_shard x tp, experts whole, tokens split over tp
    "tp2_ep4_etp1": (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                         "--parallelism.expert_parallel_degree", "4", "--parallelism.expert_tensor_parallel_degree", "1"], 2),
}
CASES = [("qwen3", "tp2"), ("qwen3_moe", "tp2"), ("deepseek_v3", "tp2"), ("deepseek_v3", "fsdp2_tp2"),
         ("deepseek_v3", "pp2_tp2"), ("deepseek_v3", "tp2_ep2"), ("deepseek_v3", "tp2_ep4_etp1"), ("gpt_oss", "tp2"),
         ("llama4", "tp2")]


def _train_rank(rank, world_size, argv):
    with final_params() as params:
        history = train(load_config(argv))
    return history, params


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """single_process(family, global_batch): the single-process run's (history, parameters), run
    once per module for each pair (several layouts share a reference) and never changed by the tests."""
    @functools.cache
    def run(family, batch):
        dump = tmp_path_factory.mktemp(f"single_{family}_{batch}")
        return run_on_ranks(  # one thread, as each rank: the same summation order anywhere
            _train_rank, 1, [*BASE, *FAMILIES[family], "--job.dump_folder", str(dump),
                             "--training.local_batch_size", str(batch)])[0]

    return run


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-{layout}" for f, layout in CASES])
def test_tensor_parallel_matches_single_process(tmp_path, single_process, family, layout):
    ranks, extra, dp = LAYOUTS[layout]
    argv = [*BASE, *FAMILIES[family]]
    reference, reference_params = single_process(family, 2 * dp)
    per_rank = run_on_ranks(_train_rank, ranks, [*argv, *extra, "--job.dump_folder", str(tmp_path / layout),
                                                "--training.local_batch_size", "2"])
    for history, _ in per_rank:
        assert len(history) == STEPS
        for step, ref in zip(history, reference):
            assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5)
            assert step["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
            loads = {key: value for key, value in step.items() if key.startswith("moe/")}
            assert loads == {key: ref[key] for key in loads}  # a pipeline rank reports its own stages' layers
    reported = {key for history, _ in per_rank for key in history[-1] if key.startswith("moe/")}
    assert reported == {key for key in reference[-1] if key.startswith("moe/")}
    joined = {key: value for _, params in per_rank for key, value in params.items()}  # pipeline: each rank its stages
    assert_params_close(joined, reference_params, 2e-5, f"{family} {layout}")


def _gradients(rank, world_size, argv):
    """Every parameter's whole gradient after one forward and backward on a fixed batch."""
    plan = make_plan(load_config(argv), world_size, "cpu")
    torch.manual_seed(0)
    model = build_parallel_model(plan, build_meshes(plan.dims, "cpu") if world_size > 1 else None, build_loss(plan)).parts[0]
    tokens = torch.randint(0, plan.model_args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    plain_forward_backward(model, build_loss(plan), plan)(tokens[:, :-1], tokens[:, 1:])
    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tensor_parallel_gradients_match_single_process(tmp_path, family):
    """Each parameter's gradient, replicated ones (QK-norm, MLA latents, router) included, within
    1e-5 of its largest entry."""
    argv = [*BASE, *FAMILIES[family], "--job.dump_folder", str(tmp_path), "--training.local_batch_size", "2"]
    reference = run_on_ranks(_gradients, 1, argv)[0]
    got = run_on_ranks(_gradients, 2, [*argv, *LAYOUTS["tp2"][1]])[0]
    assert got.keys() == reference.keys()
    for name, want in reference.items():
        worst, scale = (got[name] - want).abs().max().item(), want.abs().max().item()
        assert worst <= 1e-5 * scale, f"{name}: off by {worst:.3g}, largest entry {scale:.3g}"
