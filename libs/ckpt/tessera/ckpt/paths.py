"""The rule for file names read from inside checkpoint files (DCP metadata, a Hugging Face index):
they are data, so each must name a file in the checkpoint's own folder."""

from __future__ import annotations

from pathlib import Path


def is_file_name(name: object) -> bool:
    """A plain file name: no folder part, not absolute, not '', '.' or '..'."""
    return isinstance(name, str) and Path(name).name == name and name not in ("", ".", "..")
