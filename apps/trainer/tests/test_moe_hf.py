"""Hugging Face round trip of the MoE families through the trainer: DeepSeek-V3, Qwen3-MoE,
GPT-OSS and Llama 4 runs under EP 2 (FSDP 2 beside it) export their experts in HF's layout at
their last step; fresh runs importing that folder (initial_load_in_hf) under EP 2, FSDP 2 x EP 2
(DeepSeek-V3), and on one process with the architecture read from its config.json (model.flavor
from_hf_config), start from exactly the exported parameters and give the exporter's logits:
bitwise under the same layout, within 1e-5 absolute otherwise (fp32, logits up to ~4.4; measured
up to 1.2e-6: only the kernels' reduction order differs).
Only DeepSeek-V3's HF format has a router bias; the others' importers start it at zero and are
compared with the exporter's logits without it. A model no config.json can describe fails the job
plan when it would be exported."""

import dataclasses

import pytest
import torch
from torch.distributed.tensor import DTensor

from tessera.ckpt import load_hf
from tessera.mesh.testing import run_on_ranks
from tessera.models import get_model_spec
from tessera.trainer.checkpointing import Checkpointer
from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.plan import make_plan
from tessera.trainer.train import train

torch.set_num_threads(1)

BASE = ["--training.seq_len", "32", "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "1",
        "--metrics.log_freq", "1"]
EP2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2",
       "--training.local_batch_size", "1"]
FAMILIES = {  # flags, whether the HF format keeps the router bias
    "deepseek_v3": (["--model.name", "deepseek_v3", "--model.flavor", "tiny"], True),
    "qwen3_moe": (["--model.name", "qwen3", "--model.flavor", "tiny_moe"], False),
    "gpt_oss": (["--model.name", "gpt_oss", "--model.flavor", "tiny"], False),
    "llama4": (["--model.name", "llama4", "--model.flavor", "tiny"], False),
}
# The HF tensors layer 1's experts export to, from Tessera's (per-expert tensors: DeepSeek-V3, Qwen3-MoE;
# GPT-OSS's stacked [E, dim, 2 hidden] with gate/up interleaved, as Tessera holds them; Llama 4's fused
# [E, dim, 2 hidden], gate then up)
PER_EXPERT = {f"model.layers.1.mlp.experts.{e}.gate_proj.weight": (lambda s, e=e: s["layers.1.moe.experts.w1"][e])
              for e in range(8)}
EXPERT_TENSORS = {
    "deepseek_v3": PER_EXPERT, "qwen3_moe": PER_EXPERT,
    "gpt_oss": {"model.layers.1.mlp.experts.gate_up_proj": lambda s: s["layers.1.moe.experts.gate_up_proj"]},
    "llama4": {"model.layers.1.feed_forward.experts.gate_up_proj": lambda s: torch.cat(
        [s["layers.1.moe.experts.w1"].transpose(1, 2), s["layers.1.moe.experts.w3"].transpose(1, 2)], dim=-1)},
}
TOKENS = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))


def _state_and_logits(parts, keep_router_bias=True):
    """Full copies of the model's parameters and buffers, and its logits on TOKENS (eval mode,
    so the forward counts no expert load); optionally as if every router bias were zero."""
    model = parts[0]
    state = {key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
             for key, value in model.state_dict().items()}
    biases = {name: buffer.clone() for name, buffer in model.named_buffers() if name.endswith("expert_bias")}
    with torch.no_grad():
        if not keep_router_bias:
            for name in biases:
                model.get_buffer(name).zero_()
        model.eval()
        logits = model(TOKENS)
        model.train()
        for name, bias in biases.items():
            model.get_buffer(name).copy_(bias)
    return state, logits


def _runs(rank, world_size, runs):
    """train() for each (argv, keep_router_bias): the state and logits the exporter had at its
    export, or the importer right after loading; rank 0 returns them."""
    captured, restore, export = [], Checkpointer.restore, Checkpointer._export_hf

    def restore_and_capture(self):
        step = restore(self)
        if self.initial is not None:
            captured.append(_state_and_logits(self.parts))
        return step

    results = []
    for argv, keep_bias in runs:
        def capture_then_export(self, step):
            captured.append(_state_and_logits(self.parts, keep_bias))
            export(self, step)

        Checkpointer.restore, Checkpointer._export_hf = restore_and_capture, capture_then_export
        try:
            captured.clear()
            train(load_config(argv))
            results.append(captured[0])
        finally:
            Checkpointer.restore, Checkpointer._export_hf = restore, export
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per family: the EP 2 exporter (2 steps), the EP 2 importer (same spawn), and the one-process
    importer, which takes the architecture from the export's config.json (flavor from_hf_config)."""
    tmp = tmp_path_factory.mktemp("moe_hf")
    sharded = []
    for family, (flags, keep_bias) in FAMILIES.items():
        export = [*BASE, *flags, *EP2, "--training.steps", "2", "--job.dump_folder", str(tmp / family / "export"),
                  "--checkpoint.enable", "true", "--checkpoint.last_save_in_hf", "true"]
        sharded += [(export, keep_bias), (_import_argv(tmp, family, "ep2", EP2), keep_bias)]
    results = iter(run_on_ranks(_runs, 2, sharded)[0])
    out = {}
    for family, (flags, keep_bias) in FAMILIES.items():
        exported, ep2 = next(results), next(results)
        # the architecture from the export's config.json, the weights from its folder (model.hf_assets_path)
        folder = tmp / family / "export" / "checkpoint" / "step-2-hf"
        single_argv = [*BASE, "--model.name", flags[1], "--model.flavor", "from_hf_config", "--model.hf_assets_path",
                       str(folder), "--training.local_batch_size", "2", "--training.steps", "1",
                       "--job.dump_folder", str(tmp / family / "single"), "--checkpoint.initial_load_in_hf", "true"]
        single, = _runs(0, 1, [(single_argv, keep_bias)])
        out[family] = (folder, exported, ep2, single)
    return out


def _import_argv(tmp, family, layout, flags):
    return [*BASE, *FAMILIES[family][0], *flags, "--training.steps", "1", "--job.dump_folder", str(tmp / family / layout),
            "--checkpoint.initial_load_in_hf", "true",
            "--checkpoint.initial_load_path", str(tmp / family / "export" / "checkpoint" / "step-2-hf")]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_writes_the_experts_in_hf_s_layout(runs, family):
    folder, (exported, _), _, _ = runs[family]
    hf = load_hf(folder)
    for name, tessera in EXPERT_TENSORS[family].items():
        assert torch.equal(hf[name], tessera(exported)), name
    assert not any(".moe." in key or key.endswith("experts.w1") or "expert_bias" in key for key in hf)
    assert ("model.layers.1.mlp.gate.e_score_correction_bias" in hf) == FAMILIES[family][1]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_under_ep2_and_one_process_gives_the_exported_model(runs, family):
    _, (exported, logits), (ep2, ep2_logits), (single, single_logits) = runs[family]
    keep_bias = FAMILIES[family][1]
    biases = [key for key in exported if key.endswith("expert_bias")]
    assert biases and all(exported[key].abs().sum() > 0 for key in biases)  # trained: nonzero, so the check bites
    for layout, state in (("ep2", ep2), ("single", single)):
        assert state.keys() == exported.keys(), layout
        for key, value in exported.items():
            want = value if keep_bias or not key.endswith("expert_bias") else torch.zeros_like(value)
            assert torch.equal(state[key], want), f"{layout}: {key}"
    assert torch.equal(ep2_logits, logits)
    torch.testing.assert_close(single_logits, logits, rtol=0, atol=1e-5)


def test_deepseek_v3_import_under_fsdp2_ep2_gives_the_exported_model(runs, tmp_path):
    """FSDP over EP: each rank holds a strided slice of the experts (_StridedShard then Shard)."""
    folder, (exported, logits), _, _ = runs["deepseek_v3"]
    argv = [*BASE, *FAMILIES["deepseek_v3"][0], "--parallelism.data_parallel_shard_degree", "4",
            "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "1", "--training.steps", "1",
            "--job.dump_folder", str(tmp_path), "--checkpoint.initial_load_in_hf", "true",
            "--checkpoint.initial_load_path", str(folder)]
    (state, fsdp2_ep2_logits), = run_on_ranks(_runs, 4, [(argv, True)])[0]
    assert state.keys() == exported.keys()
    for key, value in exported.items():
        assert torch.equal(state[key], value), key
    torch.testing.assert_close(fsdp2_ep2_logits, logits, rtol=0, atol=1e-5)


def test_an_export_hf_cannot_describe_is_refused_by_the_job_plan(tmp_path, monkeypatch):
    spec = get_model_spec("qwen3")
    moe = spec.flavors["tiny_moe"]
    monkeypatch.setitem(spec.flavors, "shared", dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, n_shared_experts=1)))
    argv = [*BASE, "--model.name", "qwen3", "--model.flavor", "shared", "--job.dump_folder", str(tmp_path)]
    make_plan(load_config(argv), 1, "cpu")  # no export: nothing to describe
    with pytest.raises(ConfigError, match="^Qwen3-MoE's config.json cannot express this routing"):
        make_plan(load_config([*argv, "--checkpoint.enable", "true", "--checkpoint.last_save_in_hf", "true"]), 1, "cpu")
