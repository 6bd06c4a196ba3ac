"""The estimator against real CPU steps of the trainer (tessera.mesh.testing.run_on_ranks), one
layout table measured in one set of processes per world size: model state bytes exact, the peak
within 5 % (each pair printed). Its own target: the real runs are the slowest part of the
estimator's tests, which run beside them."""

from __future__ import annotations

import collections

import pytest

from tessera.mesh.testing import run_on_ranks
from tessera.trainer.config import load_config
from tessera.trainer.plan import make_plan

import estimate
import traced
from measure import measure_rank

BASE = ["--training.seq_len", "128", "--training.local_batch_size", "4"]
_ROUND_ROBIN = ["--debug.moe_force_load_balance", "true"]
LAYOUTS = {  # name: (world size, degrees)
    "single": (1, []),
    "fsdp2": (2, []),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    "fsdp2_tp2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    # FSDP holds whole gradients between reductions: a pipeline's every backward, accumulation's micro-batches
    "pp2_fsdp2": (4, ["--parallelism.pipeline_parallel_degree", "2"]),
    "fsdp2_accum2": (2, ["--training.global_batch_size", "16"]),
    "fsdp2_accum2_reduce_every": (2, ["--training.global_batch_size", "16", "--parallelism.fsdp_reduce_every_microbatch", "true"]),
    # and under TP, where the vocab-parallel embedding's held gradient is the whole vocabulary's
    "fsdp2_tp2_accum2": (4, ["--parallelism.tensor_parallel_degree", "2", "--training.global_batch_size", "16"]),
    "cp2": (2, ["--parallelism.context_parallel_degree", "2"]),  # torch's ring (allgather), FSDP over the cp ranks
    # the chunked loss (training.loss_chunk_size) under loss parallel: no whole logits, the hidden states gathered
    "tp2_chunked_loss": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                             "--training.loss_chunk_size", "128"]),
    # Muon: one momentum per matrix it steps, AdamW's two moments for the rest; the owner's whole matrices
    "muon_fsdp2": (2, ["--optimizer.name", "Muon"]),
    "qwen3_fsdp2": (2, ["--model.name", "qwen3", "--model.flavor", "tiny"]),  # traced only: no closed form
    # MoE, traced only, with the balanced routing the trace assumes (routing.py) made real by round-robin routing:
    # expert parallel over the FSDP ranks (MLA, shared experts, sigmoid scores), and over FSDP x TP with the tp ranks
    # splitting the rows among them (the experts on the (ep, tp) mesh)
    "deepseek_v3_ep2": (2, ["--model.name", "deepseek_v3", "--model.flavor", "tiny", *_ROUND_ROBIN,
                            "--parallelism.expert_parallel_degree", "2"]),
    "qwen3_moe_ep2_tp2": (4, ["--model.name", "qwen3", "--model.flavor", "tiny_moe", *_ROUND_ROBIN,
                              "--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
}
STATE = ("params", "grads", "optimizer")


# Both AC modes where the layout changes what AC keeps (sharded, TP's sequence-parallel
# activations); a pipeline's stages under full AC (the in-flight micro-batches); the rest
# without AC, where activations are largest against the state they add.
BOTH_MODES = {"single", "fsdp2", "tp2", "fsdp2_tp2"}


def _modes(layout: str) -> list[str]:
    return ["none", "full"] if layout in BOTH_MODES else ["full"] if layout.startswith("pp2") else ["none"]


def _measure_layouts(rank: int, world_size: int, layouts: list[str]) -> list[list[dict]]:
    """Each layout's real steps under each of its AC modes, in one set of processes (spawning and
    importing dominated the test's time when each layout started its own)."""
    return [[measure_rank(rank, world_size, [*BASE, *LAYOUTS[name][1], "--activation_checkpoint.mode", mode])
             for mode in _modes(name)] for name in layouts]


@pytest.fixture(scope="module")
def measured() -> dict[str, list[list[dict]]]:
    """layout -> [rank][mode] real bytes, every layout of a world size measured together."""
    by_world = collections.defaultdict(list)
    for name, (world, _) in LAYOUTS.items():
        by_world[world].append(name)
    out = {}
    for world, names in by_world.items():
        per_rank = [_measure_layouts(0, 1, names)] if world == 1 else run_on_ranks(_measure_layouts, world, names)
        out.update({name: [rank[i] for rank in per_rank] for i, name in enumerate(names)})
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_state_exact_and_peak_within_5_percent(layout, measured):
    """Per rank role: state bytes exact (trace and formula); the peak (a pipeline stage's from the
    formula's activations over the traced state, estimate.estimate) within 5 % of the real step's."""
    world, degrees = LAYOUTS[layout]
    with traced.shared_meshes():  # the AC modes' traces over one set of meshes (DTensor's caches kept)
        reports = [estimate.estimate(make_plan(load_config([*BASE, *degrees, "--activation_checkpoint.mode", mode]), world,
                                               "cpu", check_only=True)) for mode in _modes(layout)]
    for m, (mode, report) in enumerate(zip(_modes(layout), reports)):
        for role in report["roles"]:
            est, real = role["traced"], measured[layout][role["ranks"][0]][m]
            assert {k: est[k] for k in STATE} == {k: real[k] for k in STATE}
            assert "formula" not in role or {k: role["formula"][k] for k in STATE} == {k: real[k] for k in STATE}
            error = est["peak"] / real["peak"] - 1
            print(f"{layout} AC {mode} rank {role['ranks'][0]}: peak estimated {est['peak']:,} B, "
                  f"measured {real['peak']:,} B ({error:+.2%})")
            assert abs(error) < 0.05
