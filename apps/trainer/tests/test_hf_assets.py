"""A Hugging Face model folder (model.hf_assets_path) through the trainer in one process: the
architecture from its config.json (model.flavor = "from_hf_config"), the weights from its
safetensors with no checkpoint.initial_load_path, the export's config.json and tokenizer files
(a tokenizer.json or SentencePiece tokenizer.model copied, with a tokenizer_config.json naming
BOS/EOS where a tokenizer.json has none; tiktoken's formats written as a tokenizer.json), a folder
holding only a SentencePiece tokenizer as the run's tokenizer, the args record beside DCP
checkpoints, and the plan's one-line refusals."""

import io
import json
import shutil
from importlib import resources
from pathlib import Path

import pytest
import sentencepiece
import tokenizers
import torch

from tessera.ckpt import load_hf, read_dcp, save_hf
from tessera.ckpt.folders import write_extra_files
from tessera.data import Tokenizer, load_dataset, load_tokenizer, write_hf_tokenizer
from tessera.models import get_model_spec, read_args_record
from tessera.trainer.config import load_config
from tessera.trainer.hf_assets import export_files
from tessera.trainer.main import main
from tessera.trainer.plan import make_plan, tokenizer_source
from tessera.trainer.train import train

torch.set_num_threads(1)

SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
         "--metrics.log_freq", "1", "--metrics.disable_color_printing", "true"]
# The bundled tokenizer named as a file: the tiny folder has no tokenizer of its own.
TOKENIZER = Path(str(resources.files("tessera.data").joinpath("assets", "tokenizer.model")))


def sentencepiece_folder(folder: Path, kind: str) -> Path:
    """`folder` holding only a SentencePiece tokenizer trained here on a few KB: a tokenizer.model
    (BPE with byte fallback, as Llama 2's) or a Metaspace tokenizer.json (as the tokenizers library
    trains one)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [line for line in load_dataset()[0][:6000].splitlines() if line.strip()]
    if kind == "tokenizer.model":
        model = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=600,
                                                 model_type="bpe", byte_fallback=True, minloglevel=2)
        (folder / "tokenizer.model").write_bytes(model.getvalue())
    else:
        tok = tokenizers.SentencePieceBPETokenizer()
        tok.train_from_iterator(lines, vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
        tok.save(str(folder / "tokenizer.json"))
    return folder


def tiny_hf_folder(folder: Path, **change) -> tuple[dict, dict]:
    """A Llama folder as transformers 5 writes it (config.json with rope_parameters, one
    model.safetensors) of a seed-3 model; returns its config and Tessera-named weights."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "vocab_size": load_tokenizer().vocab_size,
        "tie_word_embeddings": False, "bos_token_id": 5, "eos_token_id": [6, 7], "dtype": "float32",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        **change,
    }
    spec = get_model_spec("llama3")
    args = spec.hf_config.args_from_config(config)
    torch.manual_seed(3)  # not the trainer's seed: its own initial weights differ
    weights = spec.build(args).state_dict()
    save_hf(spec.hf_adapter.to_hf(weights, args), folder)
    (folder / "config.json").write_text(json.dumps(config))
    return config, weights


def hf_run(dump: Path, hf: Path, *extra: str) -> list[dict]:
    return train(load_config([*SMALL, "--job.dump_folder", str(dump), "--model.hf_assets_path", str(hf),
                              "--model.tokenizer_path", str(TOKENIZER), "--checkpoint.initial_load_in_hf", "true", *extra]))


def test_architecture_and_weights_come_from_the_folder_and_the_export_describes_them(tmp_path):
    config, weights = tiny_hf_folder(tmp_path / "hf")
    spec = get_model_spec("llama3")
    args = spec.hf_config.args_from_config(config)
    # lr 0: the one step leaves the weights as loaded, so the export must hold the folder's weights
    hf_run(tmp_path / "run", tmp_path / "hf", "--model.flavor", "from_hf_config", "--training.steps", "1",
           "--optimizer.lr", "0", "--checkpoint.enable", "true", "--checkpoint.last_save_in_hf", "true")
    folder = tmp_path / "run" / "checkpoint"
    export = folder / "step-1-hf"
    exported = load_hf(export)
    expected = spec.hf_adapter.to_hf(weights, args)
    assert exported.keys() == expected.keys()
    for key, value in expected.items():
        assert exported[key].dtype == torch.float32 and torch.equal(exported[key], value), key

    written = json.loads((export / "config.json").read_text())
    assert spec.hf_config.args_from_config(written) == args  # context 256 (not seq_len 32), intermediate_size 96
    assert (written["architectures"], written["torch_dtype"]) == (["LlamaForCausalLM"], "float32")
    assert (written["bos_token_id"], written["eos_token_id"]) == (5, [6, 7])  # the folder's, eos list included
    assert not (export / "tokenizer.model").exists()  # tiktoken's format: written as a tokenizer.json
    assert json.loads((export / "tokenizer_config.json").read_text())["model_max_length"] == 256
    text = load_dataset()[0][:2000]
    assert load_tokenizer(export).encode(text, True, True) == load_tokenizer(TOKENIZER).encode(text, True, True)

    for step_dir in ("step-1", "step-1-model"):  # the full checkpoint and the final model-only export
        found_spec, found_args, record = read_args_record(folder / step_dir)
        assert (found_spec.name, found_args, record["flavor"]) == ("llama3", args, "from_hf_config")


@pytest.mark.parametrize("given", ["default", "tokenizer.model", "folder with tokenizer.model", "tokenizer.json",
                                   "folder with tokenizer.json", "SentencePiece tokenizer.model",
                                   "folder with SentencePiece tokenizer.json"])
def test_the_export_holds_the_runs_tokenizer_in_a_format_transformers_reads(tmp_path, given):
    hf = tmp_path / "tok"
    hf.mkdir()
    if given == "SentencePiece tokenizer.model":  # beside a tokenizer.json the run does not read
        write_hf_tokenizer(load_tokenizer(), sentencepiece_folder(hf, "tokenizer.model"))
        (hf / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    elif "SentencePiece" in given:
        sentencepiece_folder(hf, "tokenizer.json")
    elif "tokenizer.json" in given:  # a GPT-2-like layout, unlike the default's
        ranks = load_tokenizer().ranks
        write_hf_tokenizer(Tokenizer(ranks, special_tokens={"<|endoftext|>": len(ranks)}, bos_id=len(ranks),
                                     eos_id=len(ranks)), hf)
    else:
        shutil.copyfile(TOKENIZER, hf / "tokenizer.model")
    if "tokenizer.json" in given:
        (hf / "special_tokens_map.json").write_text("{}")
    source = {"default": None, "tokenizer.model": hf / "tokenizer.model", "tokenizer.json": hf / "tokenizer.json",
              "SentencePiece tokenizer.model": hf / "tokenizer.model"}
    source = source.get(given, hf)
    config = load_config(["--checkpoint.last_save_in_hf", "true", *(["--model.tokenizer_path", str(source)] if source else [])])
    run_tokenizer = load_tokenizer(tokenizer_source(config))
    spec = get_model_spec(config.model.name)
    _, files = export_files(config, spec, spec.flavors[config.model.flavor], run_tokenizer, tokenizer_source(config))
    export = tmp_path / "export"
    export.mkdir()
    write_extra_files(export, files)

    copied = {name: path for name, path in files.items() if isinstance(path, Path)}
    names = ["config.json", "tokenizer.json", "tokenizer_config.json"]
    kept = {"SentencePiece tokenizer.model": ["tokenizer.model", "tokenizer_config.json"],  # not the unread json
            "folder with SentencePiece tokenizer.json": ["tokenizer.json", "special_tokens_map.json"]}
    kept = kept.get(given, [*names[1:], "special_tokens_map.json"] if "tokenizer.json" in given else None)
    if kept:  # the HF files as they are
        assert copied == {name: hf / name for name in kept}
    else:  # written from the run's tokenizer, no tokenizer.model
        assert not copied and sorted(export.iterdir()) == [export / name for name in names]
    exported = load_tokenizer(export)
    text = load_dataset()[0][:2000] + " <|endoftext|> café 世界"
    assert exported.fingerprint == run_tokenizer.fingerprint
    assert exported.encode(text, True, True) == run_tokenizer.encode(text, True, True)


@pytest.mark.parametrize("kind", ["byte-level", "SentencePiece"])
def test_a_tokenizer_json_without_tokenizer_config_exports_with_one_naming_the_runs_bos_and_eos(tmp_path, kind):
    """transformers' AutoTokenizer on a tokenizer.json alone has no BOS or EOS; Tessera found them
    (byte-level: specials no name marks, config.json's ids tell; SentencePiece: <s>, </s> by name)."""
    import transformers  # slow to import, and this test's alone

    hf = tmp_path / "tok"
    if kind == "SentencePiece":
        sentencepiece_folder(hf, "tokenizer.json")
    else:
        ranks = load_tokenizer().ranks
        start, stop = len(ranks), len(ranks) + 1
        write_hf_tokenizer(Tokenizer(ranks, special_tokens={"<|start|>": start, "<|stop|>": stop}, bos_id=start,
                                     eos_id=stop), hf)
        (hf / "tokenizer_config.json").unlink()
        (hf / "config.json").write_text(json.dumps({"bos_token_id": start, "eos_token_id": [stop]}))
    config = load_config(["--checkpoint.last_save_in_hf", "true", "--model.tokenizer_path", str(hf)])
    run_tokenizer = load_tokenizer(hf)
    spec = get_model_spec(config.model.name)
    _, files = export_files(config, spec, spec.flavors[config.model.flavor], run_tokenizer, str(hf))
    export = tmp_path / "export"
    export.mkdir()
    write_extra_files(export, files)
    opened = transformers.AutoTokenizer.from_pretrained(export)
    assert (opened.bos_token_id, opened.eos_token_id) == (run_tokenizer.bos_id, run_tokenizer.eos_id)
    assert files["tokenizer.json"] == hf / "tokenizer.json" and not (hf / "tokenizer_config.json").exists()


def test_a_folder_holding_only_a_sentencepiece_tokenizer_trains(tmp_path):
    """model.hf_assets_path as the tokenizer: Llama 2's debug model on a SentencePiece
    tokenizer.model, its vocabulary (600) and BOS/EOS from the file."""
    hf = sentencepiece_folder(tmp_path / "hf", "tokenizer.model")
    history = train(load_config([*SMALL, "--job.dump_folder", str(tmp_path / "run"), "--model.name", "llama2",
                                 "--model.hf_assets_path", str(hf), "--training.steps", "2"]))
    assert [h["step"] for h in history] == [1, 2] and 6 < history[0]["loss"] < 9  # ln 2048 = 7.6 at the start
    tokenizer = load_tokenizer(hf)
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (600, 1, 2)


def test_the_flavor_sizes_the_vocabulary_not_the_tokenizer(tmp_path):
    """torchtitan 0.2.2's model.flavor: its vocab_size is the model's whatever the tokenizer's ids
    (they only have to fit), so one TOML builds the same model, and the same losses, in both."""
    hf = sentencepiece_folder(tmp_path / "hf", "tokenizer.json")
    assert load_tokenizer(hf).vocab_size == 500
    plan = make_plan(load_config([*SMALL, "--model.hf_assets_path", str(hf)]), 1, "cpu")
    assert plan.model_args.vocab_size == get_model_spec("llama3").flavors["debugmodel"].vocab_size == 2048


def test_named_flavor_loads_a_folder_of_its_shape(tmp_path):
    spec = get_model_spec("llama3")
    debug = spec.flavors["debugmodel"]
    change = {"hidden_size": debug.dim, "num_hidden_layers": debug.n_layers, "num_attention_heads": debug.n_heads,
              "num_key_value_heads": debug.n_heads, "head_dim": debug.head_dim, "intermediate_size": debug.ffn_hidden_dim,
              "rope_parameters": {"rope_type": "llama3", "rope_theta": debug.rope_theta, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}}
    config, weights = tiny_hf_folder(tmp_path / "hf", **change)
    history = hf_run(tmp_path / "run", tmp_path / "hf", "--training.steps", "1", "--optimizer.lr", "0",
                     "--checkpoint.enable", "true", "--checkpoint.interval", "1")
    saved = read_dcp(tmp_path / "run" / "checkpoint" / "step-1", only="model")
    assert saved.keys() == weights.keys() and all(torch.equal(saved[k], v) for k, v in weights.items())
    assert history[0]["step"] == 1


@pytest.mark.parametrize("flavor, change, message", [
    ("debugmodel", {}, "{hf}/config.json: hidden_size is 64 but llama3/debugmodel has dim 256"),
    ("from_hf_config", {"vocab_size": 1000},
     f"tokenizer {TOKENIZER} has 2048 ids, more than llama3/from_hf_config's vocab_size 1000"),
    ("from_hf_config", {"attention_bias": True}, "{hf}/config.json: attention_bias True is not supported, only False"),
    ("from_hf_config", "no weights", "model.hf_assets_path {hf} holds neither model.safetensors nor model.safetensors.index.json"),
])
def test_the_plan_refuses_a_folder_that_does_not_fit_in_one_line(tmp_path, capsys, flavor, change, message):
    hf = tmp_path / "hf"
    config, _ = tiny_hf_folder(hf)
    if change == "no weights":
        (hf / "model.safetensors").unlink()
    else:
        (hf / "config.json").write_text(json.dumps({**config, **change}))
    argv = [*SMALL, "--job.dump_folder", str(tmp_path / "run"), "--model.hf_assets_path", str(hf), "--model.flavor",
            flavor, "--model.tokenizer_path", str(TOKENIZER), "--checkpoint.initial_load_in_hf", "true"]
    assert main([*argv, "--nproc", "2"]) == 2  # refused before any worker starts
    assert capsys.readouterr().err.strip() == f"error: {message.format(hf=hf)}"
    assert not (tmp_path / "run").exists()


def test_from_hf_config_needs_the_folder(tmp_path, capsys):
    assert main([*SMALL, "--job.dump_folder", str(tmp_path), "--model.flavor", "from_hf_config", "--check"]) == 2
    assert capsys.readouterr().err.strip() == ("error: model.flavor 'from_hf_config' needs model.hf_assets_path, a Hugging "
                                              "Face model folder with config.json")
    assert main([*SMALL, "--job.dump_folder", str(tmp_path), "--model.flavor", "from_hf_config", "--model.hf_assets_path",
                 str(tmp_path), "--model.tokenizer_path", str(TOKENIZER), "--check"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}/config.json does not exist"
