"""Hugging Face ``config.json`` files: reading one, whatever the model family.

Each family turns the dict into its own args (its spec's ``hf_config``, e.g.
``tessera.models.llama.hf_config``).
"""

import json
import os
from pathlib import Path

CONFIG_FILE = "config.json"


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
