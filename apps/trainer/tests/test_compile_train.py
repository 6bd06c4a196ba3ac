"""torch.compile (per-block regional compile, and the loss) under every layout, against the same
layout in eager mode: fp32 losses and grad norms within 1e-5 relative (inductor reorders float
sums; 1e-4 with float8). Also compile with full AC under FSDP, and selective AC, HSDP and float8
together, and the warm-up step reported apart from throughput. Eager layouts match one process in
test_distributed_train.

Backends: inductor where its code generation meets the layout (one process; TP's collectives inside
the graph; float8's scaling), aot_eager (dynamo + AOTAutograd, where tracing problems show) for the
others: a cold inductor compile of the debug model took 22 s against aot_eager's 3.4 s on CPU."""

import pytest
import torch

from tessera.mesh.testing import run_on_ranks
from tessera.trainer.config import load_config
from tessera.trainer.train import train

TOL = 1e-5
BASE = ["--training.seq_len", "32", "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1",
        "--training.steps", "2", "--lr_scheduler.warmup_steps", "1", "--training.local_batch_size", "2"]
INDUCTOR = {"single", "tp2", "ac_hsdp2x2_float8"}
LAYOUTS = {
    1: {"single": []},
    2: {"ac_fsdp2": ["--parallelism.data_parallel_shard_degree", "2", "--activation_checkpoint.mode", "full"],
        "tp2": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
        # two micro-batches of the single run's shape
        "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_microbatch_size", "2"]},
    4: {"fsdp2_tp2": ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
        # everything at once: selective AC, HSDP (replicas of 2-way FSDP shards), float8 (emulated here)
        # with its all-gather and precomputed scales
        "ac_hsdp2x2_float8": ["--activation_checkpoint.mode", "selective", "--model.converters", "float8",
                              "--float8.filter_fqns", "output", "--float8.enable_fsdp_float8_all_gather", "true",
                              "--float8.precompute_float8_dynamic_scale_for_fsdp", "true",
                              "--parallelism.data_parallel_replicate_degree", "2",
                              "--parallelism.data_parallel_shard_degree", "2"]},
}


def _eager_and_compiled(rank, world_size, dump):
    results = {}
    for name, extra in LAYOUTS[world_size].items():
        backend = "inductor" if name in INDUCTOR else "aot_eager"
        for mode, switch in (("eager", []), ("compiled", ["--compile.enable", "true", "--compile.backend", backend])):
            # a clean cache, as the layout's own training process has: over the previous layouts'
            # code (the blocks share one forward) dynamo recompiled pp2's blocks for any batch size
            torch._dynamo.reset()
            history = train(load_config([*BASE, *extra, *switch, "--job.dump_folder", f"{dump}/{name}_{mode}"]))
            results[name, mode] = history
    return results


def _check(results):
    for (name, mode), history in results.items():
        if mode == "eager":
            continue
        eager = [(h["loss"], h["grad_norm"]) for h in results[name, "eager"]]
        compiled = [(h["loss"], h["grad_norm"]) for h in history]
        print(f"{name}: eager {eager} compiled {compiled}")
        # float8 scales from amaxes: inductor's other rounding of the scaled values moves the
        # grad norm by ~1e-5 (measured 1.1e-5 under HSDP + full AC)
        tol = 10 * TOL if "float8" in name else TOL
        for got, want in zip(compiled, eager):
            assert got == pytest.approx(want, rel=tol), name
        assert history[0]["compile_warmup_s"] > 0 and all("compile_warmup_s" not in h for h in history[1:])


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_compiled_layouts_match_eager(tmp_path, world_size):
    if world_size == 1:
        _check(_eager_and_compiled(0, 1, str(tmp_path)))
    else:
        _check(run_on_ranks(_eager_and_compiled, world_size, str(tmp_path))[0])
