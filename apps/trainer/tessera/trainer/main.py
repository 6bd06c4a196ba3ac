"""Command line: `trainer [--nproc N [--hosts H0,H1,... --node_rank R --port P] [--max_restarts K]]
[--check [--check_world_size N] [--check_device D]] [--job.config_file F] [--section.key value ...]`,
`trainer --help [SECTION]`, `trainer --version`.

Bad input ends with one line on stderr naming the culprit and exit status 2; a bug keeps its
traceback. `--nproc N` starts N local worker processes through torch's own launcher (torchrun's
engine) once the job plan has checked the config for N ranks; under `torchrun` or `srun torchrun`
leave it out. On several nodes each runs `--nproc N --hosts H0,H1,... --node_rank R` (R defaults to
SLURM_NODEID; `--port P`, default 29500, on H0), and with fault tolerance `--nproc` starts the
replica groups and torchft's Lighthouse (tessera.trainer.launch). `--max_restarts K`: torchrun's
restarts of a replica group that dies (default 3), or without fault tolerance of the whole job
(default 0). `--check` prints the job plan for `--check_world_size` (else `--nproc`, else
torchrun's WORLD_SIZE, else 1) ranks on `--check_device` (cpu or cuda; cuda when
`--check_world_size` is given, since that plans a cluster's job, else this host's device) and
exits 0 without building the model. Output cut short by a closed pipe (`--check | head -1`) ends
quietly.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from pathlib import Path

from tessera.trainer.errors import ERRORS_ENV, INTERRUPTED, LayoutError, stopped_by


def _interrupted_while_loading(signum, frame) -> None:
    """Ctrl-C while torch and the libraries load: no traceback from deep inside an import; said
    once (a rank of --nproc leaves the saying to its launcher)."""
    if ERRORS_ENV not in os.environ:
        os.write(2, (INTERRUPTED + "\n").encode())
    os._exit(130)


# Run as a program (a rank, a launcher), not imported: no garbage collection while torch and the
# libraries load (passes over their million objects, ~1 s of CPU per process); _loaded() freezes them
# and turns it back on, and gives Ctrl-C back to Python (a KeyboardInterrupt, reported by main).
_LOADING = __name__ == "__main__"
if _LOADING:
    gc.disable()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where a shell ignores it
        signal.signal(signal.SIGINT, _interrupted_while_loading)

from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.faults import (LAUNCHER_PID_ENV, STOP_SIGNALS, TrainingError, die_with_launcher,
                                    elastic_store_note, exit_with_error)


def _take_option(argv: list[str], name: str, takes_value: bool = True) -> tuple[str | None, list[str]]:
    """Removes `name` (with its value: `name V` or `name=V`) from argv: (value, rest), value ""
    for a flag, or (None, argv) when absent."""
    for i, arg in enumerate(argv):
        if arg == name and not takes_value:
            return "", argv[:i] + argv[i + 1:]
        if takes_value and arg.startswith(name + "="):
            return arg.partition("=")[2], argv[:i] + argv[i + 1:]
        if takes_value and arg == name:
            return (argv[i + 1] if i + 1 < len(argv) else ""), argv[:i] + argv[i + 2:]
    return None, argv


def _positive_int(name: str, value: str | None) -> int | None:
    if value is not None and (not value.isdigit() or int(value) < 1):
        raise ConfigError(f"{name} {value!r} must be a positive integer")
    return None if value is None else int(value)


def _count(name: str, value: str | None) -> int | None:
    if value is not None and not value.isdigit():
        raise ConfigError(f"{name} {value!r} must be a non-negative integer")
    return None if value is None else int(value)


def _launch_local(nproc: int, argv: list[str], grace_s: int, rendezvous: tuple[str, ...] = ("--standalone",),
                  max_restarts: int = 0) -> int:
    """Runs this same program on nproc local ranks (rendezvous on a free localhost port). A stop
    signal reaches every rank, which saves and exits 0 (faults.StopSignals); the launcher waits
    for that up to the ranks' own grace, plus a margin, before killing them. An error the ranks
    report (bad input every rank finds, a diverged run) is printed once, here, with its exit
    status; a rank that crashed printed its own traceback. `rendezvous`: torchrun's options for
    this node among several (tessera.trainer.launch); `max_restarts`: torchrun's restarts of the
    ranks after one failed (each attempt with a rendezvous store of its own, pytorch#135712)."""
    import tempfile

    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    from tessera.trainer.master_port import hold_master_ports

    hold_master_ports()

    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the ranks die with this process (faults.py)
    # torchrun's own default for several ranks per node, set here without its four-line banner
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if max_restarts:
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    parser = get_args_parser()
    # how long torchrun waits for the ranks to stop (save) after a stop signal; torch 2.11's has no
    # option for it and waits 30 s
    shutdown = [f"--shutdown_timeout={grace_s + 30}"] if "shutdown_timeout" in parser.parse_args(["x"]) else []
    if not shutdown and grace_s > 30:
        print(f"note: torch {torch.__version__.split('+')[0]}'s torchrun stops the ranks 30 s after a stop signal, within "
              f"job.stop_grace_seconds {grace_s}: a save that takes longer is cut short", file=sys.stderr, flush=True)
    # the launcher's own log lines (ranks signalled, exit codes) would follow every rank's error
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="tessera-errors-") as errors:
        launcher_args = parser.parse_args([
            *rendezvous, f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}", *shutdown,
            f"--signals_to_handle=SIGINT,SIGHUP,SIGQUIT,{','.join(sig.name for sig in STOP_SIGNALS)}",
            # torchrun's folders for the ranks' error files, removed with this one (its default,
            # a new /tmp/torchelastic_* a run, stays behind)
            f"--log-dir={errors}/torchelastic",
            "--no-python", sys.executable, "-m", "tessera.trainer.main", *argv,
        ])
        restarts = _RestartNotice(Path(errors))
        agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
        try:  # from here the finally unsets ERRORS_ENV: this process's own error is printed, not filed
            os.environ[ERRORS_ENV] = errors
            agent_log.setLevel(logging.INFO)  # its other lines stay unsaid: this handler alone hears it
            agent_log.propagate = False
            agent_log.addHandler(restarts)
            run(launcher_args)
        except (RendezvousError, torch.distributed.DistError) as e:  # the ranks never met: hosts, ports, firewalls
            print(f"error: {nproc}-process run could not start: {(str(e).strip().splitlines() or [type(e).__name__])[0]}",
                  file=sys.stderr)
            return 1
        except (ChildFailedError, SignalException) as e:  # anything else is a bug in this wiring: its traceback
            reports = _reports(Path(errors))
            if isinstance(e, SignalException) and not reports:  # the ranks saved and said so, or never began
                print(stopped_by(nproc, e.sigval.name), file=sys.stderr)
                return 0 if e.sigval in STOP_SIGNALS else 128 + e.sigval
            if reports:
                code, message = _read_report(reports[0])
                print(message, file=sys.stderr)
                return code
            failures = getattr(e, "failures", {})
            exits = ", ".join(f"rank {f.local_rank} exit code {f.exitcode}" for f in failures.values())
            print(f"error: {nproc}-process run failed: {exits or type(e).__name__}", file=sys.stderr)
            return 1
        finally:
            os.environ.pop(ERRORS_ENV, None)
            agent_log.removeHandler(restarts)
    return 0


def _reports(errors: Path) -> list[Path]:
    """The ranks' error reports in `errors` (rank-<R>, as faults.exit_with_error writes them), by rank."""
    return sorted(errors.glob("rank-*"), key=lambda path: int(path.name.removeprefix("rank-")))


def _read_report(path: Path) -> tuple[int, str]:
    """A rank's report: its exit status and its one-line message."""
    code, _, message = path.read_text().partition("\n")
    return int(code), message


class _RestartNotice(logging.Handler):
    """torchrun's restart of the ranks (--max_restarts), said in one line with the error a rank
    reported (torchrun's own log is silenced, and a rank's report would otherwise go unread, or be
    read as the next attempt's): a job that restarts says so, and why."""

    def __init__(self, errors: Path) -> None:
        super().__init__(logging.INFO)
        self.errors = errors

    def emit(self, record: logging.LogRecord) -> None:
        if "will restart worker group" not in str(record.msg):
            return
        try:
            self._say(*record.args)
        except Exception:  # noqa: BLE001  logging's rule: a handler's failure never stops the caller (the agent)
            self.handleError(record)

    def _say(self, _role: str, state: str, left: int, most: int) -> None:
        why = []
        for path in _reports(self.errors):  # this attempt's, read once: the next attempt's failure reports its own
            rank, message = path.name.removeprefix("rank-"), _read_report(path)[1].removeprefix("error: ")
            why.append(message if message.startswith(f"rank {rank}") else f"rank {rank}: {message}")
            path.unlink()
        print(f"launcher: the ranks {state.lower()}{' (' + '; '.join(why) + ')' if why else ''}; restarting them, "
              f"restart {most - left + 1} of {most}", file=sys.stderr, flush=True)


def _loaded() -> None:
    """After the imports of a process run as a program: what they made lives as long as the process,
    so the collector stops walking it (gc.freeze, which also spares the exit a full pass), and
    collection resumes for what comes next."""
    global _LOADING
    if _LOADING:
        gc.freeze()
        gc.enable()
        if signal.getsignal(signal.SIGINT) is _interrupted_while_loading:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        _LOADING = False


def _print_for_a_reader(text: str) -> None:
    """Prints what --check, --help and --version show; a reader that left early (`--check |
    head -1`) ends it quietly, as for any filter (a training run's closed stdout stays an error)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more at exit's flush either


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in ("--help", "-h", "--version"):
            from tessera.trainer import cli_info

            _print_for_a_reader(cli_info.version_text() if argv[0] == "--version"
                                else cli_info.help_text(argv[1] if len(argv) > 1 else None))
            return 0
        nproc, argv = _take_option(argv, "--nproc")
        nproc = _positive_int("--nproc", nproc)
        hosts, argv = _take_option(argv, "--hosts")
        node_rank, argv = _take_option(argv, "--node_rank")
        port, argv = _take_option(argv, "--port")
        max_restarts, argv = _take_option(argv, "--max_restarts")
        for flag, value in (("--hosts", hosts), ("--node_rank", node_rank), ("--port", port), ("--max_restarts", max_restarts)):
            if value is not None and nproc is None:
                raise ConfigError(f"{flag} needs --nproc")
        node_rank, port = _count("--node_rank", node_rank), _positive_int("--port", port)
        if port is not None and port > 65535:
            raise ConfigError(f"--port {port} is not a TCP port (1 to 65535)")
        max_restarts = _count("--max_restarts", max_restarts)
        check, argv = _take_option(argv, "--check", takes_value=False)
        check_world_size, argv = _take_option(argv, "--check_world_size")
        check_world_size = _positive_int("--check_world_size", check_world_size)
        check_device, argv = _take_option(argv, "--check_device")
        for flag, value in (("--check_world_size", check_world_size), ("--check_device", check_device)):
            if value is not None and check is None:
                raise ConfigError(f"{flag} needs --check")
        if check_device not in (None, "cpu", "cuda"):
            raise ConfigError(f"--check_device {check_device!r} is not one of cpu, cuda")
        config = load_config(argv)
        from tessera.trainer.plan import make_plan

        if check is not None:
            from tessera.trainer.check import describe
            from tessera.trainer.ft_plan import group_world_size

            # --nproc and --check_world_size count the whole job's ranks: with fault tolerance, its replica groups'
            world_size = group_world_size(check_world_size or nproc, config) if check_world_size or nproc else \
                int(os.environ.get("WORLD_SIZE", "1"))
            device = check_device or ("cuda" if check_world_size else None)
            try:
                plan = make_plan(config, world_size, device, check_only=True, command_line=argv)
            except ConfigError as e:
                if check_world_size or nproc or "WORLD_SIZE" in os.environ or not isinstance(e, LayoutError):
                    raise
                raise ConfigError(f"{e} (planned for 1 rank: --check_world_size N plans the cluster's job)") from None
            _print_for_a_reader(describe(plan))
            return 0
        if nproc is not None:
            from tessera.trainer import launch
            from tessera.trainer.ft_plan import group_world_size

            host_list, node = launch.node_layout([h for h in (hosts or "").split(",") if h], node_rank)
            one_group = launch.GROUP_LAUNCHER_ENV in os.environ  # launching a replica group's ranks alone
            world = nproc * len(host_list)
            # every config error once, before any worker starts (with fault tolerance: for one replica group)
            make_plan(config, world if one_group else group_world_size(world, config))
            restarts = 3 if max_restarts is None else max_restarts
            _loaded()
            port = port or launch.DEFAULT_PORT
            if config.fault_tolerance.enable and not one_group:
                return launch.launch_replica_groups(nproc, host_list, node, port, restarts, argv, config)
            return _launch_local(nproc, argv, config.job.stop_grace_seconds, launch.rendezvous(host_list, port, "job"),
                                 restarts if config.fault_tolerance.enable else (max_restarts or 0))
        from tessera.trainer.train import train

        _loaded()
        die_with_launcher()
        note = elastic_store_note()
        if note and os.environ.get("RANK", "0") == "0":
            print(note, file=sys.stderr, flush=True)
        train(config, command_line=argv)
    except (ConfigError, OSError) as e:  # OSError: unwritable dump folder, full disk, unreadable files
        return exit_with_error(f"error: {e}", 2)
    except TrainingError as e:  # diverged: the numbers, not the input, are at fault
        return exit_with_error(f"error: {e}", 1)
    except KeyboardInterrupt:  # Ctrl-C, or under --nproc the launcher's: the user's stop, not a bug
        return exit_with_error(INTERRUPTED, 130)
    return 0


if __name__ == "__main__":
    sys.exit(main())
