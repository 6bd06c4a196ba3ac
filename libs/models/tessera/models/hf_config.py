"""Hugging Face ``config.json`` files: reading one, whatever the model family, and the checks
every family's reader shares.

Each family turns the dict into its own args (its spec's ``hf_config``, e.g.
``tessera.models.llama.hf_config``).
"""

import json
import os
from pathlib import Path

from tessera.models.rotary import YarnScaling

CONFIG_FILE = "config.json"
REQUIRED = object()
_KINDS = {int: "an integer", float: "a number", bool: "true or false"}
_YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "truncate"}
_SCALED = ("llama3", "yarn")  # the RoPE types with an original context


def config_file(path: str | os.PathLike) -> Path:
    """``<path>/config.json`` when ``path`` is a folder, else ``path`` itself."""
    path = Path(path)
    return path / CONFIG_FILE if path.is_dir() else path


def read_hf_config(path: str | os.PathLike) -> dict:
    """The JSON object in ``path`` (a model folder or its config.json); a missing, unreadable
    or malformed file is a one-line ValueError naming it."""
    file = config_file(path)
    if not file.is_file():
        raise ValueError(f"{file} does not exist")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} holds a JSON {type(config).__name__}, not an object")
    return config


def config_value(mapping: dict, key: str, kind: type, source: str, default=REQUIRED, prefix: str = "",
                 zero: bool = False):
    """``mapping[key]`` checked to be of ``kind`` (numbers positive, or with ``zero`` at least 0:
    counts such as shared experts); missing or null gives ``default``, or an error when there is
    none."""
    value = mapping.get(key)
    if value is None:
        if default is REQUIRED:
            raise ValueError(f"{source}: {prefix}{key} is missing")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{source}: {prefix}{key} {value!r} is not {_KINDS[kind]}")
    if kind is not bool and (value < 0 if zero else value <= 0):
        raise ValueError(f"{source}: {prefix}{key} {value!r} must be {'>= 0' if zero else 'positive'}")
    return value


def refuse_unsupported(config: dict, source: str, model_types: tuple[str, ...], settings: dict) -> None:
    """A model_type outside ``model_types``, or a key set otherwise than ``settings`` says
    (key -> the only value supported; missing keys take it), is a ValueError naming it."""
    if config.get("model_type") not in model_types:
        raise ValueError(f"{source}: model_type {config.get('model_type')!r} is not supported, only "
                         f"{' or '.join(map(repr, model_types))}")
    for key, supported in settings.items():
        value = config.get(key, supported)
        if value != supported or type(value) is not type(supported):
            raise ValueError(f"{source}: {key} {value!r} is not supported, only {supported!r}")


def rope_section(config: dict, source: str, default_theta: float = 10000.0) -> tuple[str, dict, float]:
    """(the section's name, its parameters, RoPE theta) of a config, read as transformers 5 does:
    a non-empty ``rope_scaling`` (transformers 4's name, still honoured) before ``rope_parameters``;
    theta from the section, else ``rope_theta``, else the family's ``default_theta``; a scaled
    RoPE's original context from a top-level ``original_max_position_embeddings`` (Phi-3's
    place) before the section's own."""
    name = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    params = config.get(name) or {}
    if not isinstance(params, dict):
        raise ValueError(f"{source}: {name} {params!r} is not an object")
    if "original_max_position_embeddings" in config and params.get("rope_type", params.get("type")) in _SCALED:
        original = config_value(config, "original_max_position_embeddings", int, source)
        params = {**params, "original_max_position_embeddings": original}
    if "rope_theta" in params:
        return name, params, config_value(params, "rope_theta", float, source, prefix=f"{name}.")
    return name, params, config_value(config, "rope_theta", float, source, default=default_theta)


def yarn_section(name: str, params: dict, source: str, why: str, extra: tuple[str, ...] = ()) -> YarnScaling | None:
    """The YaRN a rope section (``rope_section``'s) states: None for default RoPE, other types
    refused; factor and original context required, beta_fast / beta_slow / truncate with
    transformers' defaults; a key outside those and ``extra`` (the family reads them) refused,
    saying ``why``, since transformers' other YaRN keys change the math."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ValueError(f"{source}: {name}.rope_type {rope_type!r} is not supported, only 'default' or 'yarn'")
    unknown = sorted(set(params) - _YARN_KEYS - set(extra))
    if unknown:
        raise ValueError(f"{source}: {name}.{unknown[0]} is not supported ({why})")
    prefix = f"{name}."
    return YarnScaling(
        factor=config_value(params, "factor", float, source, prefix=prefix),
        original_max_position_embeddings=config_value(params, "original_max_position_embeddings", int, source,
                                                      prefix=prefix),
        beta_fast=config_value(params, "beta_fast", float, source, default=32.0, prefix=prefix),
        beta_slow=config_value(params, "beta_slow", float, source, default=1.0, prefix=prefix),
        truncate=config_value(params, "truncate", bool, source, default=True, prefix=prefix),
    )


def compare_configs(found, args, compared: tuple[tuple[str, str], ...], source: str, target: str) -> None:
    """``found`` (args read from ``source``) agrees with ``args`` (``target``) on every
    (config.json key, attribute) of ``compared``; the first difference is a ValueError."""
    for key, attribute in compared:
        theirs, ours = _attribute(found, attribute), _attribute(args, attribute)
        if theirs != ours:
            raise ValueError(f"{source}: {key} is {theirs!r} but {target} has {attribute} {ours!r}")


def _attribute(args, dotted: str):
    for name in dotted.split("."):
        args = None if args is None else getattr(args, name)
    return args
