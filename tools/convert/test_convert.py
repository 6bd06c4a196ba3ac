"""tools/convert: DCP -> Hugging Face -> DCP is the identity on a tiny Llama; errors exit 2."""

import os
import subprocess
import sys
from pathlib import Path

import torch

import convert
from tessera.ckpt import CheckpointManager, ModelState, OptimizerState, load_hf, read_dcp
from tessera.models import get_model_spec


def _trained_checkpoint(folder):
    spec = get_model_spec("llama3")
    torch.manual_seed(0)
    model = spec.build(spec.flavors["debugmodel"])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    optimizer = torch.optim.AdamW(model.parameters())
    states = {"model": ModelState([model]), "optimizer": OptimizerState([model], [optimizer])}
    CheckpointManager(folder, states, interval=1).save(1)
    return model.state_dict(), folder / "step-1"


def _run(*argv):
    return convert.main([str(a) for a in argv])


def test_dcp_hf_dcp_round_trip_is_identity(tmp_path):
    weights, step_dir = _trained_checkpoint(tmp_path / "ckpt")
    flavor = ("--model", "llama3", "--flavor", "debugmodel")
    assert _run("dcp-to-hf", *flavor, "--max-shard-bytes", 8_000_000, step_dir, tmp_path / "hf") == 0
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    hf = load_hf(tmp_path / "hf")
    assert torch.equal(hf["model.embed_tokens.weight"], weights["tok_embeddings.weight"])
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], weights["layers.0.attention.wq.weight"])  # RoPE layout

    assert _run("hf-to-dcp", *flavor, tmp_path / "hf", tmp_path / "back") == 0
    back = read_dcp(tmp_path / "back", only="model")
    assert back.keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(back[key], value), key

    assert _run("dcp-to-torch", step_dir, tmp_path / "whole.pt") == 0
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert set(whole) == {"model", "optimizer"} and torch.equal(whole["model"]["norm.weight"], weights["norm.weight"])


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    flavor = ("--model", "llama3", "--flavor", "debugmodel")
    assert _run("dcp-to-hf", "--model", "llama3", "--flavor", "huge", tmp_path, tmp_path / "o") == 2
    assert "unknown flavor 'huge' of llama3; known: [" in capsys.readouterr().err
    assert _run("dcp-to-hf", *flavor, tmp_path / "absent", tmp_path / "o") == 2
    assert "DCP checkpoint folder" in capsys.readouterr().err
    assert _run("hf-to-dcp", *flavor, tmp_path, tmp_path / "o") == 2
    assert "holds neither model.safetensors" in capsys.readouterr().err

    # A checkpoint of another model shape: the first mismatching key and both shapes are named.
    spec = get_model_spec("llama3")
    small = spec.build(spec.flavors["debugmodel"].__class__(dim=64, n_layers=1, n_heads=4, vocab_size=32))
    CheckpointManager(tmp_path / "small", {"model": ModelState([small])}, interval=1).save(1)
    assert _run("dcp-to-hf", *flavor, tmp_path / "small" / "step-1", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "'tok_embeddings.weight' has shape (32, 64) but llama3/debugmodel needs (2048, 256)" in err

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run(
        [sys.executable, str(Path(convert.__file__)), "dcp-to-torch", str(tmp_path / "absent"), str(tmp_path / "x.pt")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr


def test_outputs_are_never_overwritten_without_force(tmp_path, capsys):
    weights, step_dir = _trained_checkpoint(tmp_path / "ckpt")
    flavor = ("--model", "llama3", "--flavor", "debugmodel")
    out = tmp_path / "whole.pt"
    out.write_bytes(b"precious")
    assert _run("dcp-to-torch", step_dir, out) == 2
    assert capsys.readouterr().err.strip() == f"convert: error: output {out} already exists; pass --force to replace it"
    assert out.read_bytes() == b"precious"
    assert _run("dcp-to-torch", "--force", step_dir, out) == 0
    assert torch.equal(torch.load(out, weights_only=True)["model"]["norm.weight"], weights["norm.weight"])

    hf = tmp_path / "hf"
    hf.mkdir()  # an empty folder is no output yet
    assert _run("dcp-to-hf", *flavor, step_dir, hf) == 0
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    assert _run("dcp-to-hf", *flavor, step_dir, hf) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert _run("dcp-to-hf", *flavor, "--force", step_dir, hf) == 0
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf", "whole.pt"]  # no hidden leftovers


def test_output_path_errors_are_one_line(tmp_path, capsys):
    _, step_dir = _trained_checkpoint(tmp_path / "ckpt")
    assert _run("dcp-to-torch", step_dir, tmp_path) == 2
    assert capsys.readouterr().err.strip() == f"convert: error: output {tmp_path} is a folder; this conversion writes a file"
    missing = tmp_path / "no" / "such" / "x.pt"
    assert _run("dcp-to-torch", step_dir, missing) == 2
    assert capsys.readouterr().err.strip() == f"convert: error: output {missing}: its folder {missing.parent} does not exist"
    assert _run("hf-to-dcp", "--model", "llama3", "--flavor", "debugmodel", tmp_path, step_dir / ".metadata") == 2
    assert "is a file; this conversion writes a folder" in capsys.readouterr().err
