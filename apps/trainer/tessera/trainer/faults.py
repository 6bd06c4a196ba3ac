"""What a run does when the world goes wrong: diverged numbers, a scheduler's stop signal, a
launcher that died, a stuck or lost peer. Each ends the run cleanly: one line, a checkpoint kept
or written, no orphans. Also the [debug] switch that injects a crash or a stall, to test that."""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tessera.trainer.errors import ERRORS_ENV


class TrainingError(RuntimeError):
    """The run cannot go on for a reason in its numbers or its peers (diverged, non-finite
    weights, a stuck collective), not in the code: the command line prints one line, exit 1."""


def weights_finite(params: Iterable[torch.Tensor], device: str) -> bool:
    """Every rank's share of the weights is finite (collective: every rank gets the same answer)."""
    bad = torch.zeros((), device=device)
    for p in params:
        local = p.to_local() if isinstance(p, DTensor) else p
        bad += (~torch.isfinite(local.detach())).any().to(bad.device, torch.float32)
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bad.item()


def tighten_timeouts(seconds: int, meshes) -> None:
    """comm.train_timeout_seconds, set after the first step (torchtitan's meaning) on the training's
    own groups (the default one and every mesh's): a stuck collective then fails instead of
    hanging. Background groups (async checkpoints, data prefetch) keep the init timeout: they
    may rightly wait through a long step."""
    meshes = [*meshes.values(), *(getattr(meshes, f.name) for f in dataclasses.fields(meshes))]
    groups = {dist.group.WORLD, *(g for mesh in meshes if isinstance(mesh, DeviceMesh) for g in mesh.get_all_groups())}
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


# gloo's words for a collective that timed out here, or whose peer gave up (timed out or failed)
_LOST_PEER = "lost a peer rank (it failed or timed out)"
_STALLS = {"Timed out waiting": "timed out", "Connection closed by peer": _LOST_PEER,
           "Connection reset by peer": _LOST_PEER}


def _operation(error: BaseException) -> str:
    """The collective an error came from: the innermost torch.distributed API call in its
    traceback (all_reduce, all_gather_into_tensor, ...), else the innermost torch.distributed
    function (an async collective waited on elsewhere, e.g. by FSDP)."""
    frames = [(tb.tb_frame.f_code.co_filename, tb.tb_frame.f_code.co_name) for tb in _tracebacks(error)]
    for suffix in (os.path.join("distributed", "distributed_c10d.py"), f"{os.sep}distributed{os.sep}"):
        names = [name for path, name in frames if suffix in path and not name.startswith("_") and name != "wrapper"]
        if names:
            return names[-1]
    return "a collective"


def _tracebacks(error: BaseException):
    tb = error.__traceback__
    while tb is not None:
        yield tb
        tb = tb.tb_next


def stalled_collective(error: RuntimeError, rank: int, step: int, seconds: int) -> TrainingError | None:
    """The one-line error, naming the rank and the operation, for a collective that
    comm.train_timeout_seconds ended or whose peer is gone; else None."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    for words, what in _STALLS.items():
        if words in first_line:
            return TrainingError(f"rank {rank}, step {step}: {_operation(error)} {what} (comm.train_timeout_seconds = "
                                 f"{seconds}): {first_line.split('] ', 1)[-1].split('. ', 1)[0]}")
    return None


FAULT_KINDS = ("crash", "stall")


def inject_fault(debug, rank: int, step: int, train_timeout_s: int) -> None:
    """The [debug] fault switch, called before each step: on rank debug.fault_rank before step
    debug.fault_at_step, "crash" exits at once (no cleanup, no checkpoint: a killed process) and
    "stall" stops answering for twice comm.train_timeout_seconds, so the peers' collectives
    time out. Only a launcher's first attempt (torchrun's TORCHELASTIC_RESTART_COUNT 0 or unset)
    is faulted: an elastic restart must run clean to show the resume."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if not (debug.fault_at_step and step == debug.fault_at_step and rank == debug.fault_rank and first_attempt):
        return
    what = {"crash": "crashes", "stall": "stalls"}[debug.fault_kind]
    print(f"debug: injected fault: rank {rank} {what} before step {step} (debug.fault_at_step)", file=sys.stderr, flush=True)
    if debug.fault_kind == "crash":
        os._exit(1)
    time.sleep(2 * train_timeout_s)


def elastic_store_note() -> str | None:
    """A note for a `torchrun --max-restarts` that shares its rendezvous store with the ranks
    (torch's default): a restarted attempt there reads the failed attempt's addresses and cannot
    connect (pytorch#135712). tools/launch/torchrun turns the sharing off."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) < 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return ("note: torchrun --max-restarts shares its rendezvous store across attempts, where a restart fails to "
            "connect (pytorch#135712); launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (tools/launch/torchrun does)")


_PR_SET_PDEATHSIG = 1


LAUNCHER_PID_ENV = "TESSERA_LAUNCHER_PID"  # set by --nproc: the pid a rank's parent must have


def die_with_launcher() -> None:
    """A rank started by a launcher (torchrun, `--nproc`) is killed when that launcher dies
    (Linux's parent-death signal): orphans would keep training and writing checkpoints into the
    folder a restarted job uses. TESSERA_LAUNCHER_PID (set by `--nproc`) closes the race of a
    launcher that died before this call."""
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and os.getppid() != int(launcher):
        os._exit(1)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def any_rank(group: dist.ProcessGroup | None, *flags: bool) -> list[bool]:
    """For each host-side flag, whether any rank raised it: one all-reduce for all of them over
    ``group`` (collective; a gloo group, so host memory and no wait for the device's queued
    work), so every rank acts on them at the same step. A world of one: the flags themselves."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(flags)
    raised = torch.tensor([float(flag) for flag in flags])
    dist.all_reduce(raised, op=dist.ReduceOp.MAX, group=group)
    return [bool(flag) for flag in raised.tolist()]


def exit_with_error(message: str, code: int) -> int:
    """Prints `message` (one line) and returns the exit status, or under --nproc hands it to the
    launcher, which prints the first rank's once, and exits."""
    folder = os.environ.get(ERRORS_ENV)
    if folder:  # whole or absent: the launcher may stop this rank mid-write once another rank failed
        report = Path(folder, f"rank-{os.environ.get('RANK', '0')}")
        tmp = report.with_name(f".{report.name}.tmp")
        tmp.write_text(f"{code}\n{message}")
        tmp.rename(report)
        sys.stdout.flush()
        # no interpreter teardown: with the process group's threads still up it can abort, printing
        # "terminate called without an active exception" beside the launcher's one line (seen in CI)
        os._exit(code)
    else:
        print(message, file=sys.stderr)
    return code


class StopSignals:
    """SIGTERM / SIGUSR1 (what SLURM and Kubernetes send ahead of a kill) ask the run to stop
    after the current step with a checkpoint: `received` names the signal, and the loop shares it
    with `any_rank` so every rank saves at the same step. ``grace_s`` after the signal the process
    exits 1 regardless: a stuck save must not outlive the scheduler's grace period. `active`: the
    run's instance, through which fault tolerance's replica groups stop at the same step too: they
    exchange the flag in each step's all-reduce and set `agreed`, which then decides (a signal
    that arrives after that exchange counts at the next step, in every group alike)."""

    active: "StopSignals | None" = None

    def __init__(self, grace_s: int) -> None:
        self.grace_s = grace_s
        self.received: str | None = None
        self.agreed: bool | None = None  # set by replica groups each step: whether any of them was signalled
        StopSignals.active = self
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # handlers live in the main thread only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def requested(self) -> bool:
        """Whether the run stops after this step."""
        return self.agreed if self.agreed is not None else self.received is not None

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            timer = threading.Timer(self.grace_s, self._expire)
            timer.daemon = True
            timer.start()

    def _expire(self) -> None:
        """Under --nproc the launcher reads this as the job's end (not a stop that saved)."""
        os._exit(exit_with_error(f"error: not stopped within {self.grace_s}s of {self.received} "
                                 "(job.stop_grace_seconds); exiting without a checkpoint of this step", 1))

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if StopSignals.active is self:
            StopSignals.active = None
