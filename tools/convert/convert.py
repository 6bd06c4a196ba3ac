"""convert: move checkpoints between DCP, Hugging Face safetensors and torch.save files.

  convert dcp-to-hf --model llama3 --flavor debugmodel <dcp_dir> <out_dir>
  convert hf-to-dcp --model llama3 --flavor debugmodel <hf_dir> <out_dcp_dir>
  convert dcp-to-torch <dcp_dir> <out.pt>

<dcp_dir> is one checkpoint, e.g. <checkpoint folder>/step-1000. The model weights live under
the state name given by --state ("model", as the trainer saves them). Nothing is unpickled
beyond what torch.load(weights_only=True) allows. An existing output is replaced only with
--force, and outputs appear whole (written under a hidden name, then renamed). Bad input: one
line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from tessera.ckpt import check_state_dict, dcp_to_torch_save, load_hf, read_dcp, save_hf, write_dcp
from tessera.models import get_model_spec


def _spec_and_args(model: str, flavor: str):
    spec = get_model_spec(model)
    if flavor not in spec.flavors:
        raise ValueError(f"unknown flavor {flavor!r} of {model}; known: {sorted(spec.flavors)}")
    if spec.hf_adapter is None:
        raise ValueError(f"model {model} has no Hugging Face adapter")
    return spec, spec.flavors[flavor]


def _check_against_model(state_dict: dict, spec, args, source: str, what: str) -> None:
    """Keys and shapes must be exactly those of the model the flavor builds."""
    with torch.device("meta"):
        expected = {key: tuple(value.shape) for key, value in spec.build(args).state_dict().items()}
    check_state_dict(state_dict, expected, source, what)


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
        write(tmp)
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
    spec, model_args = _spec_and_args(args.model, args.flavor)
    state_dict = read_dcp(args.src, only=args.state)
    _check_against_model(state_dict, spec, model_args, f"DCP checkpoint {args.src}", f"{args.model}/{args.flavor}")
    save_hf(spec.hf_adapter.to_hf(state_dict, model_args), out, max_shard_bytes=args.max_shard_bytes)


def hf_to_dcp(args: argparse.Namespace, out: Path) -> None:
    spec, model_args = _spec_and_args(args.model, args.flavor)
    state_dict = spec.hf_adapter.from_hf(load_hf(args.src), model_args)
    _check_against_model(state_dict, spec, model_args, f"Hugging Face checkpoint {args.src}", f"{args.model}/{args.flavor}")
    write_dcp({args.state: state_dict}, out)


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
        command.add_argument("--model", required=True, help="registered model spec, e.g. llama3")
        command.add_argument("--flavor", required=True, help="flavor of the model, e.g. debugmodel")
        command.add_argument("--state", default="model", help="state name of the weights in the DCP checkpoint")
        command.add_argument("src", help=src)
        command.add_argument("dst", help=dst)
        command.add_argument("--force", action="store_true", help="replace an existing output")
        command.set_defaults(func=func, output_is_file=False)
    commands.choices["dcp-to-hf"].add_argument("--max-shard-bytes", type=int, default=5 * 10**9)
    command = commands.add_parser("dcp-to-torch")
    command.add_argument("src", help="DCP checkpoint folder")
    command.add_argument("dst", help="output torch.save file")
    command.add_argument("--force", action="store_true", help="replace an existing output")
    command.set_defaults(func=dcp_to_torch, output_is_file=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if "BUILD_WORKING_DIRECTORY" in os.environ:  # `bazel run` starts in the runfiles tree
        os.chdir(os.environ["BUILD_WORKING_DIRECTORY"])
    try:
        _write_output(args.dst, args.force, args.output_is_file, lambda out: args.func(args, out))
    except (ValueError, OSError) as e:  # FileNotFoundError is an OSError
        print(f"convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
