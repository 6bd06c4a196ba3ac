"""Starting a job's processes on one node of one or many: `--nproc N [--hosts H0,H1,... --node_rank R
--port P] [--max_restarts K]`.

Without fault tolerance the node runs one torchrun agent (torch's launcher, in this process, see
main._launch_local): standalone on one node, else a c10d rendezvous at H0:P.

With fault tolerance the job is `fault_tolerance.group_size` replica groups of N x nodes / groups
ranks each. Node 0 starts torchft's Lighthouse (lighthouse.py, at H0:P, or a free port on
one node); every node starts its groups' launchers (this program again, one torchrun agent each,
`--max_restarts` restarts of a group that dies, TORCHFT_LIGHTHOUSE set, each in a session of its
own), prefixes their output with `[replica g]`, forwards stop signals to them and, when they are
done, stops the Lighthouse. Ctrl-C is said once, here, with exit status 130.
A group within one node rendezvouses standalone; a group over several nodes at its first node's
host, port P + 1 + g.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tessera.trainer.config import ConfigError, JobConfig
from tessera.trainer.errors import INTERRUPTED, stopped_by
from tessera.trainer.fault_tolerance import LIGHTHOUSE_ENV, START_TOGETHER_ENV
from tessera.trainer.faults import LAUNCHER_PID_ENV
from tessera.trainer.ft_plan import group_world_size
from tessera.trainer.lighthouse import command as lighthouse_command

GROUP_LAUNCHER_ENV = "TESSERA_FT_GROUP"  # set for a replica group's own launcher: it runs its group
DEFAULT_PORT = 29500
LIGHTHOUSE_ARGS_ENV = "TESSERA_LIGHTHOUSE_ARGS"  # more torchft_lighthouse options, e.g. "--heartbeat_timeout_ms 1000"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


def node_layout(hosts: list[str], node_rank: int | None) -> tuple[list[str], int]:
    """The job's hosts (default: this machine alone) and this node's index among them
    (--node_rank, else SLURM's SLURM_NODEID, else 0)."""
    hosts = hosts or ["localhost"]
    if node_rank is None:
        node_rank = int(os.environ.get("SLURM_NODEID", "0"))
    if not 0 <= node_rank < len(hosts):
        raise ConfigError(f"--node_rank {node_rank} is not below the {len(hosts)} hosts of --hosts")
    return hosts, node_rank


def rendezvous(hosts: list[str], port: int, job: str) -> list[str]:
    """torchrun's rendezvous options for one agent per host in `hosts`."""
    if len(hosts) == 1:
        return ["--standalone"]
    return [f"--nnodes={len(hosts)}", "--rdzv_backend=c10d", f"--rdzv_endpoint={hosts[0]}:{port}",
            f"--rdzv_id={os.environ.get('SLURM_JOB_ID', 'tessera')}-{job}"]


def groups_of_node(nproc: int, hosts: list[str], node_rank: int, config: JobConfig) -> list[tuple[int, int, list[str], int]]:
    """(group, its ranks on this node, its hosts, this node's index among them) for every replica
    group this node runs: groups within a node, or groups of whole nodes."""
    size = group_world_size(nproc * len(hosts), config)
    if size <= nproc:
        if nproc % size:
            raise ConfigError(f"replica groups of {size} ranks do not split a node's {nproc} ranks (--nproc)")
        first = node_rank * (nproc // size)
        return [(g, size, [hosts[node_rank]], 0) for g in range(first, first + nproc // size)]
    if size % nproc:
        raise ConfigError(f"replica groups of {size} ranks are not whole nodes of {nproc} ranks (--nproc)")
    nodes = size // nproc
    g = node_rank // nodes
    return [(g, nproc, hosts[g * nodes:(g + 1) * nodes], node_rank % nodes)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: the child is killed when this launcher dies (Linux's parent-death signal)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _lighthouse(config: JobConfig, port: int) -> subprocess.Popen:
    log = Path(config.job.dump_folder) / "lighthouse.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*lighthouse_command(), "--min_replicas", str(config.fault_tolerance.min_replica_size), "--bind", f"[::]:{port}",
             "--join_timeout_ms", str(config.comm.init_timeout_seconds * 1000),
             *os.environ.get(LIGHTHOUSE_ARGS_ENV, "").split()],
            stdout=out, stderr=out, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)


def _check_started(lighthouse: subprocess.Popen, seconds: float = 0.5) -> None:
    """A Lighthouse that could not start (its port taken) would leave every group waiting for it."""
    try:
        code = lighthouse.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return
    raise ConfigError(f"torchft's Lighthouse exited at start with status {code} (its port taken? see lighthouse.log in "
                      "job.dump_folder; --port chooses another on several nodes)")


def _relay(stream, out, prefix: bytes, ctrl_c_lines: set[bytes], interrupted: Callable[[], bool]) -> None:
    """A group's output, each line prefixed; after Ctrl-C, not the group's lines saying so
    (`ctrl_c_lines`): the launcher says it once for every group."""
    for line in iter(stream.readline, b""):
        if interrupted() and line.rstrip(b"\n") in ctrl_c_lines:
            continue
        out.buffer.write(prefix + line)
        out.flush()


def launch_replica_groups(nproc: int, hosts: list[str], node_rank: int, port: int, max_restarts: int,
                          argv: list[str], config: JobConfig) -> int:
    """Runs this node's replica groups (and on node 0 the Lighthouse) until they end; the exit
    status is 0 when every group ended 0."""
    groups = groups_of_node(nproc, hosts, node_rank, config)
    lighthouse_port = port if len(hosts) > 1 else _free_port()
    lighthouse = _lighthouse(config, lighthouse_port) if node_rank == 0 else None
    env = dict(os.environ, **{LIGHTHOUSE_ENV: f"http://{hosts[0]}:{lighthouse_port}", START_TOGETHER_ENV: "1",
                              GROUP_LAUNCHER_ENV: "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    env.pop(LAUNCHER_PID_ENV, None)
    procs, relays, stopped = [], [], []

    def forward(signum, frame) -> None:
        stopped.append(signal.Signals(signum).name)
        for _, proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        for g, ranks, group_hosts, group_node in groups:
            where = ["--node_rank", str(group_node)]
            if len(group_hosts) > 1:
                where += ["--hosts", ",".join(group_hosts), "--port", str(port + 1 + g)]
            command = [sys.executable, "-m", "tessera.trainer.main", "--nproc", str(ranks), *where,
                       "--max_restarts", str(max_restarts), *argv, "--fault_tolerance.replica_id", str(g)]
            # a session of its own: a terminal's Ctrl-C reaches it once, through forward(); a second
            # SIGINT while its torchrun agent stops the ranks made that agent stop them again with
            # SIGTERM, which asks for a checkpoint a group whose peers are gone cannot take (Slurm,
            # which signals every process of a step, still sends it twice)
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent, start_new_session=True)
            procs.append((g, proc))
            # what its launcher says on Ctrl-C: its ranks' line, or its own before they began
            ctrl_c_lines = {INTERRUPTED.encode(), stopped_by(ranks, "SIGINT").encode()}
            for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                relay = threading.Thread(target=_relay, args=(stream, out, f"[replica {g}] ".encode(), ctrl_c_lines,
                                                              lambda: "SIGINT" in stopped), daemon=True)
                relay.start()
                relays.append(relay)
        if lighthouse is not None:  # checked while the groups start (their imports take longer)
            _check_started(lighthouse)
        codes = {g: proc.wait() for g, proc in procs}
        for relay in relays:
            relay.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if lighthouse is not None:
            lighthouse.terminate()
            lighthouse.wait()
    failed = {g: code for g, code in codes.items() if code}
    # 130: a group's launcher stopped by Ctrl-C; -SIGINT: one that had not yet set its handler
    by_ctrl_c = (130, -signal.SIGINT)
    interrupted = "SIGINT" in stopped and any(code in by_ctrl_c for code in codes.values())
    if interrupted:  # Ctrl-C, said once (_relay left out the groups' lines); a group that failed otherwise, below
        print(INTERRUPTED, file=sys.stderr, flush=True)
        failed = {g: code for g, code in failed.items() if code not in by_ctrl_c}
    elif stopped and not failed:
        print(f"replica groups {sorted(codes)} stopped by {stopped[0]}", file=sys.stderr, flush=True)
    for g, code in failed.items():
        print(f"error: replica group {g} ended with exit status {code}"
              + (f" after {max_restarts} restarts" if max_restarts else ""), file=sys.stderr, flush=True)
    return 130 if interrupted else next(iter(failed.values()), 0)
