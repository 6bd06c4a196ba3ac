"""GPT-OSS through the trainer and its checkpoint library: the debug flavor's windowed and full
layers with sinks get the blocked kernel on CPU and the loss is finite and falls in one process
(expert loads, the router's bias and the family's layouts: test_moe_train.py and
test_moe_tp_train.py); a checkpoint whose experts are MXFP4, as the released ones, streams in
(blocks and scales from different shard files) equal to transformers' own dequantisation, and the
trainer loads it with checkpoint.initial_load_in_hf_quantized (refused in one line where it does not
fit the checkpoint or the family)."""

import json
import math

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tessera.ckpt import import_hf, save_hf
from tessera.models import get_model_spec
from tessera.trainer.checkpointing import Checkpointer
from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.main import main as trainer_main
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


def _released_layout(folder, mxfp4: bool = True) -> dict[str, torch.Tensor]:
    """The tiny flavor's weights saved as the released checkpoints are (sharded; with `mxfp4`, the
    experts as MXFP4 blocks + scales, a pair split over two files); returns the model tensors
    transformers' own dequantisation gives the experts."""
    spec = get_model_spec("gpt_oss")
    args = spec.flavors["tiny"]
    hf = spec.hf_adapter.to_hf(spec.build(args).state_dict(), args)
    generator, want = torch.Generator().manual_seed(0), {}
    for key in [key for key in hf if mxfp4 and key.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        n_experts, n_in, n_out = hf.pop(key).shape  # MXFP4 holds [E, out, in / 32, 16] bytes, [E, out, in / 32] scales
        blocks = torch.randint(0, 256, (n_experts, n_out, n_in // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(118, 128, (n_experts, n_out, n_in // 32), dtype=torch.uint8, generator=generator)
        hf[f"{key}_blocks"], hf[f"{key}_scales"] = blocks, scales
        want[key.replace("model.layers", "layers").replace("mlp.experts", "moe.experts")] = convert_moe_packed_tensors(
            blocks, scales).float()
    save_hf(hf, folder, max_shard_bytes=300_000)
    files = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert not mxfp4 or any(files[f"{key}_blocks"] != files[f"{key}_scales"] for key in
                            (name.removesuffix("_blocks") for name in files if name.endswith("_blocks")))
    return want


def test_mxfp4_experts_stream_in_as_transformers_dequantises_them(tmp_path):
    spec = get_model_spec("gpt_oss")
    args = spec.flavors["tiny"]
    want = _released_layout(tmp_path)
    model = spec.build(args)
    import_hf(model, tmp_path, lambda state_dict: spec.hf_adapter.from_hf(state_dict, args))
    state = model.state_dict()
    for key, value in want.items():
        assert torch.equal(state[key], value), key


def _quantized_run(folder, dump, quantized: bool) -> list[str]:
    return [*ARGV[:4], "--training.seq_len", "32", "--training.steps", "1", "--lr_scheduler.warmup_steps", "1",
            "--job.dump_folder", str(dump),
            "--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", str(folder),
            "--checkpoint.initial_load_in_hf_quantized", str(quantized).lower()]


def test_initial_load_in_hf_quantized_trains_from_mxfp4_experts(tmp_path, monkeypatch):
    """torchtitan's checkpoint.initial_load_in_hf_quantized: the released MXFP4 experts load
    dequantised as transformers dequantises them, and the run trains from there."""
    want, loaded, restore = _released_layout(tmp_path / "hf"), {}, Checkpointer.restore

    def restore_and_capture(self):
        step = restore(self)
        loaded.update({key: value.clone() for key, value in self.parts[0].state_dict().items() if key in want})
        return step

    monkeypatch.setattr(Checkpointer, "restore", restore_and_capture)
    losses = [step["loss"] for step in train(load_config(_quantized_run(tmp_path / "hf", tmp_path / "run", True)))]
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[key], want[key]) for key in want)
    assert math.isfinite(losses[0])


def test_initial_load_in_hf_quantized_is_checked_before_the_run(tmp_path, capsys):
    """A quantized checkpoint needs the key, the key without quantized weights is a warning, and a
    family whose adapter dequantises nothing refuses it: one line each, before any rank starts."""
    _released_layout(tmp_path / "mxfp4")
    with pytest.raises(ConfigError, match=r"^checkpoint.initial_load_path .*mxfp4 holds 8 quantized weights "
                       r"\(model.layers.0.mlp.experts.gate_up_proj_blocks \+ _scales, MXFP4\): set "
                       r"checkpoint.initial_load_in_hf_quantized = true to dequantise them on load$"):
        make_plan(load_config(_quantized_run(tmp_path / "mxfp4", tmp_path / "run", False)), 1, "cpu")
    _released_layout(tmp_path / "bf16", mxfp4=False)
    assert make_plan(load_config(_quantized_run(tmp_path / "bf16", tmp_path / "run", True)), 1, "cpu").warnings == (
        f"checkpoint.initial_load_in_hf_quantized is set, but checkpoint.initial_load_path {tmp_path / 'bf16'} holds "
        "no quantized weights: they load as stored",)
    argv = _quantized_run(tmp_path / "bf16", tmp_path / "run", True)
    assert trainer_main([*argv, "--model.name", "llama4"]) == 2
    assert capsys.readouterr().err == ("error: checkpoint.initial_load_in_hf_quantized: model llama4 cannot load "
                                       "quantized Hugging Face weights (its adapter dequantises no format); load a "
                                       "bf16/fp32 checkpoint\n")
