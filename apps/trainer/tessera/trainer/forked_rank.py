"""A rank of `--nproc`, forked from the fork server its launcher starts (multiprocessing's
forkserver, through torchrun's own agent): torch and the trainer load once per launch instead of
once per rank (about 5 s of CPU each), before any rank touches a device. The server imports this
module; each rank begins at `run`."""

import gc
import os
import sys

gc.disable()  # no collection passes over the million objects torch's import makes (main.py)
from tessera.trainer import main, train  # noqa: E402,F401  a rank's imports, made once in the server
from tessera.trainer.faults import LAUNCHER_PID_ENV, StopSignals, die_with_parent  # noqa: E402

gc.freeze()
gc.enable()

SERVER_PID = os.getpid()  # as a rank sees it: its parent's
if os.environ.get(LAUNCHER_PID_ENV) == str(os.getppid()):  # the server (its launcher imports this module too)
    # killed with its launcher: its ranks hold its lifeline open (multiprocessing hands each the
    # server's liveness pipe), so it would not end by itself, nor they (they die with it, `run`)
    die_with_parent(os.getppid())


def run(argv: list[str]) -> None:
    """One rank: in a session of its own, as torchrun starts them (a terminal's Ctrl-C reaches the
    launcher alone, which forwards it), and killed with its parent, the server. A rank that
    finished returns, as torchrun's agent waits for every rank's return before any may exit; one
    stopped by a signal, or failed, exits at once, as its agent, shutting down, reads no returns."""
    os.setsid()
    os.environ[LAUNCHER_PID_ENV] = str(SERVER_PID)
    code = main.main(argv)
    if code or StopSignals.signalled:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
