"""Run a function on N local CPU processes joined by gloo: the harness for distributed tests.

The ranks of a world size stay up between calls: spawning N processes and importing torch and
the trainer into each took 4 s (one rank) to 17 s (eight) on two cores, most of a typical parity
test's time. They are forked by a fork server that imported torch and this process's tessera
modules once (the trainer's pipeline and MoE tests: 113 s -> 83 s against spawned ranks), and
start with this process's environment and working directory, as spawned ones would. Each call starts from the state a fresh rank has (environment, working directory,
default dtype, signal handlers, the default RNG seed, no compiled code); a call that fails, times
out or loses a rank takes its ranks down (the others get up to 30 s to end their call: their
peers may be stuck in a collective).
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from typing import Any, Callable

_MAX_LIVE_RANKS = 8  # idle ranks hold memory: beyond this, the least recently used world sizes go
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGXFSZ)


def _as_fresh(fn: Callable, rank: int, world_size: int, args: tuple, seed: int) -> Any:
    """fn(rank, world_size, *args) with the per-process state a new rank starts with, put back after."""
    import torch

    env, cwd, dtype = dict(os.environ), os.getcwd(), torch.get_default_dtype()
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    torch.manual_seed(seed)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()  # a compile test must compile, not meet an earlier call's cache or its limit
    try:
        return fn(rank, world_size, *args)
    finally:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        torch.set_default_dtype(dtype)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _worker(rank: int, world_size: int, port: int, inbox, results, env: dict, cwd: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the parent's, as a spawned process gets them (the fork server's are older)
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # N ranks share few cores; more threads only oversubscribe them
    seed = torch.initial_seed()
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False)  # the parent's (run_on_ranks)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    while (job := inbox.get()) is not None:
        try:
            fn, args = pickle.loads(job)
            value = _as_fresh(fn, rank, world_size, args, seed)
            dist.barrier()
            # plain pickle copies tensors into bytes; the queue's own pickler would pass shared-memory
            # handles that die with this process
            results.put((rank, True, pickle.dumps(value)))
        except BaseException:  # report everything, including SystemExit, to the parent
            results.put((rank, False, traceback.format_exc()))
            return  # the parent takes this world size down


@dataclasses.dataclass
class _Ranks:
    procs: list
    inboxes: list
    results: Any
    store: Any  # the rendezvous store: it listens as long as the ranks live


_LIVE: dict[int, _Ranks] = {}  # world size -> its ranks, least recently used first


def _close(world_size: int, grace_s: float = 30.0) -> None:
    """Stops this world size's ranks: each ends when its current call does (a failed peer's
    partner may still finish its own work and report, as a test may expect), or is killed
    after grace_s."""
    ranks = _LIVE.pop(world_size, None)
    if ranks is None:
        return
    for inbox in ranks.inboxes:
        inbox.put(None)
    deadline = time.monotonic() + grace_s
    for p in ranks.procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in ranks.procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=30)


def _close_all() -> None:
    for world_size in list(_LIVE):
        _close(world_size)


atexit.register(_close_all)


def _preload() -> list[str]:
    """What the fork server imports once for every rank it forks: torch and the tessera modules this
    process has imported (the caller's test has, so its ranks will)."""
    return ["torch", "torch.distributed", *sorted(name for name in sys.modules if name.startswith("tessera."))]


def _ranks(world_size: int) -> _Ranks:
    """The live ranks of this world size, spawned when there are none."""
    from torch.distributed import TCPStore

    if world_size in _LIVE:
        _LIVE[world_size] = _LIVE.pop(world_size)  # now the most recently used
        return _LIVE[world_size]
    while _LIVE and sum(len(r.procs) for r in _LIVE.values()) + world_size > _MAX_LIVE_RANKS:
        _close(next(iter(_LIVE)))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_preload())  # read when the fork server starts: this process's first ranks
    results = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(world_size)]
    # The rendezvous store lives here, bound to a port the kernel picks as it listens: choosing a
    # free port first and binding it later in rank 0 raced with concurrent tests' connections
    # (EADDRINUSE, seen in a full suite run).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [ctx.Process(target=_worker, args=(rank, world_size, store.port, inboxes[rank], results, dict(os.environ),
                                               os.getcwd()), daemon=True) for rank in range(world_size)]
    for p in procs:
        p.start()
    _LIVE[world_size] = _Ranks(procs, inboxes, results, store)
    return _LIVE[world_size]


def _next_result(ranks: _Ranks, deadline: float, timeout_s: float) -> tuple[int, bool, Any]:
    """The next rank's report; a rank that died without one, or the deadline, raises."""
    while True:
        try:
            return ranks.results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            dead = [f"rank {r} exit {p.exitcode}" for r, p in enumerate(ranks.procs) if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"distributed run lost a rank without a report ({', '.join(dead)})") from None
            if time.monotonic() >= deadline:
                raise RuntimeError(f"distributed run timed out after {timeout_s}s (no rank exited)") from None


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """Calls fn(rank, world_size, *args) on world_size processes; returns values by rank.

    fn must be importable (a module-level function). The default process group is initialised
    (gloo, 127.0.0.1) and RANK/WORLD_SIZE/MASTER_* are set as torchrun would. A failure on any
    rank raises RuntimeError carrying that rank's traceback; a rank that dies without a report
    raises at once. The ranks stay up for the next call of this world size (see the module's
    docstring).
    """
    job = pickle.dumps((fn, args))  # here, so that what cannot travel fails now, not in a queue's thread
    ranks = _ranks(world_size)
    for inbox in ranks.inboxes:
        inbox.put(job)
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    try:
        while len(values) < world_size:
            rank, ok, value = _next_result(ranks, deadline, timeout_s)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            values[rank] = pickle.loads(value)
    except BaseException:
        _close(world_size)
        raise
    return [values[r] for r in range(world_size)]
