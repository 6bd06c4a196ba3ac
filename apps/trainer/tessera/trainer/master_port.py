"""The master port torchrun hands a launch attempt's ranks, held until rank 0 binds it.

torchrun, run in this process (`--nproc`, tools/launch's torchrun), gives each attempt's ranks a
port for rank 0's store. Without a shared rendezvous store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE,
set for restarts: pytorch#135712) it takes a free port and releases it (torch's get_free_port),
and rank 0 binds it seconds later, after its imports. A port taken meanwhile by any process on
the host failed the attempt, and with restarts the job went on as the next attempt: a replica
group that restarted before its first step, whose injected fault (first attempts only) never
fired. Imports nothing beyond socket until called, for a launcher that has not loaded torch.
"""

from __future__ import annotations

import socket

_held: list[socket.socket] = []  # the ports handed out, bound until this process exits


def _held_port() -> int:
    """A free port that stays bound here (SO_REUSEADDR, not listening): other processes' binds
    and outgoing connections pass it over, while rank 0's store, which binds with SO_REUSEADDR
    too (libuv), still can."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    _held.append(sock)
    return sock.getsockname()[1]


def hold_master_ports() -> None:
    """From now on, torchrun in this process hands out held ports."""
    from torch.distributed.elastic.rendezvous import api

    api.get_free_port = _held_port
