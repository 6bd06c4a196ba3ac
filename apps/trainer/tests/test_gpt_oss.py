"""GPT-OSS through the trainer and its checkpoint library: the debug flavor's windowed and full
layers with sinks get the blocked kernel on CPU and the loss is finite and falls in one process
(expert loads, the router's bias and the family's layouts: test_moe_train.py and
test_moe_tp_train.py); a checkpoint whose experts are MXFP4, as the released ones, streams in
(blocks and scales from different shard files) equal to transformers' own dequantisation."""

import json
import math

import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tessera.ckpt import import_hf, save_hf
from tessera.models import get_model_spec
from tessera.trainer.config import load_config
from tessera.trainer.plan import make_plan
from tessera.trainer.train import train

ARGV = ["--model.name", "gpt_oss", "--model.flavor", "tiny", "--training.seq_len", "32", "--training.steps", "6",
        "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "3e-3"]


def test_debug_flavor_learns_in_one_process(tmp_path):
    argv = [*ARGV, "--job.dump_folder", str(tmp_path)]
    assert make_plan(load_config(argv), 1, "cpu").attention.describe() == \
        "causal + window 128 + sinks -> blocked; causal + sinks -> blocked"
    losses = [step["loss"] for step in train(load_config(argv))]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] - 0.5, losses


def test_mxfp4_experts_stream_in_as_transformers_dequantises_them(tmp_path):
    spec = get_model_spec("gpt_oss")
    args = spec.flavors["tiny"]
    hf = spec.hf_adapter.to_hf(spec.build(args).state_dict(), args)
    generator, want = torch.Generator().manual_seed(0), {}
    for key in [key for key in hf if key.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        n_experts, n_in, n_out = hf.pop(key).shape  # MXFP4 holds [E, out, in / 32, 16] bytes, [E, out, in / 32] scales
        blocks = torch.randint(0, 256, (n_experts, n_out, n_in // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(118, 128, (n_experts, n_out, n_in // 32), dtype=torch.uint8, generator=generator)
        hf[f"{key}_blocks"], hf[f"{key}_scales"] = blocks, scales
        want[key.replace("model.layers", "layers").replace("mlp.experts", "moe.experts")] = convert_moe_packed_tensors(
            blocks, scales)
    save_hf(hf, tmp_path, max_shard_bytes=300_000)
    files = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(files[f"{key}_blocks"] != files[f"{key}_scales"] for key in
               (name.removesuffix("_blocks") for name in files if name.endswith("_blocks")))  # a pair split over files
    model = spec.build(args)
    import_hf(model, tmp_path, lambda state_dict: spec.hf_adapter.from_hf(state_dict, args))
    state = model.state_dict()
    for key, value in want.items():
        assert torch.equal(state[key], value.float()), key
