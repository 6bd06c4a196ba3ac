"""convert: move checkpoints between DCP, Hugging Face safetensors and torch.save files.

  convert dcp-to-hf [--flavor 8B | --hf_config <folder or config.json>] <dcp_dir> <out_dir>
  convert hf-to-dcp [--flavor 8B | --hf_config <folder or config.json>] <hf_dir> <out_dcp_dir>
  convert dcp-to-torch <dcp_dir> <out.pt>

<dcp_dir> is one checkpoint, e.g. <checkpoint folder>/step-1000. The model's shape comes from,
in order: the checkpoint's own record (model_args.json, which the trainer and hf-to-dcp write
beside the weights: vocabulary and context length as trained), --hf_config (a Hugging Face
config.json), --flavor of --model (default llama3); hf-to-dcp without either reads <hf_dir>'s
config.json, and with --flavor checks that config.json against the flavor; a shape read from a
config.json leaves out the modules it names but the weights lack (DeepSeek-V3's multi-token
prediction, which transformers does not save), as the trainer does. dcp-to-hf writes
config.json beside the safetensors, so transformers' from_pretrained opens the folder.

The model weights live under the state name given by --state ("model", as the trainer saves
them). Nothing is unpickled beyond what torch.load(weights_only=True) allows. An existing output
is replaced only with --force, and outputs appear whole (written under a hidden name, then
renamed); an output that is, holds or lies inside the source is refused. Bad input: one line on
stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from tessera.ckpt import check_state_dict, dcp_to_torch_save, load_hf, read_dcp, save_hf, write_dcp
from tessera.models import ARGS_FILE, CONFIG_FILE, args_record, get_model_spec, read_args_record, read_hf_config
from tessera.models.hf_config import config_file
from tessera.models.spec import hf_export_note

DEFAULT_MODEL = "llama3"
_TOKEN_IDS = ("bos_token_id", "eos_token_id")


def _hf_spec(name: str):
    spec = get_model_spec(name)
    if spec.hf_adapter is None or spec.hf_config is None:
        raise ValueError(f"model {name} has no Hugging Face adapter")
    return spec


def _flavor(spec, flavor: str):
    if flavor not in spec.flavors:
        raise ValueError(f"unknown flavor {flavor!r} of {spec.name}; known: {sorted(spec.flavors)}")
    return spec.flavors[flavor]


def _from_hf_config(spec, path: str | Path) -> tuple[object, dict, str]:
    """(args, token ids, description) from a Hugging Face config.json (or the folder holding it)."""
    file = config_file(path)
    config = read_hf_config(file)
    ids = {key: config[key] for key in _TOKEN_IDS if config.get(key) is not None}
    return spec.hf_config.args_from_config(config, str(file)), ids, f"the model of {file}"


def _from_flags(args: argparse.Namespace, beside: Path | None = None) -> tuple[object, object, dict, str]:
    """(spec, model args, token ids, description) from --hf_config, else --flavor, else the
    config.json ``beside`` the source (hf-to-dcp), which --flavor must agree with."""
    spec = _hf_spec(args.model or DEFAULT_MODEL)
    if args.hf_config:
        return spec, *_from_hf_config(spec, args.hf_config)
    if args.flavor:
        model_args, what = _flavor(spec, args.flavor), f"{spec.name}/{args.flavor}"
        if beside is not None and beside.is_file():
            spec.hf_config.check_config(model_args, read_hf_config(beside), str(beside), what)
        return spec, model_args, {}, what
    if beside is not None and beside.is_file():
        return spec, *_from_hf_config(spec, beside)
    missing = beside.name if beside is not None else ARGS_FILE
    raise ValueError(f"{args.src} has no {missing}: pass --flavor (and --model) or --hf_config")


def _from_record(args: argparse.Namespace) -> tuple[object, object, dict, str] | None:
    """(spec, model args, token ids, description) from the DCP checkpoint's model_args.json,
    which flags, when given, must agree with."""
    found = read_args_record(args.src)
    if found is None:
        return None
    spec, model_args, record = found
    source = Path(args.src) / ARGS_FILE
    for flag, value in (("--model", spec.name), ("--flavor", record.get("flavor"))):
        given = getattr(args, flag[2:])
        if given and value is not None and given != value:
            raise ValueError(f"{flag} {given} disagrees with {source}, which says {value}")
    if args.hf_config:
        raise ValueError(f"--hf_config: {source} already gives the model's shape")
    ids = {key: record[key] for key in _TOKEN_IDS if record.get(key) is not None}
    return _hf_spec(spec.name), model_args, ids, f"the model of {source}"


def _floating_dtype(state_dict: dict) -> str:
    """The name (as config.json's torch_dtype) of the weights' floating dtype."""
    dtype = next((v.dtype for v in state_dict.values() if v.is_floating_point()), torch.float32)
    return str(dtype).removeprefix("torch.")


def _check_against_model(state_dict: dict, spec, args, source: str, what: str) -> None:
    """Keys and shapes must be exactly those of the model the flavor builds."""
    with torch.device("meta"):
        expected = {key: tuple(value.shape) for key, value in spec.build(args).state_dict().items()}
    check_state_dict(state_dict, expected, source, what)


def _check_source(source: str, src: str) -> None:
    """The source folder must exist: said first, as a folder that is not there would otherwise be
    reported as one lacking model_args.json or config.json, or behind an output error."""
    path = Path(src)
    if not path.is_dir():
        raise FileNotFoundError(f"{source} {src} {'is not a folder' if path.exists() else 'does not exist'}")


def _check_apart(src: str, dst: str) -> None:
    """Refuses an output that is, holds or lies inside the source (symbolic links followed):
    writing it would change the source, and --force would replace the source."""
    source, output = Path(src).resolve(), Path(dst).resolve()
    overlap = ("is" if output == source else "lies inside" if source in output.parents
               else "holds" if output in source.parents else None)
    if overlap:
        raise ValueError(f"output {dst} {overlap} the source {src}; write it elsewhere")


def _write_output(dst: str, force: bool, is_file: bool, write: Callable[[Path], None]) -> None:
    """Runs ``write`` on a hidden sibling of ``dst``, then renames it to ``dst``: a crash leaves
    any earlier ``dst`` as it was. An existing ``dst`` (other than an empty folder, which a
    rename replaces) is replaced only with ``force``."""
    dst = Path(dst)
    if not dst.parent.is_dir():
        raise ValueError(f"output {dst}: its folder {dst.parent} does not exist")
    if dst.exists() and dst.is_dir() == is_file:
        found, wanted = ("a folder", "a file") if is_file else ("a file", "a folder")
        raise ValueError(f"output {dst} is {found}; this conversion writes {wanted}")
    occupied = dst.exists() and (is_file or any(dst.iterdir()))
    if occupied and not force:
        raise ValueError(f"output {dst} already exists; pass --force to replace it")
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        try:
            write(tmp)
        except OSError as e:  # a read-only folder, a full disk: said of the output, not of its hidden name
            if e.filename is None or not str(e.filename).startswith(str(tmp)):
                raise
            what = f"cannot write output {dst}"
            raise (OSError(e.errno, f"{what}: {e.strerror}") if e.errno else OSError(f"{what}: {e}")) from e
        if occupied and not is_file:  # a folder cannot be renamed over a non-empty one
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            os.rename(dst, old)
            try:
                os.rename(tmp, dst)
            except OSError:
                os.rename(old, dst)
                raise
            shutil.rmtree(old)
        else:
            os.replace(tmp, dst)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():
            tmp.unlink()


# Each command writes its output to `out` (a hidden name that _write_output publishes as args.dst).

def dcp_to_hf(args: argparse.Namespace, out: Path) -> None:
    spec, model_args, ids, what = _from_record(args) or _from_flags(args)
    state_dict = read_dcp(args.src, only=args.state)
    _check_against_model(state_dict, spec, model_args, f"DCP checkpoint {args.src}", what)
    note = hf_export_note(spec, model_args)
    if note:
        print(f"warning: {note}", file=sys.stderr)
    save_hf(spec.hf_adapter.to_hf(state_dict, model_args), out, max_shard_bytes=args.max_shard_bytes)
    hf_config = spec.hf_config.config_from_args(model_args, dtype=_floating_dtype(state_dict), **ids)
    (out / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")


def hf_to_dcp(args: argparse.Namespace, out: Path) -> None:
    spec, model_args, ids, what = _from_flags(args, beside=Path(args.src) / CONFIG_FILE)
    hf_state_dict = load_hf(args.src)
    fit = getattr(spec.hf_config, "fit_to_weights", None)
    if fit is not None and (args.hf_config or not args.flavor):  # modules config.json names but the weights lack
        model_args = fit(model_args, set(hf_state_dict))
    state_dict = spec.hf_adapter.from_hf(hf_state_dict, model_args)
    _check_against_model(state_dict, spec, model_args, f"Hugging Face checkpoint {args.src}", what)
    write_dcp({args.state: state_dict}, out)
    (out / ARGS_FILE).write_bytes(args_record(spec, model_args, **({"flavor": args.flavor} if args.flavor else {}), **ids))


def dcp_to_torch(args: argparse.Namespace, out: Path) -> None:
    dcp_to_torch_save(args.src, out)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, func, src, dst in (
        ("dcp-to-hf", dcp_to_hf, "DCP checkpoint folder", "output folder for safetensors"),
        ("hf-to-dcp", hf_to_dcp, "Hugging Face checkpoint folder", "output DCP checkpoint folder"),
    ):
        command = commands.add_parser(name)
        command.add_argument("--model", help=f"registered model spec (default {DEFAULT_MODEL})")
        command.add_argument("--flavor", help="flavor of the model, e.g. 8B")
        command.add_argument("--hf_config", help="a Hugging Face config.json, or the folder holding it: the model's shape")
        command.add_argument("--state", default="model", help="state name of the weights in the DCP checkpoint")
        command.add_argument("src", help=src)
        command.add_argument("dst", help=dst)
        command.add_argument("--force", action="store_true", help="replace an existing output")
        command.set_defaults(func=func, output_is_file=False, source=src)
    commands.choices["dcp-to-hf"].add_argument("--max-shard-bytes", type=int, default=5 * 10**9)
    command, src = commands.add_parser("dcp-to-torch"), "DCP checkpoint folder"
    command.add_argument("src", help=src)
    command.add_argument("dst", help="output torch.save file")
    command.add_argument("--force", action="store_true", help="replace an existing output")
    command.set_defaults(func=dcp_to_torch, output_is_file=True, source=src)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if "BUILD_WORKING_DIRECTORY" in os.environ:  # `bazel run` starts in the runfiles tree
        os.chdir(os.environ["BUILD_WORKING_DIRECTORY"])
    try:
        _check_source(args.source, args.src)
        _check_apart(args.src, args.dst)
        _write_output(args.dst, args.force, args.output_is_file, lambda out: args.func(args, out))
    except (ValueError, OSError) as e:  # FileNotFoundError is an OSError
        print(f"convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
