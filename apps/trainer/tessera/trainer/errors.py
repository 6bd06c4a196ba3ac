"""The trainer's one error for bad user input, apart from the config so that modules the config
imports (the converters declaring their sections) can raise it; and where the ranks of --nproc
leave their error line, which the command line reads before torch loads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

ERRORS_ENV = "TESSERA_ERRORS_DIR"  # where the ranks of --nproc leave their error line for the launcher
# Ctrl-C's one line, said by the process that prints the job's errors
INTERRUPTED = "interrupted: stopped without a checkpoint of this step (SIGTERM or SIGUSR1 saves one first)"


def stopped_by(nproc: int, signal_name: str) -> str:
    """What a --nproc launcher says when a signal stopped ranks that left no report (they saved and
    said so, or had not begun)."""
    return f"{nproc}-process run stopped by {signal_name}"


class ConfigError(ValueError):
    """Bad user input — a config file, key or value, or a file it names — that the trainer cannot
    use; the message names it. The command line prints it as one line and exits 2."""


class LayoutError(ConfigError):
    """Parallel degrees that do not fit the world size: on a host planning a cluster's job with
    the default world size of 1 the cure is usually --check_world_size, not the config."""


@contextlib.contextmanager
def user_input() -> Iterator[None]:
    """Around reading what the user named (data, checkpoints): the libraries' ValueErrors there
    describe that input, so they become ConfigErrors. Elsewhere a ValueError is a bug and keeps
    its traceback."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from e
