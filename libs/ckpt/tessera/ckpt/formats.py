"""Whole DCP checkpoints in one process: read, write, and convert to and from torch.save files.

torch's own ``format_utils`` unpickles with ``weights_only=False``; these go through the safe
readers of ``dcp_io`` instead.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tessera.ckpt.dcp_io import check_storage_files, load_into, read_metadata, save_state_dict
from tessera.ckpt.folders import publish


def check_state_dict(state_dict: dict[str, Any], expected: dict[str, tuple[int, ...]], source: str, target: str) -> None:
    """Keys and shapes of ``state_dict`` must be exactly ``expected`` (key -> shape of ``target``);
    the first difference is a ValueError naming ``source``, the key and both shapes."""
    for key, shape in expected.items():
        if key not in state_dict:
            raise ValueError(f"{source} lacks {key!r}, which {target} has")
        if tuple(state_dict[key].shape) != tuple(shape):
            raise ValueError(f"{source}: {key!r} has shape {tuple(state_dict[key].shape)} but {target} needs {tuple(shape)}")
    extra = sorted(set(state_dict) - set(expected))
    if extra:
        raise ValueError(f"{source} has {extra[0]!r}, which {target} does not have")


def read_dcp(dcp_dir: str | os.PathLike, only: str | None = None) -> dict[str, Any]:
    """Everything in a DCP checkpoint, consolidated into full CPU tensors and nested as saved
    (e.g. ``{"model": {...}, "optimizer": {...}}``); ``only="model"`` reads just that state."""
    path = Path(dcp_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"DCP checkpoint folder {path} does not exist")
    metadata = read_metadata(path)
    check_storage_files(path, metadata)
    paths = metadata.planner_data or {}
    flat: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if only is not None and paths.get(fqn, (fqn,))[0] != only:
            continue
        # A destination of the saved size and dtype; objects get a placeholder DCP replaces.
        flat[fqn] = torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else b""
    if only is not None and not flat:
        names = sorted({paths.get(fqn, (fqn,))[0] for fqn in metadata.state_dict_metadata})
        raise ValueError(f"DCP checkpoint {path} has no state {only!r}; it holds {names}")
    load_into(flat, path, metadata=metadata, single_process=True)
    nested: dict[str, Any] = {}
    for fqn, value in flat.items():
        set_element(nested, paths.get(fqn, (fqn,)), value)
    return nested[only] if only is not None else nested


def write_dcp(state_dict: dict[str, Any], dcp_dir: str | os.PathLike) -> None:
    """Saves ``state_dict`` from this process as a new DCP checkpoint folder, atomically."""
    dest = Path(dcp_dir)
    if dest.exists():
        raise ValueError(f"{dest} already exists; refusing to overwrite it")
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_state_dict(state_dict, tmp, single_process=True)
    publish(tmp, dest)


def dcp_to_torch_save(dcp_dir: str | os.PathLike, out_file: str | os.PathLike) -> None:
    """One ``torch.save`` file holding the whole checkpoint (see ``read_dcp``). A failed write
    (read-only folder, full disk) is an OSError naming ``out_file``: torch's writer reports it as
    a RuntimeError, with the OSError of a Python file's write as its context."""
    state = read_dcp(dcp_dir)
    try:
        with open(out_file, "wb") as f:
            torch.save(state, f)
        return
    except RuntimeError as e:
        if not isinstance(e.__context__, OSError):
            raise
        error = e.__context__
    except OSError as e:
        error = e
    if error.errno is None:
        raise OSError(f"cannot write {out_file}: {error}") from error
    raise OSError(error.errno, error.strerror, str(out_file)) from error


def torch_save_to_dcp(torch_file: str | os.PathLike, dcp_dir: str | os.PathLike) -> None:
    """A DCP checkpoint from a ``torch.save`` file of a dict, loaded with ``weights_only=True``."""
    path = Path(torch_file)
    if not path.is_file():
        raise FileNotFoundError(f"torch.save file {path} does not exist")
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise ValueError(f"{path} is not a weights_only-loadable torch.save file: {str(e).splitlines()[0]}") from None
    if not isinstance(state_dict, dict):
        raise ValueError(f"{path} holds a {type(state_dict).__name__}, not a dict")
    write_dcp(state_dict, dcp_dir)
