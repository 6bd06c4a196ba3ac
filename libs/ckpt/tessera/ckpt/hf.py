"""Hugging Face safetensors files: one ``model.safetensors`` or shards plus an index.

Renaming keys to and from HF names is the model adapters' job (tessera.models): ``import_hf``
and ``export_hf`` take them as callables. Those two move a (sharded) model to and from such a
folder one tensor at a time, so that no rank ever holds the whole model (70B/405B). HF tensors
that are slices of one stacked model tensor (MoE experts: one HF tensor per expert, one
``[n_experts, ...]`` parameter) are named by a third callable and imported slice by slice.
A weight that transformers stores quantised in two tensors (MXFP4: ``<name>_blocks`` and
``<name>_scales``, GPT-OSS's experts) reaches the adapter as one call with both, which it
dequantises.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tessera.ckpt.folders import ExtraFiles, check_extra_files, fsync_path, publish, write_extra_files
from tessera.ckpt.formats import check_state_dict
from tessera.ckpt.paths import is_file_name

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# An adapter bound to its model args, e.g. ``lambda sd: spec.hf_adapter.to_hf(sd, args)``: it
# must accept any subset of keys, since it is called with one tensor at a time.
Convert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
Plan = list[tuple[str, list[str]]]  # (file name, tensor names in it), in writing order
# HF name -> (model key, index) when the HF tensor is ``model_tensor[index]`` of a tensor stacked
# on dim 0 (e.g. ``lambda name: spec.hf_adapter.stacked_slice(name, args)``), else None.
Stacked = Callable[[str], tuple[str, int] | None]
# Model key -> the name of the group of model tensors ``to_hf`` converts in one call (a layer's
# experts w1 and w3, which HF fuses into one tensor: ``spec.hf_adapter.export_group``), or None
# for a tensor converted alone.
Together = Callable[[str], str | None]
# Suffixes of the HF tensors that hold one weight together (MXFP4: the 4-bit blocks, their scales).
COMPANIONS = ("_blocks", "_scales")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _check_tensors(state_dict: dict[str, object]) -> None:
    for name, tensor in state_dict.items():
        if isinstance(tensor, DTensor):
            raise ValueError(f"save_hf: {name!r} is a DTensor; gather it with .full_tensor() first")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"save_hf: {name!r} is a {type(tensor).__name__}, not a tensor")


def _plain_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, no two sharing memory (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        if tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


def _shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> Plan:
    """HF's layout for tensors of these byte sizes: files filled in key order up to
    ``max_shard_bytes`` (a bigger tensor gets a file of its own); one file is ``model.safetensors``."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, size in sizes.items():
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size
    if len(shards) == 1:
        return [(SINGLE_FILE, shards[0])]
    return [(f"model-{i:05d}-of-{len(shards):05d}.safetensors", names) for i, names in enumerate(shards, start=1)]


def _write_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    try:
        save_file(_plain_tensors(tensors), path, metadata={"format": "pt"})
    except SafetensorError as e:  # a failed write (full disk) comes as safetensors' own error, the OS's inside
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from e
    fsync_path(path)


def _write_files(folder: Path, plan: Plan, total_size: int, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Writes the planned files, taking ``(name, tensor)`` pairs from ``tensors`` in plan order:
    one file's tensors are held at a time. Several files get ``model.safetensors.index.json``
    ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}). Each file is fsynced, as
    DCP does its own, so an export published by renaming its folder holds whole files."""
    folder.mkdir(parents=True, exist_ok=True)
    for filename, names in plan:
        _write_file(folder / filename, dict(itertools.islice(tensors, len(names))))
    if len(plan) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": {n: f for f, names in plan for n in names}}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        fsync_path(folder / INDEX_FILE)


def save_hf(state_dict: dict[str, torch.Tensor], folder: str | os.PathLike, max_shard_bytes: int = 5 * 10**9) -> None:
    """Writes ``state_dict`` (HF names, full tensors) to ``folder`` in Hugging Face's layout.

    Up to ``max_shard_bytes`` it is one ``model.safetensors``; beyond, shards
    ``model-0000i-of-0000n.safetensors`` filled in key order plus ``model.safetensors.index.json``.
    A folder that already holds such files is refused rather than mixed.
    """
    folder = Path(folder)
    existing = sorted(folder.glob("model*.safetensors*")) if folder.is_dir() else []
    if existing:
        raise ValueError(f"save_hf: {folder} already holds a checkpoint ({existing[0].name}); use an empty folder")
    _check_tensors(state_dict)
    sizes = {name: _nbytes(tensor) for name, tensor in state_dict.items()}
    plan = _shard_plan(sizes, max_shard_bytes)
    _write_files(folder, plan, sum(sizes.values()), iter(state_dict.items()))


def _checkpoint_files(folder: Path) -> dict[Path, list[str] | None]:
    """The folder's safetensors files, each with the names the index puts there (None: a
    single file, whose own header lists them)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"Hugging Face checkpoint folder {folder} does not exist")
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        if not (folder / SINGLE_FILE).is_file():
            raise FileNotFoundError(f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        return {folder / SINGLE_FILE: None}
    try:
        weight_map = dict(json.loads(index_path.read_text())["weight_map"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index_path} is not a valid index ({e!r})") from None
    files: dict[Path, list[str] | None] = {}
    for name, filename in weight_map.items():
        if not is_file_name(filename):
            raise ValueError(f"{index_path} maps {name!r} to {filename!r}, not a file name in the folder")
        files.setdefault(folder / filename, []).append(name)
    return files


def _open(path: Path):
    """A safetensors handle reading tensors one by one (the header is checked against the file size)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None


def _names(handle, path: Path, listed: list[str] | None) -> list[str]:
    """The names to read from an open file: all, or those the index lists, which must be there."""
    if listed is None:
        return list(handle.keys())
    present = set(handle.keys())
    missing = [name for name in listed if name not in present]
    if missing:
        raise ValueError(f"{missing[0]!r} is listed in {path.parent / INDEX_FILE} but missing from {path}")
    return listed


def load_hf(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Reads a whole Hugging Face checkpoint folder (single file or index + shards) onto the CPU."""
    state_dict = {}
    for path, listed in _checkpoint_files(Path(folder)).items():
        with _open(path) as handle:
            for name in _names(handle, path, listed):
                state_dict[name] = handle.get_tensor(name)
    return state_dict


def _file_shapes(folder: Path) -> dict[Path, dict[str, list[int]]]:
    """Each file's tensor names and shapes, from the headers only."""
    shapes = {}
    for path, listed in _checkpoint_files(folder).items():
        with _open(path) as handle:
            shapes[path] = {name: handle.get_slice(name).get_shape() for name in _names(handle, path, listed)}
    return shapes


def _groups(names: list[str]) -> dict[str, tuple[str, ...]]:
    """The HF tensors converted together, by their first name: a quantised weight's companions
    (``COMPANIONS``, when all of them exist), every other tensor alone."""
    present, groups = set(names), {}
    for name in names:
        stem = next((name.removesuffix(suffix) for suffix in COMPANIONS if name.endswith(suffix)), None)
        members = tuple(stem + suffix for suffix in COMPANIONS) if stem is not None else (name,)
        if not present.issuperset(members):
            members = (name,)  # half a pair: the adapter names it
        if members[0] == name:
            groups[name] = members
    return groups


def hf_tensor_names(folder: str | os.PathLike) -> list[str]:
    """The tensor names a Hugging Face folder holds, from the file headers only."""
    return [name for shapes in _file_shapes(Path(folder)).values() for name in shapes]


def quantized_weights(folder: str | os.PathLike) -> list[str]:
    """The weights a Hugging Face folder stores quantised as companions (``COMPANIONS``: MXFP4's
    ``<name>_blocks`` + ``<name>_scales``), by ``<name>``, from the file headers only: what a
    loader must dequantise (the adapter's job, ``import_hf`` hands it both)."""
    names = hf_tensor_names(folder)
    return [members[0].removesuffix(COMPANIONS[0]) for members in _groups(names).values() if len(members) > 1]


def _convert_names(tensors: dict[str, torch.Tensor], groups: dict[str, tuple[str, ...]], convert: Convert,
                   source: str) -> dict[str, dict[str, torch.Tensor]]:
    """What ``convert`` makes of each group of tensors (``_groups``): first name -> {converted
    name: tensor}. Given meta tensors it costs no data and still checks the shapes the conversion
    (e.g. a permutation) needs. A converted name made from two groups is ambiguous, hence an error."""
    converted, origin = {}, {}
    for first, members in groups.items():
        converted[first] = convert({name: tensors[name] for name in members})
        for new_name in converted[first]:
            if new_name in origin:
                raise ValueError(f"{source}: {origin[new_name]!r} and {first!r} both convert to {new_name!r}")
            origin[new_name] = first
    return converted


def _copy_full(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copies a full tensor into a model tensor in place (so tied parameters stay one tensor);
    a DTensor takes only its own shard, cut locally: every rank has the full tensor already."""
    with torch.no_grad():
        if isinstance(target, DTensor):
            full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
            target = target.to_local()
        target.copy_(full)


def _load_group(read: Callable[[str], torch.Tensor], members: tuple[str, ...], from_hf: Convert,
                model_state: dict[str, torch.Tensor]) -> None:
    """Reads one group of tensors (one, or a quantised weight's companions) and copies what they
    convert to into the model. Everything read dies on return, so the next read starts with no
    full tensor alive."""
    for key, full in from_hf({name: read(name) for name in members}).items():
        if key in model_state:
            _copy_full(model_state[key], full)


def _stacks(metas: dict[str, torch.Tensor], stacked: Stacked | None,
            source: str) -> tuple[dict[str, tuple[str, int]], dict[str, torch.Tensor]]:
    """(each slice's HF name -> (model key, index), each stacked key -> its meta tensor). The
    slices of a key must be indices 0..n-1 of one shape: a gap, a repeat or a stray shape is a
    ValueError naming the key (a missing last slice shows as a shape the model does not have)."""
    slots = {name: slot for name in metas if stacked is not None and (slot := stacked(name)) is not None}
    slices: dict[str, dict[int, str]] = {}
    for name, (key, index) in slots.items():
        if index in slices.setdefault(key, {}):
            raise ValueError(f"{source}: {slices[key][index]!r} and {name!r} are both slice {index} of {key!r}")
        slices[key][index] = name
    stacked_metas = {}
    for key, names in slices.items():
        if sorted(names) != list(range(len(names))):
            raise ValueError(f"{source}: {key!r} is stacked from slices {sorted(names)}, not 0..{len(names) - 1}")
        shapes = sorted({tuple(metas[name].shape) for name in names.values()})
        if len(shapes) > 1:
            raise ValueError(f"{source}: the slices of {key!r} differ in shape: {shapes[:2]}")
        stacked_metas[key] = torch.empty((len(names), *shapes[0]), device="meta")
    return slots, stacked_metas


def _local_region(target: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's part of a model tensor and the global region it holds, one slice per dim
    (a DTensor's shard is one box of the global tensor, under FSDP over EP or TP too: torch's
    helper answers as it does for DCP, strided FSDP placements included)."""
    if not isinstance(target, DTensor):
        return target, tuple(slice(0, n) for n in target.shape)
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return target.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _load_slice(handle, name: str, region: tuple[torch.Tensor, tuple[slice, ...]], index: int) -> None:
    """Reads one slice of a stacked tensor and copies the part this rank holds into its shard."""
    local, (rows, *rest) = region
    with torch.no_grad():
        local[index - rows.start].copy_(handle.get_tensor(name)[tuple(rest)])


def import_hf(model: nn.Module, folder: str | os.PathLike, from_hf: Convert, *,
              model_shapes: dict[str, tuple[int, ...]] | None = None, stacked: Stacked | None = None) -> None:
    """Loads a Hugging Face checkpoint folder into ``model`` (plain, FSDP, TP: any DTensor
    placements) in place, holding at most one full tensor at a time (a quantised weight: its
    companions, ``COMPANIONS``) and reading each at most once.

    Call it on every rank; it needs no communication. Names and shapes are checked against
    ``model_shapes`` (default: ``model``'s own) from the file headers before any data is read
    (one-line ValueError). Pass the whole model's shapes when ``model`` is one pipeline stage:
    tensors the stage lacks are then not read at all. HF tensors that ``stacked`` places in a
    stacked model tensor bypass ``from_hf``: a rank reads only the slices its shard holds rows of
    (expert parallel: its own experts) and copies them in, never building the stacked tensor.
    """
    folder = Path(folder)
    source = f"Hugging Face checkpoint {folder}"
    file_shapes = _file_shapes(folder)
    metas = {name: torch.empty(shape, device="meta") for shapes in file_shapes.values() for name, shape in shapes.items()}
    slots, stacked_metas = _stacks(metas, stacked, source)
    groups = _groups([name for name in metas if name not in slots])
    targets = _convert_names(metas, groups, from_hf, source)
    converted = {key: meta for keys in targets.values() for key, meta in keys.items()}
    both = sorted(converted.keys() & stacked_metas.keys())
    if both:
        raise ValueError(f"{source}: {both[0]!r} is both converted and stacked from slices")
    model_state = get_model_state_dict(model)  # tensors sharing storage with the model's own
    if model_shapes is None:
        model_shapes = {key: tuple(value.shape) for key, value in model_state.items()}  # DTensor: global shape
    check_state_dict({**converted, **stacked_metas}, model_shapes, source, "the model")
    regions = {key: _local_region(model_state[key]) for key in stacked_metas if key in model_state}

    def needed(name: str) -> bool:  # a stacked slice, or the first tensor of a group
        if name not in slots:
            return name in targets and bool(model_state.keys() & targets[name].keys())
        key, index = slots[name]
        return key in regions and regions[key][1][0].start <= index < regions[key][1][0].stop

    file_of = {name: path for path, shapes in file_shapes.items() for name in shapes}
    for path, shapes in file_shapes.items():
        names = [name for name in shapes if needed(name)]
        if names:
            with _open(path) as handle:
                def read(name: str) -> torch.Tensor:  # a companion may sit in another shard file
                    if file_of[name] == path:
                        return handle.get_tensor(name)
                    with _open(file_of[name]) as other:
                        return other.get_tensor(name)

                for name in names:
                    if name in slots:
                        _load_slice(handle, name, regions[slots[name][0]], slots[name][1])
                    else:
                        _load_group(read, groups[name], from_hf, model_state)


def _writer_decides(answer: bool) -> bool:
    """Rank 0's answer on every rank, so that all ranks take the same (collective) branch."""
    if not dist.is_initialized():
        return answer
    box = [answer]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _whole(value: torch.Tensor | None, meta: torch.Tensor, owner: int, stages: _Stages) -> torch.Tensor | None:
    """One model tensor, whole, where the writer needs it: gathered by its own stage's ranks
    (``full_tensor()`` is collective over them) and, when another pipeline stage holds it, sent
    on to the writer's stage. None where it is not needed."""
    full = None
    if stages.rank == owner:
        full = value.full_tensor() if isinstance(value, DTensor) else value
    if owner == 0 or not stages.with_writer:
        return full
    if stages.rank == owner:
        dist.send(full.contiguous(), group=stages.group, group_dst=0)
    elif stages.rank == 0:
        full = torch.empty(meta.shape, dtype=meta.dtype, device=stages.device)
        dist.recv(full, group=stages.group, group_src=owner)
    return full


def _export_groups(keys: list[str], together: Together | None) -> dict[str, tuple[str, ...]]:
    """The model tensors converted together (``together``), by their first key; the rest alone."""
    groups, first = {}, {}
    for key in keys:
        name = together(key) if together is not None else None
        if name is None:
            groups[key] = (key,)
        elif name in first:
            groups[first[name]] += (key,)
        else:
            first[name], groups[key] = key, (key,)
    return groups


def _gathered(model_state: dict[str, torch.Tensor], metas: dict[str, torch.Tensor], owners: dict[str, int],
              groups: list[tuple[str, ...]], to_hf: Convert, dtype: torch.dtype | None, stages: _Stages,
              keep: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors in HF names as CPU tensors of ``dtype`` on the writer (``keep``), one
    group (``_export_groups``) at a time; every rank walks the same keys in the same order, since
    the gathers are collective."""
    for keys in groups:
        fulls = {key: _whole(model_state.get(key), metas[key], owners[key], stages) for key in keys}
        if keep:
            yield from ((name, tensor.to("cpu", dtype)) for name, tensor in to_hf(fulls).items())
        del fulls  # before the next gather: one group's full tensors alive at a time


@dataclasses.dataclass(frozen=True)
class _Stages:
    group: dist.ProcessGroup | None  # the pipeline's group, None without pipeline stages
    rank: int  # this rank's stage rank in it
    with_writer: bool  # the group holds global rank 0, which writes the files
    device: torch.device  # where this rank's tensors live


def _stage_metas(model_state: dict[str, torch.Tensor], pp_group) -> tuple[dict[str, torch.Tensor], dict[str, int], _Stages]:
    """Every stage's tensor shapes and dtypes (meta tensors), in stage order, and the stage rank
    holding each."""
    device = next((v.device for v in model_state.values()), torch.device("cpu"))
    local = {key: torch.empty(value.shape, dtype=value.dtype, device="meta") for key, value in model_state.items()}
    if pp_group is None:
        return local, dict.fromkeys(local, 0), _Stages(None, 0, False, device)
    everyone = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(everyone, {key: (tuple(m.shape), m.dtype) for key, m in local.items()}, group=pp_group)
    metas, owners = {}, {}
    for owner, shapes in enumerate(everyone):
        for key, (shape, tensor_dtype) in shapes.items():
            metas[key], owners[key] = torch.empty(shape, dtype=tensor_dtype, device="meta"), owner
    stages = _Stages(pp_group, dist.get_rank(pp_group), 0 in dist.get_process_group_ranks(pp_group), device)
    return metas, owners, stages


def export_hf(model: nn.Module | Sequence[nn.Module], folder: str | os.PathLike, to_hf: Convert, *,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 10**9, pp_group=None,
              extra_files: ExtraFiles | None = None, together: Together | None = None) -> bool:
    """Writes ``model`` (plain or DTensor parameters) as a Hugging Face folder, cast to ``dtype``
    (default: as the model holds it). Collective. Under pipeline parallel pass this rank's stages
    (modules whose parameter names are the whole model's) and the pipeline's process group: the
    tensors of the other stages travel to rank 0, one at a time.

    Files are planned up front from the global shapes (``save_hf``'s layout), then filled one
    tensor at a time: rank 0 holds at most one file's tensors (on the CPU), the others one tensor
    (the tensors ``together`` names alike: one group of them, converted in one call).
    Written to ``.<name>.tmp`` next to ``folder`` and renamed when complete, so ``folder`` is
    whole or absent (a failed write removes the tmp folder; its OSError names ``folder``).
    Returns False, writing nothing, when ``folder`` already exists.
    ``extra_files`` (name -> bytes, or a path to copy) go in beside the weights: ``config.json``
    and tokenizer files, which ``transformers``' ``from_pretrained`` needs to open the folder.
    """
    check_extra_files(extra_files or {})
    final = Path(folder)
    if _writer_decides(final.exists()):
        return False
    writer = not dist.is_initialized() or dist.get_rank() == 0
    model_state = {}
    for part in [model] if isinstance(model, nn.Module) else model:
        model_state.update(get_model_state_dict(part))
    metas, owners, stages = _stage_metas(model_state, pp_group)
    cast = {key: meta.to(dtype) if dtype else meta for key, meta in metas.items()}
    groups = _export_groups(list(cast), together)
    hf_metas = _convert_names(cast, groups, to_hf, f"Hugging Face export {final}")
    sizes = {name: _nbytes(meta) for names in hf_metas.values() for name, meta in names.items()}
    plan = _shard_plan(sizes, max_shard_bytes)
    kept = [groups[first] for first, names in hf_metas.items() if names]
    tensors = _gathered(model_state, metas, owners, kept, to_hf, dtype, stages, writer)
    tmp = final.with_name(f".{final.name}.tmp")
    try:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                _write_files(tmp, plan, sum(sizes.values()), tensors)
                write_extra_files(tmp, extra_files or {})
                publish(tmp, final)
            except BaseException as e:  # a full disk, a stop: no half-written folder stays
                shutil.rmtree(tmp, ignore_errors=True)
                if not isinstance(e, OSError):
                    raise
                what = f"cannot write Hugging Face export {final}"  # named as the user knows it
                raise (OSError(e.errno, f"{what}: {e.strerror}") if e.errno else OSError(f"{what}: {e}")) from e
    finally:
        for _ in tensors:  # the other ranks gather here; a writer that failed keeps pace with them
            pass
        if dist.is_initialized():  # the others wait for the folder, and for a failure to surface on rank 0
            dist.barrier()
    return True
