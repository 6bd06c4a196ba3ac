"""convert: move checkpoints between DCP, Hugging Face safetensors and torch.save files.

  convert dcp-to-hf --model llama3 --flavor debugmodel <dcp_dir> <out_dir>
  convert hf-to-dcp --model llama3 --flavor debugmodel <hf_dir> <out_dcp_dir>
  convert dcp-to-torch <dcp_dir> <out.pt>

<dcp_dir> is one checkpoint, e.g. <checkpoint folder>/step-1000. The model weights live under
the state name given by --state ("model", as the trainer saves them). Nothing is unpickled
beyond what torch.load(weights_only=True) allows. Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys

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


def dcp_to_hf(args: argparse.Namespace) -> None:
    spec, model_args = _spec_and_args(args.model, args.flavor)
    state_dict = read_dcp(args.src, only=args.state)
    _check_against_model(state_dict, spec, model_args, f"DCP checkpoint {args.src}", f"{args.model}/{args.flavor}")
    save_hf(spec.hf_adapter.to_hf(state_dict, model_args), args.dst, max_shard_bytes=args.max_shard_bytes)


def hf_to_dcp(args: argparse.Namespace) -> None:
    spec, model_args = _spec_and_args(args.model, args.flavor)
    state_dict = spec.hf_adapter.from_hf(load_hf(args.src), model_args)
    _check_against_model(state_dict, spec, model_args, f"Hugging Face checkpoint {args.src}", f"{args.model}/{args.flavor}")
    write_dcp({args.state: state_dict}, args.dst)


def dcp_to_torch(args: argparse.Namespace) -> None:
    dcp_to_torch_save(args.src, args.dst)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, func, src, dst in (
        ("dcp-to-hf", dcp_to_hf, "DCP checkpoint folder", "output folder for safetensors"),
        ("hf-to-dcp", hf_to_dcp, "Hugging Face checkpoint folder", "output DCP checkpoint folder (must not exist)"),
    ):
        command = commands.add_parser(name)
        command.add_argument("--model", required=True, help="registered model spec, e.g. llama3")
        command.add_argument("--flavor", required=True, help="flavor of the model, e.g. debugmodel")
        command.add_argument("--state", default="model", help="state name of the weights in the DCP checkpoint")
        command.add_argument("src", help=src)
        command.add_argument("dst", help=dst)
        command.set_defaults(func=func)
    commands.choices["dcp-to-hf"].add_argument("--max-shard-bytes", type=int, default=5 * 10**9)
    command = commands.add_parser("dcp-to-torch")
    command.add_argument("src", help="DCP checkpoint folder")
    command.add_argument("dst", help="output torch.save file")
    command.set_defaults(func=dcp_to_torch)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if "BUILD_WORKING_DIRECTORY" in os.environ:  # `bazel run` starts in the runfiles tree
        os.chdir(os.environ["BUILD_WORKING_DIRECTORY"])
    try:
        args.func(args)
    except (ValueError, OSError) as e:  # FileNotFoundError is an OSError
        print(f"convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
