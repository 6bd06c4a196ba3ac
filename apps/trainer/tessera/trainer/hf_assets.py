"""Hugging Face model folders (model.hf_assets_path) in the trainer: the architecture from its
config.json (model.flavor = "from_hf_config"), initial weights from its safetensors, and what an
export writes beside the weights so that transformers opens it.

Only the job plan and the checkpointer use these; the folder's tokenizer is tessera.data's concern.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from tessera.ckpt.hf import INDEX_FILE, SINGLE_FILE, hf_tensor_names, quantized_weights
from tessera.data import hf_tokenizer_config, hf_tokenizer_files, tokenizer_file
from tessera.models import ARGS_FILE, CONFIG_FILE, ModelSpec, args_record, read_hf_config
from tessera.trainer.config import ConfigError, JobConfig, user_input

# The flavor name that takes the architecture from <model.hf_assets_path>/config.json.
FROM_HF_CONFIG = "from_hf_config"
# A Hugging Face tokenizer's files, copied beside an export when the run's tokenizer is in HF's formats.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
# torchtitan 0.2.2's flavors naming an attention kernel over another flavor's weights (llama3's 8B_flex,
# debugmodel_varlen_attn, ...): in Tessera the job plan picks the kernel and model.attn_mask_type the mask.
_KERNEL_SUFFIXES = ("_flex_attn", "_varlen_attn", "_flex", "_varlen")


def flavor_args(config: JobConfig, spec: ModelSpec):
    """The architecture named by model.flavor, before the run's seq_len: a flavor
    of the spec, or with "from_hf_config" the one model.hf_assets_path's config.json describes."""
    flavor = config.model.flavor
    if flavor != FROM_HF_CONFIG:
        if flavor not in spec.flavors:
            raise ConfigError(f"model.flavor {flavor!r} is not a flavor of {spec.name}; {_flavor_hint(flavor, spec)}")
        return spec.flavors[flavor]
    if spec.hf_config is None:
        raise ConfigError(f"model.flavor {FROM_HF_CONFIG!r}: model {spec.name} cannot be built from a Hugging Face config.json")
    if not config.model.hf_assets_path:
        raise ConfigError(f"model.flavor {FROM_HF_CONFIG!r} needs model.hf_assets_path, a Hugging Face model folder with {CONFIG_FILE}")
    file = Path(config.model.hf_assets_path) / CONFIG_FILE
    with user_input():
        args = spec.hf_config.args_from_config(read_hf_config(file), str(file))
        fit, initial = getattr(spec.hf_config, "fit_to_weights", None), initial_load_folder(config)
        if fit is not None and config.checkpoint.initial_load_in_hf and initial is not None and _holds_weights(initial[1]):
            args = fit(args, set(hf_tensor_names(initial[1])))  # modules config.json names but the weights lack
        return args


def _flavor_hint(flavor: str, spec: ModelSpec) -> str:
    """What to write instead: for torchtitan's kernel flavors, their weights' flavor and the mask."""
    base = next((flavor.removesuffix(suffix) for suffix in _KERNEL_SUFFIXES if flavor.endswith(suffix)), None)
    if base in spec.flavors:
        return f"torchtitan's {flavor} is {base} with model.attn_mask_type = 'block_causal' (the job plan picks the kernel)"
    hint = f", or {FROM_HF_CONFIG!r} with model.hf_assets_path" if spec.hf_config is not None else ""
    return f"choose from {sorted(spec.flavors)}{hint}"


def _holds_weights(folder: Path) -> bool:
    return (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()


def initial_load_folder(config: JobConfig) -> tuple[str, Path] | None:
    """(config key, folder) of the initial weights: checkpoint.initial_load_path, or for
    initial_load_in_hf without one, model.hf_assets_path; None when neither applies."""
    ckpt = config.checkpoint
    if ckpt.initial_load_path:
        return "checkpoint.initial_load_path", Path(ckpt.initial_load_path)
    if ckpt.initial_load_in_hf and config.model.hf_assets_path:
        return "model.hf_assets_path", Path(config.model.hf_assets_path)
    return None


def check_hf_weights(config: JobConfig, spec: ModelSpec, args) -> list[str]:
    """A Hugging Face folder the run loads holds safetensors, quantized only where
    initial_load_in_hf_quantized says so, and its config.json (when it has one) describes the
    run's model, vocabulary included: a mismatch names the first differing
    field before any worker starts. A missing folder is _check_paths' job. With last_save_in_hf,
    a model no config.json can state (custom MoE routing) fails here too. Returns warnings."""
    if config.checkpoint.last_save_in_hf and spec.hf_config is not None:
        with user_input():
            spec.hf_config.config_from_args(args)
    formats = _quantized_formats(config, spec)
    initial = initial_load_folder(config)
    if not config.checkpoint.initial_load_in_hf or initial is None or not initial[1].is_dir():
        return []
    key, folder = initial
    if not _holds_weights(folder):
        raise ConfigError(f"{key} {folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    warnings = _check_quantized(config, spec, formats, key, folder)
    if spec.hf_config is not None and (folder / CONFIG_FILE).is_file():
        target = f"{spec.name}/{config.model.flavor}"
        source = str(folder / CONFIG_FILE)
        with user_input():
            stated = read_hf_config(folder)
            spec.hf_config.check_config(args, stated, source, target)
            left_out = spec.mtp_layers(spec.hf_config.args_from_config(stated, source)) - spec.mtp_layers(args)
        if config.model.flavor == FROM_HF_CONFIG and left_out > 0:
            warnings.append(f"{source} names {left_out} multi-token-prediction module(s) whose weights {folder} does "
                            "not hold (transformers saves none): the run trains without them")
    return warnings


def _quantized_formats(config: JobConfig, spec: ModelSpec) -> tuple[str, ...]:
    """The quantized formats the family's adapter dequantises (``quantized_formats``);
    initial_load_in_hf_quantized is refused for a family with none, and without initial_load_in_hf."""
    formats = tuple(getattr(spec.hf_adapter, "quantized_formats", ()))
    ckpt = config.checkpoint
    if ckpt.initial_load_in_hf_quantized and not formats:
        raise ConfigError(f"checkpoint.initial_load_in_hf_quantized: model {spec.name} cannot load quantized Hugging "
                          "Face weights (its adapter dequantises no format); load a bf16/fp32 checkpoint")
    if ckpt.initial_load_in_hf_quantized and not ckpt.initial_load_in_hf:
        raise ConfigError("checkpoint.initial_load_in_hf_quantized needs checkpoint.initial_load_in_hf = true")
    return formats


def _check_quantized(config: JobConfig, spec: ModelSpec, formats: tuple[str, ...], key: str, folder: Path) -> list[str]:
    """Quantized weights in the folder (MXFP4's blocks + scales: tessera.ckpt.quantized_weights)
    need initial_load_in_hf_quantized, which without any is a warning."""
    with user_input():
        quantized = quantized_weights(folder)
    wanted = config.checkpoint.initial_load_in_hf_quantized
    if quantized and not wanted:
        what = f"{key} {folder} holds {len(quantized)} quantized weights ({quantized[0]}_blocks + _scales, MXFP4)"
        if not formats:
            raise ConfigError(f"{what}, which model {spec.name} cannot dequantise: load a bf16/fp32 checkpoint")
        raise ConfigError(f"{what}: set checkpoint.initial_load_in_hf_quantized = true to dequantise them on load")
    if wanted and not quantized:
        return [f"checkpoint.initial_load_in_hf_quantized is set, but {key} {folder} holds no quantized weights: "
                "they load as stored"]
    return []


def _token_ids(config: JobConfig, tokenizer) -> dict:
    """bos/eos ids for config.json: model.hf_assets_path's config.json's (eos may be a list),
    else the tokenizer's."""
    assets = Path(config.model.hf_assets_path) / CONFIG_FILE if config.model.hf_assets_path else None
    if assets is not None and assets.is_file():
        with user_input():
            found = read_hf_config(assets)
        ids = {key: found.get(key) for key in ("bos_token_id", "eos_token_id")}
    else:
        ids = {"bos_token_id": getattr(tokenizer, "bos_id", None), "eos_token_id": getattr(tokenizer, "eos_id", None)}
    return {key: value for key, value in ids.items() if value is not None}


def _tokenizer_files(source: str | None, tokenizer, context: int) -> dict[str, Path | bytes]:
    """The run's tokenizer for an export. Hugging Face's formats (the tokenizer.json or SentencePiece
    tokenizer.model that load_tokenizer reads for the file or folder given) are copied under their
    standard names with the HF files beside them, but for a tokenizer.model a tokenizer.json the run
    did not read (transformers would prefer it); the embedded default and Llama 3 tokenizer.model
    files, tiktoken's format that transformers cannot read, are written as tokenizer.json +
    tokenizer_config.json giving the same ids. A copied tokenizer.json without a tokenizer_config.json
    gets one naming the run's BOS and EOS."""
    file, kind = tokenizer_file(source) if source else (None, "tiktoken")
    if kind == "tiktoken":
        return hf_tokenizer_files(tokenizer, model_max_length=context)
    file = Path(file)
    name = "tokenizer.json" if kind == "tokenizer.json" else "tokenizer.model"
    beside = [n for n in TOKENIZER_FILES if (file.parent / n).is_file() and (n != "tokenizer.json" or name == n)]
    files = {**{n: file.parent / n for n in beside}, name: file}
    if name == "tokenizer.json" and "tokenizer_config.json" not in files:  # AutoTokenizer would have no BOS/EOS
        with contextlib.suppress(ValueError):  # unless BOS or EOS is an ordinary token, which no file can name
            files["tokenizer_config.json"] = _json_bytes(hf_tokenizer_config(tokenizer, model_max_length=context))
    return files


def _json_bytes(doc: dict) -> bytes:
    return (json.dumps(doc, indent=2) + "\n").encode()


def export_files(config: JobConfig, spec: ModelSpec, args, tokenizer, tokenizer_source: str | None) -> tuple[dict, dict]:
    """(files beside every DCP checkpoint, files beside a Hugging Face export).

    DCP checkpoints get ``model_args.json``, the args record from which tools/convert rebuilds
    the model (vocabulary included). Hugging Face exports get ``config.json`` and the tokenizer's
    files, so ``transformers.AutoModelForCausalLM.from_pretrained`` opens the folder. Both state
    the architecture's context length (the flavor's or config.json's), not the run's seq_len.
    The Hugging Face files are made for runs that export (checkpoint.last_save_in_hf) only.
    """
    architecture = spec.with_context(args, flavor_args(config, spec).max_seq_len)
    ids = _token_ids(config, tokenizer)
    dcp = {ARGS_FILE: args_record(spec, architecture, flavor=config.model.flavor, **ids)}
    if spec.hf_config is None or not config.checkpoint.last_save_in_hf:
        return dcp, {}
    hf_config = spec.hf_config.config_from_args(architecture, dtype=config.checkpoint.export_dtype, **ids)
    tokenizer_files = _tokenizer_files(tokenizer_source, tokenizer, architecture.max_seq_len)
    return dcp, {CONFIG_FILE: _json_bytes(hf_config), **tokenizer_files}
