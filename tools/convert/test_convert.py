"""tools/convert: DCP -> Hugging Face -> DCP is the identity on a tiny Llama; the model's shape
comes from the checkpoint's args record or a config.json; errors exit 2."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

import convert
from tessera.ckpt import CheckpointManager, ModelState, OptimizerState, load_hf, read_dcp
from tessera.models import ARGS_FILE, args_record, get_model_spec, read_args_record


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
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _run("dcp-to-hf", "--model", "llama3", "--flavor", "huge", empty, tmp_path / "o") == 2
    assert "unknown flavor 'huge' of llama3; known: [" in capsys.readouterr().err
    assert _run("dcp-to-hf", *flavor, tmp_path / "absent", tmp_path / "o") == 2
    assert "DCP checkpoint folder" in capsys.readouterr().err
    assert _run("hf-to-dcp", *flavor, empty, tmp_path / "o") == 2
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


@pytest.mark.parametrize("command, source", [
    ("dcp-to-hf", "DCP checkpoint folder"), ("hf-to-dcp", "Hugging Face checkpoint folder"),
    ("dcp-to-torch", "DCP checkpoint folder"),
])
def test_a_missing_source_is_named_first(tmp_path, capsys, command, source):
    """Before the shape (no model_args.json or config.json without flags) or the output (a file
    that exists) is looked at."""
    out = tmp_path / "out"
    out.write_bytes(b"precious")
    for src, problem in ((tmp_path / "absent", "does not exist"), (out, "is not a folder")):
        for dst in (tmp_path / "new", out):
            assert _run(command, src, dst) == 2
            assert capsys.readouterr().err.strip() == f"convert: error: {source} {src} {problem}"
    assert out.read_bytes() == b"precious" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


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
    folder = tmp_path / "folder"
    folder.mkdir()
    assert _run("dcp-to-torch", step_dir, folder) == 2
    assert capsys.readouterr().err.strip() == f"convert: error: output {folder} is a folder; this conversion writes a file"
    missing = tmp_path / "no" / "such" / "x.pt"
    assert _run("dcp-to-torch", step_dir, missing) == 2
    assert capsys.readouterr().err.strip() == f"convert: error: output {missing}: its folder {missing.parent} does not exist"
    assert _run("hf-to-dcp", "--model", "llama3", "--flavor", "debugmodel", folder, step_dir / ".metadata") == 2
    assert "is a file; this conversion writes a folder" in capsys.readouterr().err


@pytest.mark.parametrize("command, dst, overlap", [
    (["dcp-to-torch", "--force"], "ckpt/step-1/__0_0.distcp", "lies inside"),  # truncated the checkpoint
    (["dcp-to-torch"], "ckpt/step-1/whole.pt", "lies inside"),
    (["dcp-to-hf", "--force", "--flavor", "debugmodel"], "ckpt", "holds"),  # would replace every checkpoint
    (["hf-to-dcp", "--force", "--flavor", "debugmodel"], "link", "is"),  # a link to the source
])
def test_an_output_that_overlaps_the_source_is_refused_and_the_source_kept(tmp_path, capsys, monkeypatch, command, dst, overlap):
    monkeypatch.chdir(tmp_path)
    step = Path("ckpt/step-1")
    step.mkdir(parents=True)
    files = {".metadata": b"metadata", "__0_0.distcp": b"weights", ARGS_FILE: b"{}"}
    for name, data in files.items():
        (step / name).write_bytes(data)
    Path("link").symlink_to(step.resolve())
    assert _run(*command, step, dst) == 2
    assert capsys.readouterr().err == f"convert: error: output {dst} {overlap} the source {step}; write it elsewhere\n"
    assert {p.name: p.read_bytes() for p in step.iterdir()} == files  # no output, no hidden leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "link"] and list(Path("ckpt").iterdir()) == [step]


def _torch_save_no_space(obj, f):  # torch's writer: the file's OSError, then its own RuntimeError
    try:
        raise OSError(28, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def _save_file_no_space(tensors, filename, metadata=None):  # safetensors: its own error, the OS's inside
    Path(filename).write_bytes(b"\0" * 8)
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("command, writer, fake", [
    (["dcp-to-torch"], "torch.save", _torch_save_no_space),
    (["dcp-to-hf", "--flavor", "debugmodel"], "tessera.ckpt.hf.save_file", _save_file_no_space),
])
def test_a_full_disk_is_one_line_naming_the_output_and_leaves_nothing(tmp_path, capsys, monkeypatch, command, writer, fake):
    _, step_dir = _trained_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    monkeypatch.setattr(writer, fake)
    assert _run(*command, step_dir, out) == 2
    assert capsys.readouterr().err.strip() == f"convert: error: [Errno 28] cannot write output {out}: No space left on device"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no hidden leftovers


def test_the_checkpoint_record_and_config_json_give_the_shape_without_flags(tmp_path, capsys):
    """A model trained with a 40-token vocabulary converts with no flags: the DCP checkpoint's
    model_args.json (as the trainer writes it) says so, and the config.json written beside the
    safetensors carries it on to hf-to-dcp."""
    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["1B"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40,
                               ffn_dim_multiplier=None, ffn_dim=96)
    torch.manual_seed(0)
    model = spec.build(args)
    record = args_record(spec, args, flavor="1B", bos_token_id=1, eos_token_id=[2, 3])
    CheckpointManager(tmp_path / "ckpt", {"model": ModelState([model])}, interval=1, extra_files={ARGS_FILE: record}).save(1)
    step_dir = tmp_path / "ckpt" / "step-1"

    assert _run("dcp-to-hf", step_dir, tmp_path / "hf") == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert spec.hf_config.args_from_config(config) == args
    assert (config["vocab_size"], config["torch_dtype"], config["eos_token_id"]) == (40, "float32", [2, 3])
    assert config["tie_word_embeddings"] and "lm_head.weight" not in load_hf(tmp_path / "hf")  # 1B ties them

    assert _run("hf-to-dcp", tmp_path / "hf", tmp_path / "back") == 0  # shape from the folder's config.json
    back = read_dcp(tmp_path / "back", only="model")
    for key, value in model.state_dict().items():
        assert torch.equal(back[key], value), key
    assert read_args_record(tmp_path / "back")[1] == args

    (tmp_path / "alone").mkdir()
    (tmp_path / "alone" / "config.json").write_text(json.dumps(config))
    assert _run("dcp-to-hf", "--force", "--flavor", "1B", step_dir, tmp_path / "hf") == 0  # agrees with the record
    for argv, message in [
        (("dcp-to-hf", "--flavor", "8B", step_dir, tmp_path / "o"), f"--flavor 8B disagrees with {step_dir / ARGS_FILE}, which says 1B"),
        (("dcp-to-hf", "--model", "llama2", step_dir, tmp_path / "o"), "--model llama2 disagrees with"),
        (("dcp-to-hf", "--hf_config", tmp_path / "alone", step_dir, tmp_path / "o"), "--hf_config: " + str(step_dir / ARGS_FILE)),
        (("hf-to-dcp", "--flavor", "1B", tmp_path / "hf", tmp_path / "o"),
         f"{tmp_path / 'hf' / 'config.json'}: hidden_size is 64 but llama3/1B has dim 2048"),
        (("hf-to-dcp", tmp_path / "ckpt", tmp_path / "o"), f"{tmp_path / 'ckpt'} has no config.json: pass --flavor"),
    ]:
        assert _run(*argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("convert: error: " + message) and "\n" not in err, err

    (step_dir / ARGS_FILE).unlink()  # a checkpoint without a record: flags or a config.json
    assert _run("dcp-to-hf", step_dir, tmp_path / "o") == 2
    assert capsys.readouterr().err.strip() == f"convert: error: {step_dir} has no {ARGS_FILE}: pass --flavor (and --model) or --hf_config"
    assert _run("dcp-to-hf", "--hf_config", tmp_path / "alone" / "config.json", step_dir, tmp_path / "again") == 0
    assert load_hf(tmp_path / "again").keys() == load_hf(tmp_path / "hf").keys()


@pytest.mark.parametrize("model, flavor", [("deepseek_v3", "tiny"), ("qwen3", "tiny_moe")])
def test_moe_round_trip_writes_one_tensor_per_expert(tmp_path, model, flavor):
    """The trainer's record gives the shape one way, the written config.json the other way back."""
    spec = get_model_spec(model)
    args = spec.flavors[flavor]
    torch.manual_seed(0)
    net = spec.build(args)
    with torch.no_grad():
        for tensor in net.state_dict().values():
            tensor.normal_()
    CheckpointManager(tmp_path / "ckpt", {"model": ModelState([net])}, interval=1,
                      extra_files={ARGS_FILE: args_record(spec, args, flavor=flavor)}).save(1)
    weights = net.state_dict()
    assert _run("dcp-to-hf", tmp_path / "ckpt" / "step-1", tmp_path / "hf") == 0
    hf = load_hf(tmp_path / "hf")
    for expert in range(args.moe.n_experts):
        assert torch.equal(hf[f"model.layers.1.mlp.experts.{expert}.up_proj.weight"], weights["layers.1.moe.experts.w3"][expert])
    # the same model (DeepSeek's YaRN, which the flavor's length switches on, on at any length from a config.json)
    assert spec.hf_config.args_from_config(json.loads((tmp_path / "hf" / "config.json").read_text())) == \
        spec.with_context(args, args.max_seq_len)

    assert _run("hf-to-dcp", "--model", model, tmp_path / "hf", tmp_path / "back") == 0
    back = read_dcp(tmp_path / "back", only="model")
    keeps_bias = model == "deepseek_v3"  # Qwen3-MoE's HF format has no router bias
    assert back.keys() == weights.keys()
    for key, value in weights.items():
        expected = value if keeps_bias or not key.endswith("expert_bias") else torch.zeros_like(value)
        assert torch.equal(back[key], expected), key


@pytest.mark.parametrize("model", ["gpt_oss", "llama4"])
def test_new_families_convert_to_what_transformers_opens(tmp_path, model, capsys):
    """A trained-looking GPT-OSS / Llama 4 checkpoint converts to a folder transformers opens with
    the model's logits (its router bias zeroed: the HF format has none, which the tool says), and
    back to the same tensors."""
    import transformers

    spec = get_model_spec(model)
    args = dataclasses.replace(spec.flavors["tiny"], n_layers=4, max_seq_len=64)
    torch.manual_seed(0)
    net = spec.build(args).eval()
    with torch.no_grad():
        for name, tensor in net.state_dict().items():
            tensor.normal_(std=0.02 if "experts" in name else 0.1).add_(1.0 if name.endswith("norm.weight") else 0.0)
    CheckpointManager(tmp_path / "ckpt", {"model": ModelState([net])}, interval=1,
                      extra_files={ARGS_FILE: args_record(spec, args, flavor="tiny")}).save(1)
    assert _run("dcp-to-hf", tmp_path / "ckpt" / "step-1", tmp_path / "hf") == 0
    assert "warning: " in capsys.readouterr().err  # the router bias learned by balancing is not exported
    hf_cls = {"gpt_oss": transformers.GptOssForCausalLM, "llama4": transformers.Llama4ForCausalLM}[model]
    hf = hf_cls.from_pretrained(tmp_path / "hf", attn_implementation="eager", use_kernels=False).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for buffer in (b for name, b in net.named_buffers() if name.endswith("expert_bias")):
            buffer.zero_()
        torch.testing.assert_close(hf(tokens).logits, net(tokens), rtol=1e-4, atol=1e-4)
    assert _run("hf-to-dcp", "--model", model, tmp_path / "hf", tmp_path / "back") == 0
    back = read_dcp(tmp_path / "back", only="model")
    assert back.keys() == net.state_dict().keys()
    assert all(torch.equal(back[key], value) for key, value in net.state_dict().items()), model


def test_a_deepseek_v3_folder_transformers_saved_converts_without_its_unsaved_mtp_module(tmp_path):
    """transformers writes num_nextn_predict_layers 1 into every DeepSeek-V3 config.json and saves no
    such module's weights: hf-to-dcp converts the folder as the trainer loads it, without the module."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=64)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert _run("hf-to-dcp", "--model", "deepseek_v3", tmp_path / "hf", tmp_path / "back") == 0
    record = read_args_record(tmp_path / "back")
    assert record[1].num_mtp_layers == 0
    assert read_dcp(tmp_path / "back", only="model").keys() == get_model_spec("deepseek_v3").build(record[1]).state_dict().keys()
