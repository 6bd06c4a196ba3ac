"""A rank of `--nproc`, forked from the server its launcher starts (multiprocessing's forkserver,
under torchrun's own agent) once that server loaded the trainer (tessera.trainer.fork_server):
each rank begins at `run`."""

import os
import signal
import sys
import threading
import traceback

# How long a finished rank waits for torchrun's agent to let it exit: the agent reads a return from
# every rank first, but one shutting down on a stop signal reads none. The return is in the agent's
# pipe before the rank waits, so the agent reads it even after the rank is gone.
RETURN_WAIT_S = 2


def run(argv: list[str]) -> None:
    """One rank, as torchrun starts them: in a session of its own (a terminal's Ctrl-C reaches the
    launcher alone, which forwards it), with default signal dispositions, a bug's traceback on
    stderr (torch's process wrapper would file it away unseen), and killed with its parent, the
    server, which dies with the launcher."""
    from tessera.trainer import fork_server, main
    from tessera.trainer.faults import LAUNCHER_PID_ENV

    os.setsid()
    for sig in fork_server.STOP_AND_QUIT:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # the server's pid, or, if it could not load fork_server (this rank just did), its parent's
    os.environ[LAUNCHER_PID_ENV] = str(fork_server.PID if fork_server.PID != os.getpid() else os.getppid())
    try:
        code = main.main(argv)
    except Exception:  # noqa: BLE001  a bug: its traceback, as an interpreter prints one, and exit 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
    timer = threading.Timer(RETURN_WAIT_S, os._exit, (0,))
    timer.daemon = True
    timer.start()
