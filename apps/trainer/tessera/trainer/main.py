"""Command line: `trainer [--nproc N] [--job.config_file F] [--section.key value ...]`.

Bad input ends with one line on stderr naming the culprit and exit status 2, never a traceback.
`--nproc N` starts N local worker processes through torch's own launcher (torchrun's engine);
under `torchrun` or `srun torchrun` leave it out.
"""

from __future__ import annotations

import sys

from tessera.trainer.config import ConfigError, load_config


def _split_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    for i, arg in enumerate(argv):
        if arg == "--nproc" or arg.startswith("--nproc="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            rest = argv[:i] + argv[i + (1 if "=" in arg else 2):]
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--nproc {value!r} must be a positive integer")
            return int(value), rest
    return None, argv


def _launch_local(nproc: int, argv: list[str]) -> int:
    """Runs this same program on nproc local ranks (rendezvous on a free localhost port)."""
    from torch.distributed.run import get_args_parser, run

    launcher_args = get_args_parser().parse_args(
        ["--standalone", f"--nproc_per_node={nproc}", "--no-python", sys.executable, "-m", "tessera.trainer.main", *argv]
    )
    try:
        run(launcher_args)
    except Exception as e:  # ChildFailedError: the failing rank already printed its own error
        print(f"error: {nproc}-process run failed: {type(e).__name__}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        nproc, argv = _split_nproc(argv)
        if nproc is not None:
            load_config(argv)  # fail fast, once, before any worker starts
            return _launch_local(nproc, argv)
        config = load_config(argv)
        from tessera.trainer.train import train  # torch and friends load only for real runs

        train(config)
    except (ConfigError, ValueError, OSError) as e:  # OSError: unwritable dump folder, unreadable files
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
