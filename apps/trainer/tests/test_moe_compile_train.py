"""torch.compile where the job plan refused it before issue 34: MoE layers under tensor parallel,
context parallel (torch's ring and the all-gather-KV exchange), expert parallel and in a
pipeline's stages, dropless and with a capacity factor, each compiled run against the same layout
in eager mode (fp32: losses and grad norms within 1e-5 relative). One spawn of 2 ranks runs every case.

Backends: aot_eager (dynamo + AOTAutograd: where tracing problems show, cheaply) for all but one
case, which runs inductor (code generation too; the custom ops' shape functions must then match
their outputs' layouts, which aot_eager does not check). Eager layouts match one process in
test_moe_tp_train, test_context_parallel_train and test_moe_train."""

import pytest
import torch

from tessera.mesh.testing import run_on_ranks
from tessera.trainer.config import load_config
from tessera.trainer.train import train

TOL = 1e-5
BASE = ["--training.seq_len", "32", "--metrics.log_freq", "1", "--training.steps", "2", "--lr_scheduler.warmup_steps", "1",
        "--training.local_batch_size", "2"]
DEEPSEEK = ["--model.name", "deepseek_v3", "--model.flavor", "tiny"]
QWEN3_MOE = ["--model.name", "qwen3", "--model.flavor", "tiny_moe"]
TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
CP2 = ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
EP2 = ["--parallelism.expert_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
CAPACITY = ["--parallelism.expert_capacity_factor", "1.0"]
CASES = {
    "qwen3_moe_tp2_dropless": [*QWEN3_MOE, *TP2],
    "deepseek_tp2_capacity_reroute": [*DEEPSEEK, *TP2, *CAPACITY, "--parallelism.expert_capacity_overflow", "reroute"],
    "qwen3_moe_cp2_ring_dropless": [*QWEN3_MOE, *CP2],
    "llama3_cp2_documents": [*CP2, "--model.attn_mask_type", "block_causal"],  # all-gather-KV
    "deepseek_ep2_capacity": [*DEEPSEEK, *EP2, *CAPACITY],
    "deepseek_pp2_dropless": [*DEEPSEEK, *PP2],  # each stage's blocks compiled, the dense one and the MoE ones
}
INDUCTOR = {"qwen3_moe_cp2_ring_capacity_inductor": [*QWEN3_MOE, *CP2, *CAPACITY]}


def _eager_and_compiled(rank, world_size, dump):
    results = {}
    for name, extra in {**CASES, **INDUCTOR}.items():
        backend = "inductor" if name in INDUCTOR else "aot_eager"
        for mode, switch in (("eager", []), ("compiled", ["--compile.enable", "true", "--compile.backend", backend])):
            # a clean cache, as the case's own training process has: the families' blocks share one
            # forward, which over the earlier cases' code dynamo recompiled with dynamic shapes (sequence
            # length, top-k, eps), at 2-4x the compile time
            torch._dynamo.reset()
            results[name, mode] = train(load_config([*BASE, *extra, *switch, "--job.dump_folder", f"{dump}/{name}_{mode}"]))
    return results


def test_moe_tp_cp_ep_compile_like_eager(tmp_path):
    results = run_on_ranks(_eager_and_compiled, 2, str(tmp_path))[0]
    for name in {**CASES, **INDUCTOR}:
        eager = [(h["loss"], h["grad_norm"]) for h in results[name, "eager"]]
        compiled = [(h["loss"], h["grad_norm"]) for h in results[name, "compiled"]]
        print(f"{name}: eager {eager} compiled {compiled}")
        for got, want in zip(compiled, eager):
            assert got == pytest.approx(want, rel=TOL), name
        assert "compile_warmup_s" in results[name, "compiled"][0], name  # the blocks were compiled
        dropped = {k: v for k, v in results[name, "compiled"][-1].items() if k.endswith("/dropped")}
        assert bool(dropped) == ("capacity" in name), name  # the capacity runs report what they dropped
