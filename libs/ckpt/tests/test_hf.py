"""Hugging Face safetensors files: single and sharded layouts, and their errors."""

import json

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from tessera.ckpt import export_hf, load_hf, save_hf


def _state_dict():
    torch.manual_seed(0)
    embed = torch.randn(10, 4)
    return {
        "model.embed_tokens.weight": embed,
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4).t(),  # not contiguous
        "model.layers.0.input_layernorm.weight": torch.ones(4, dtype=torch.bfloat16),
        "model.norm.weight": torch.ones(4),
        "lm_head.weight": embed,  # tied: shares memory
    }


def _assert_same(a, b):
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_single_file_round_trip(tmp_path):
    save_hf(_state_dict(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    _assert_same(_state_dict(), load_hf(tmp_path))


def test_sharded_round_trip_with_index(tmp_path):
    save_hf(_state_dict(), tmp_path, max_shard_bytes=100)  # shards of 160, 64 + 8 + 16, 160 bytes
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)] + ["model.safetensors.index.json"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 160 + 64 + 8 + 16 + 160
    assert index["weight_map"]["model.norm.weight"] == "model-00002-of-00003.safetensors"
    _assert_same(_state_dict(), load_hf(tmp_path))


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="folder .*absent does not exist"):
        load_hf(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="holds neither model.safetensors nor model.safetensors.index.json"):
        load_hf(tmp_path)

    save_hf(_state_dict(), tmp_path / "sharded", max_shard_bytes=100)
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        save_hf(_state_dict(), tmp_path / "sharded")
    (tmp_path / "sharded" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors does not exist"):
        load_hf(tmp_path / "sharded")
    save_file({"other": torch.zeros(1)}, tmp_path / "sharded" / "model-00002-of-00003.safetensors")
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_proj.weight' is listed in .* but missing from"):
        load_hf(tmp_path / "sharded")

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\x10garbage")
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        load_hf(tmp_path / "bad")
    with pytest.raises(ValueError, match="'x' is a int, not a tensor"):
        save_hf({"x": 3}, tmp_path / "bad2")


def test_export_puts_extra_files_beside_the_weights(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2, bias=False)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"model": {}}')
    files = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": tokenizer}
    assert export_hf(model, tmp_path / "hf", lambda sd: {f"x.{k}": v for k, v in sd.items()}, extra_files=files)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (tmp_path / "hf" / "config.json").read_bytes() == b'{"model_type": "llama"}'
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == '{"model": {}}'
    assert torch.equal(load_hf(tmp_path / "hf")["x.weight"], model.weight)
    with pytest.raises(ValueError, match="extra checkpoint file name 'a/config.json' must be a plain file name"):
        export_hf(model, tmp_path / "hf2", lambda sd: sd, extra_files={"a/config.json": b""})
    assert not (tmp_path / "hf2").exists()


def test_export_converts_the_tensors_together_names_in_one_call(tmp_path):
    """A weight HF stores fused from two model tensors (Llama 4's experts: gate and up) reaches
    to_hf with both; every other tensor alone."""
    model = nn.ModuleDict({"gate": nn.Linear(3, 2, bias=False), "up": nn.Linear(3, 2, bias=False),
                           "down": nn.Linear(2, 3, bias=False)})
    calls = []

    def to_hf(sd):
        calls.append(sorted(sd))
        if "gate.weight" in sd:
            return {"gate_up": torch.cat([sd["gate.weight"], sd["up.weight"]])}  # KeyError unless together
        return sd

    fused = {"gate.weight": "gate_up", "up.weight": "gate_up"}
    assert export_hf(model, tmp_path / "hf", to_hf, together=fused.get)
    assert sorted(calls[len(calls) // 2:]) == [["down.weight"], ["gate.weight", "up.weight"]]  # (meta, then data)
    written = load_hf(tmp_path / "hf")
    assert torch.equal(written["gate_up"], torch.cat([model["gate"].weight, model["up"].weight]))
    assert torch.equal(written["down.weight"], model["down"].weight)
    with pytest.raises(KeyError, match="up.weight"):
        export_hf(model, tmp_path / "alone", to_hf)


def _full_disk(tensors, filename, metadata=None):
    """safetensors' save_file on a full disk: part of the file, then its own error."""
    with open(filename, "wb") as f:
        f.write(b"\0" * 8)
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_disk_during_export_is_an_os_error_naming_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr("tessera.ckpt.hf.save_file", _full_disk)
    model = nn.Linear(3, 2, bias=False)
    with pytest.raises(OSError) as error:
        export_hf(model, tmp_path / "hf", lambda sd: sd)
    assert error.value.errno == 28
    assert str(error.value) == f"[Errno 28] cannot write Hugging Face export {tmp_path / 'hf'}: No space left on device"
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its .tmp
    with pytest.raises(OSError, match="No space left on device") as error:
        save_hf({"w": torch.zeros(2)}, tmp_path / "direct")
    assert error.value.filename == str(tmp_path / "direct" / "model.safetensors")
