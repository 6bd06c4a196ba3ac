"""What the fork server of `--nproc` loads before it forks any rank (tessera.trainer.forked_rank):
torch and the trainer, once per launch instead of once per rank (about 5 s of CPU each), asking
nothing of CUDA and starting no thread (tested), so a forked rank may use both. Only that server
imports this module."""

import gc
import os
import signal
import warnings

# The server is in its launcher's process group. A stop signal sent to the group (Slurm's, GNU
# timeout's, a terminal's Ctrl-C) must not end it, since its ranks die with it: the launcher
# forwards such signals to the ranks, which set their own dispositions back (forked_rank.run).
STOP_AND_QUIT = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)
for _signal in STOP_AND_QUIT:
    signal.signal(_signal, signal.SIG_IGN)
# multiprocessing runs the launcher's main module again in each rank (as __mp_main__, so that
# what it pickled resolves), and runpy warns that this server had loaded it: harmless, as it only
# defines functions, and not the user's concern
warnings.filterwarnings("ignore", r"'tessera\.trainer\.main' found in sys\.modules", RuntimeWarning)
LAUNCHER = os.getppid()
PID = os.getpid()  # as a rank sees it: its parent's

gc.disable()  # no collection passes over the million objects torch's import makes (main.py)
from tessera.trainer import main, train  # noqa: E402,F401  a rank's imports, made once here
from tessera.trainer.faults import die_with_parent  # noqa: E402

gc.freeze()
gc.enable()

# Killed with its launcher. Nothing else would end it: multiprocessing hands each rank this
# server's liveness pipe, which then stays open, and the ranks die only with their parent, this.
die_with_parent(LAUNCHER)
