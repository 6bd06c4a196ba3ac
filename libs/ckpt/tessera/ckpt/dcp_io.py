"""Reading DCP checkpoints without executing pickled code, with errors that name the culprit.

Stock DCP (torch 2.13) unpickles in two places: ``FileSystemReader.read_metadata`` runs a
plain ``pickle.load`` on ``.metadata``, and ``DefaultLoadPlanner.load_bytes`` decodes every
non-tensor object (e.g. optimizer ``param_groups`` values) with ``torch.load(weights_only=False)``.
Whether an entry is read as bytes is decided by the checkpoint's own metadata, so a crafted
checkpoint could run code through either path. Here ``.metadata`` goes through an unpickler
that admits only DCP's metadata classes, and objects through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.futures import Future

from tessera.ckpt.paths import is_file_name

logger = logging.getLogger("tessera.ckpt")

METADATA_FILE = ".metadata"

# DCP warns on every save/load without a process group (also from async save threads, where a
# catch_warnings block cannot reach); one process without a group is a supported mode here.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized, assuming")

_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


# what damaged bytes raise while they are unzipped or unpickled (measured with random byte flips,
# in the pickles too: torch's zip reader's RuntimeErrors, UnicodeDecodeError, UnpicklingError, the
# unpickler's IndexError on its stack, KeyError on its memo); anything else, a bug included, keeps
# its own type and traceback
_DAMAGE = (pickle.UnpicklingError, RuntimeError, ValueError, EOFError, IndexError, KeyError)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def read_metadata(checkpoint: str | os.PathLike) -> Metadata:
    """The checkpoint's ``.metadata``, unpickled with only DCP's metadata classes allowed."""
    path = Path(checkpoint) / METADATA_FILE
    if not path.is_file():
        raise ValueError(f"checkpoint {checkpoint} is incomplete or not a DCP checkpoint: {path} is missing")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001  pickle's opcodes on damaged bytes raise any type (KeyError, IndexError, ...)
        raise ValueError(f"checkpoint metadata {path} is unreadable: {e}") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"checkpoint metadata {path} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def stored_keys(checkpoint: str | os.PathLike) -> frozenset[str]:
    """The flattened keys a DCP checkpoint holds ("model.norm.weight"), from its metadata alone:
    which states it has, or whose layout it is, before anything is loaded."""
    return frozenset(read_metadata(checkpoint).state_dict_metadata)


def check_storage_files(checkpoint: str | os.PathLike, metadata: Metadata) -> None:
    """Every data file the metadata names exists and is long enough (catches truncation)."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path
        if not is_file_name(name):
            raise ValueError(f"checkpoint {checkpoint} is corrupt: its metadata names data file {name!r}, not a file "
                             "in the folder")
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for relative_path, size in sorted(needed.items()):
        path = Path(checkpoint) / relative_path
        if not path.is_file():
            raise ValueError(f"checkpoint {checkpoint} is corrupt: data file {path} is missing")
        actual = path.stat().st_size
        if actual < size:
            raise ValueError(f"checkpoint {checkpoint} is corrupt: data file {path} is truncated ({actual} of {size} bytes)")


def safe_torch_load(data: io.BytesIO | bytes, what: str) -> Any:
    """``torch.load(weights_only=True)``: tensors, numbers, strings and containers only."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{what} is not weights_only-safe: {_reason(e)}") from None


def _reason(e: Exception) -> str:
    """Why a read failed, in one line: torch's weights_only refusal is a paragraph of advice around
    the unpickler's own reason ("Unsupported operand 0"), which is what names the damage."""
    text = str(e)
    _, found, cause = text.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (cause if found else text).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    return f"not a weights-only pickle: {lines[0]}" if found else lines[0]


class _SafeReader(FileSystemReader):
    """FileSystemReader with the safe metadata unpickler; names the data file a read failed on."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then skips its per-rank metadata fallback
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except _DAMAGE as e:
                if isinstance(e, torch.OutOfMemoryError):
                    raise
                raise ValueError(f"checkpoint data file {Path(self.path) / relative_path} is corrupt: {_reason(e)}") from None
        done: Future = Future()
        done.set_result(None)
        return done


class _SafeLoadPlanner(DefaultLoadPlanner):
    """Checks keys and shapes up front and decodes objects with weights_only=True.

    Keys starting with one of ``optional_prefixes`` may be absent from the checkpoint (their
    current values are kept), every other missing key is an error.
    """

    def __init__(self, checkpoint: str | os.PathLike, optional_prefixes: tuple[str, ...] = ()) -> None:
        super().__init__()
        self._checkpoint = checkpoint
        self._optional_prefixes = optional_prefixes

    def create_local_plan(self):
        stored = self.metadata.state_dict_metadata
        for fqn, value in list(self.state_dict.items()):
            md = stored.get(fqn)
            if md is None:
                if fqn.startswith(self._optional_prefixes):
                    logger.warning("checkpoint %s has no %r; keeping the current value", self._checkpoint, fqn)
                    del self.state_dict[fqn]
                    continue
                raise ValueError(f"checkpoint {self._checkpoint} is missing key {fqn!r}")
            is_tensor = isinstance(value, torch.Tensor)
            if isinstance(md, TensorStorageMetadata) and is_tensor and tuple(md.size) != tuple(value.size()):
                raise ValueError(
                    f"checkpoint {self._checkpoint}: {fqn!r} has shape {tuple(md.size)} there "
                    f"but {tuple(value.size())} here"
                )
            if isinstance(md, BytesStorageMetadata) == is_tensor:
                kind = "an object" if isinstance(md, BytesStorageMetadata) else "a tensor"
                raise ValueError(f"checkpoint {self._checkpoint}: {fqn!r} is stored as {kind}, which does not match {type(value).__name__}")
        return super().create_local_plan()

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = safe_torch_load(value, f"object {fqn!r} in checkpoint {self._checkpoint}")
        set_element(self.original_state_dict, self.mappings[fqn], obj)


def raise_first_failure(e: CheckpointException) -> None:
    """DCP gathers each rank's exception into one CheckpointException (a BaseException);
    re-raise the lowest rank's own exception so callers see a plain, one-line error. An
    OSError stays one (a full disk, a read-only folder: the caller names the folder); anything
    else is a RuntimeError caused by the rank's own exception, whose traceback it keeps (another
    rank's, which arrives without one, as a note)."""
    rank = min(e.failures)
    error, stack = e.failures[rank]
    if isinstance(error, (ValueError, FileNotFoundError)):
        raise type(error)(str(error)) from None
    if isinstance(error, OSError):
        raise (OSError(error.errno, error.strerror, error.filename) if error.errno else OSError(str(error))) from None
    failure = RuntimeError(f"checkpoint operation failed on rank {rank}: {error!r}")
    if error.__traceback__ is None and stack and hasattr(failure, "add_note"):  # another rank's: its frames came as text
        failure.add_note(f"rank {rank}'s traceback (most recent call last):\n" + "".join(stack.format()).rstrip())
    raise failure from error  # a bug: its traceback


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def load_into(
    state_dict: dict[str, Any],
    checkpoint: str | os.PathLike,
    *,
    metadata: Metadata | None = None,
    process_group: dist.ProcessGroup | None = None,
    optional_prefixes: tuple[str, ...] = (),
    single_process: bool = False,
) -> None:
    """DCP-loads ``checkpoint`` into ``state_dict`` in place (resharding as DCP does), safely.

    Collective over ``process_group`` when torch.distributed is initialised, unless
    ``single_process``.
    """
    if metadata is None:
        metadata = read_metadata(checkpoint)
        check_storage_files(checkpoint, metadata)
    try:
        dcp.load(
            state_dict,
            storage_reader=_SafeReader(checkpoint, metadata),
            planner=_SafeLoadPlanner(checkpoint, optional_prefixes),
            process_group=process_group,
            no_dist=single_process or _no_dist(),
        )
    except CheckpointException as e:
        raise_first_failure(e)


def save_state_dict(
    state_dict: dict[str, Any],
    checkpoint: str | os.PathLike,
    process_group: dist.ProcessGroup | None = None,
    single_process: bool = False,
) -> None:
    """``dcp.save`` into ``checkpoint``; without a process group (or with ``single_process``)
    this process alone writes it."""
    try:
        dcp.save(
            state_dict, checkpoint_id=checkpoint, process_group=process_group, no_dist=single_process or _no_dist()
        )
    except CheckpointException as e:
        raise_first_failure(e)
