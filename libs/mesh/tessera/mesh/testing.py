"""Run a function on N local CPU processes joined by gloo: the harness for distributed tests."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import traceback
from typing import Any, Callable


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # N ranks share few cores; more threads only oversubscribe them
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False)  # the parent's (run_on_ranks)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        dist.barrier()
        # plain pickle copies tensors into bytes; the queue's own pickler would pass shared-memory
        # handles that die with this process
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))
        return
    dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """Calls fn(rank, world_size, *args) on world_size spawned processes; returns values by rank.

    fn must be importable (a module-level function). The default process group is initialised
    (gloo, 127.0.0.1) and RANK/WORLD_SIZE/MASTER_* are set as torchrun would. A failure on any
    rank raises RuntimeError carrying that rank's traceback. Exit codes are not trusted: gloo
    sometimes aborts at interpreter exit after a clean finish, so results travel by queue.
    """
    from torch.distributed import TCPStore

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    # The rendezvous store lives here, bound to a port the kernel picks as it listens: choosing a
    # free port first and binding it later in rank 0 raced with concurrent tests' connections
    # (EADDRINUSE, seen in a full suite run).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                dead = [f"rank {r} exit {p.exitcode}" for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                raise RuntimeError(f"distributed run timed out after {timeout_s}s ({', '.join(dead) or 'no rank exited'})")
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        del store  # stops listening once every rank is gone
    return [values[r] for r in range(world_size)]
