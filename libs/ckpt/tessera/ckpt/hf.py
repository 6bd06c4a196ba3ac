"""Hugging Face safetensors files: one ``model.safetensors`` or shards plus an index.

Only files here; renaming keys to and from HF names is the model adapters' job (tessera.models).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _plain_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, no two sharing memory (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for name, tensor in state_dict.items():
        if isinstance(tensor, DTensor):
            raise ValueError(f"save_hf: {name!r} is a DTensor; gather it with .full_tensor() first")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"save_hf: {name!r} is a {type(tensor).__name__}, not a tensor")
        tensor = tensor.detach().cpu().contiguous()
        if tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


def save_hf(state_dict: dict[str, torch.Tensor], folder: str | os.PathLike, max_shard_bytes: int = 5 * 10**9) -> None:
    """Writes ``state_dict`` (HF names, full tensors) to ``folder`` in Hugging Face's layout.

    Up to ``max_shard_bytes`` it is one ``model.safetensors``; beyond, shards
    ``model-0000i-of-0000n.safetensors`` filled in key order plus ``model.safetensors.index.json``
    ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}). A folder that already
    holds such files is refused rather than mixed.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"save_hf: max_shard_bytes must be positive, got {max_shard_bytes}")
    folder = Path(folder)
    existing = sorted(folder.glob("model*.safetensors*")) if folder.is_dir() else []
    if existing:
        raise ValueError(f"save_hf: {folder} already holds a checkpoint ({existing[0].name}); use an empty folder")
    tensors = _plain_tensors(state_dict)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        if shards[-1] and shard_bytes + _nbytes(tensor) > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += _nbytes(tensor)

    folder.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        save_file(shards[0], folder / SINGLE_FILE, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"load_hf: {path} does not exist")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"load_hf: {path} is not a readable safetensors file: {e}") from None


def load_hf(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Reads a Hugging Face checkpoint folder (single file or index + shards) onto the CPU."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"load_hf: folder {folder} does not exist")
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        if not (folder / SINGLE_FILE).is_file():
            raise FileNotFoundError(f"load_hf: {folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        return _load_safetensors(folder / SINGLE_FILE)
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"load_hf: {index_path} is not a valid index ({e!r})") from None
    files: dict[str, dict[str, torch.Tensor]] = {}
    state_dict = {}
    for name, filename in weight_map.items():
        if not isinstance(filename, str) or Path(filename).name != filename:
            raise ValueError(f"load_hf: {index_path} maps {name!r} to {filename!r}, not a file name in the folder")
        if filename not in files:
            files[filename] = _load_safetensors(folder / filename)
        if name not in files[filename]:
            raise ValueError(f"load_hf: {name!r} is listed in {index_path} but missing from {folder / filename}")
        state_dict[name] = files[filename][name]
    return state_dict
