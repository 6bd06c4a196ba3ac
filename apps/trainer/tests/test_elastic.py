"""Elastic restart (issue 13): under `torchrun --max-restarts` (tools/launch's, as the README
and tools/slurm launch the trainer), a rank that dies (the [debug] fault switch) restarts the
job, which resumes from its newest checkpoint by itself and continues exactly as an
uninterrupted run (same losses, same final weights)."""

import errno
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.run

from tessera.ckpt import read_dcp
from tessera.trainer import faults, launch, main, master_port
from tessera.trainer.faults import elastic_store_note, inject_fault
from tessera.trainer.config import load_config
from tessera.trainer.errors import INTERRUPTED, stopped_by

TORCHRUN = Path(__file__).parents[3] / "tools" / "launch" / "torchrun.py"

STEPS = 6
ARGS = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
        "--metrics.disable_color_printing", "true", "--lr_scheduler.warmup_steps", "2", "--training.steps", str(STEPS),
        "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--parallelism.data_parallel_shard_degree", "2"]
ENV = {key: value for key, value in os.environ.items() if key != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
ENV.update(PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")


def torchrun(dump, max_restarts, *extra):
    argv = [sys.executable, str(TORCHRUN), "--standalone", "--nproc_per_node", "2",
            "--max-restarts", str(max_restarts), "-m", "tessera.trainer.main", *ARGS, "--job.dump_folder", str(dump), *extra]
    return subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=600)


def logged_steps(stdout):
    """(step, the logged loss and grad norm) in order, restarts included."""
    return re.findall(r"^step +(\d+)/\d+ +(loss +\S+ +grad_norm +\S+)", stdout, re.M)


def test_a_dead_rank_restarts_the_job_which_resumes_exactly(tmp_path):
    faulty = torchrun(tmp_path / "faulty", 1, "--debug.fault_at_step", "4", "--debug.fault_rank", "1")
    assert faulty.returncode == 0, faulty.stderr[-3000:]
    assert "debug: injected fault: rank 1 crashes before step 4 (debug.fault_at_step)" in faulty.stderr
    assert f"checkpoint: loaded {tmp_path / 'faulty' / 'checkpoint' / 'step-2'}; training continues after step 2" in faulty.stdout
    reference = torchrun(tmp_path / "reference", 0)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = dict(logged_steps(reference.stdout))
    steps = logged_steps(faulty.stdout)
    # the first attempt trained steps 1-3 and died before 4; the restart retrained 3, then 4-6
    assert [int(step) for step, _ in steps] == [1, 2, 3, 3, 4, 5, 6]
    assert all(values == expected[step] for step, values in steps)
    final = [read_dcp(tmp_path / run / "checkpoint" / f"step-{STEPS}", only="model") for run in ("faulty", "reference")]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][key], final[1][key]) for key in final[0])


def test_a_restart_of_the_ranks_is_said_with_the_errors_they_reported(tmp_path, capsys):
    """`--nproc --max_restarts` silences torchrun's log: its restart of the ranks was unsaid, and
    the errors the ranks reported at it unread (or read as a later attempt's). One line now, and
    the reports are consumed."""
    (tmp_path / "rank-1").write_text("2\nerror: checkpoint folder /x is not writable: Directory not empty")
    (tmp_path / "rank-0").write_text("1\nerror: rank 0, step 3: all_reduce lost a peer rank")
    record = logging.LogRecord("torch.distributed.elastic.agent.server.api", logging.INFO, __file__, 0,
                               "[%s] Worker group %s. %s/%s attempts left; will restart worker group",
                               ("default", "FAILED", 3, 3), None)
    main._RestartNotice(tmp_path).handle(record)
    assert capsys.readouterr().err == (
        "launcher: the ranks failed (rank 0, step 3: all_reduce lost a peer rank; rank 1: checkpoint folder /x is not "
        "writable: Directory not empty); restarting them, restart 1 of 3\n")
    assert list(tmp_path.iterdir()) == []


def test_the_fault_fires_only_where_and_when_asked(monkeypatch):
    """Returning is the test: a fired crash would end this process."""
    debug = load_config(["--debug.fault_at_step", "3", "--debug.fault_rank", "1"]).debug
    for rank, step in ((0, 3), (1, 2), (1, 4)):
        inject_fault(debug, rank, step, 1)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted attempt runs clean
    inject_fault(debug, 1, 3, 1)
    off = load_config([]).debug
    assert off.fault_at_step == 0
    for step in range(5):
        inject_fault(off, 0, step, 1)


def test_plain_torchrun_with_restarts_gets_a_note(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in elastic_store_note()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # tools/launch/torchrun
    assert elastic_store_note() is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert elastic_store_note() is None


def test_the_master_port_stays_held_until_rank_0_binds_it(monkeypatch):
    """Without a shared rendezvous store (restarts) torchrun handed rank 0 a port it had released,
    which another process could take before rank 0 bound it; the launcher now holds it."""
    from torch.distributed.elastic.rendezvous import api

    monkeypatch.setattr(api, "get_free_port", api.get_free_port)  # restored after the test
    monkeypatch.setattr(master_port, "_held", [])
    master_port.hold_master_ports()
    port = api.RendezvousStoreInfo.build(0, torch.distributed.HashStore(), local_addr="localhost").master_port
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("", port))
    assert taken.value.errno == errno.EADDRINUSE
    store = torch.distributed.TCPStore("localhost", port, is_master=True, wait_for_workers=False)  # rank 0's
    store.set("bound", "yes")
    assert torch.distributed.TCPStore("localhost", port, is_master=False).get("bound") == b"yes"
    for sock in master_port._held:
        sock.close()


GRACE_OUT = "error: not stopped within 5s of SIGTERM (job.stop_grace_seconds); exiting without a checkpoint of this step"


@pytest.mark.parametrize("sig, report, code, said", [
    (signal.SIGTERM, None, 0, "2-process run stopped by SIGTERM"),
    (signal.SIGTERM, (1, GRACE_OUT), 1, GRACE_OUT),
    (signal.SIGINT, (130, INTERRUPTED), 130, INTERRUPTED),
    (signal.SIGINT, None, 130, "2-process run stopped by SIGINT"),  # before the ranks began
])
def test_a_stop_ends_the_job_with_0_only_when_its_ranks_stopped(monkeypatch, capsys, sig, report, code, said):
    """Ranks that saved and stopped leave no report: exit 0 (a scheduler requeues the job). A rank
    whose grace ran out reports it: the job's end is a failure, not a stop. Ctrl-C ends it with 130,
    in the ranks' one line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stopped(args):
        if report is not None:
            Path(os.environ[faults.ERRORS_ENV], "rank-1").write_text(f"{report[0]}\n{report[1]}")
        raise SignalException("stopped", sig)
    monkeypatch.setattr(torch.distributed.run, "run", stopped)
    monkeypatch.setattr(master_port, "hold_master_ports", lambda: None)  # torch's port picker stays its own
    for name in (faults.LAUNCHER_PID_ENV, "OMP_NUM_THREADS"):  # what the launcher sets, restored after
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    assert main._launch_local(2, [], grace_s=5) == code
    assert capsys.readouterr().err.strip() == said


# A replica group's launcher as launch_replica_groups sees it: says it trains, reports whether it
# leads a session of its own, and on SIGINT ends as main does when its ranks were training
# ("ranks"), when they had not begun ("before"), or as a group that failed meanwhile ("fails").
_FAKE_GROUP = f"""
import os, signal, sys, time
from pathlib import Path
SAYS = {{"ranks": ({INTERRUPTED!r}, 130), "before": ({stopped_by(2, "SIGINT")!r}, 130), "fails": ("error: boom", 1)}}
def stopped(signum, frame):
    line, code = SAYS[sys.argv[2]]
    sys.stderr.write(line + "\\n")
    sys.stderr.flush()
    os._exit(code)
signal.signal(signal.SIGINT, stopped)
print("training", flush=True)
Path(sys.argv[1]).write_text(str(os.getsid(0) == os.getpid()))
time.sleep(120)
"""


@pytest.mark.parametrize("ends, said", [
    (("ranks", "ranks"), [INTERRUPTED]),
    (("before", "ranks"), [INTERRUPTED]),
    (("ranks", "fails"), ["[replica 1] error: boom", INTERRUPTED, "error: replica group 1 ended with exit status 1 after 3 restarts"]),
])
def test_ctrl_c_under_fault_tolerance_is_said_once_with_130(monkeypatch, capsys, tmp_path, ends, said):
    """Ctrl-C stops every replica group; the job says INTERRUPTED once (the groups' own lines
    about it are left out), and a group that failed otherwise, and exits 130. Each group leads a
    session of its own, so that a terminal's SIGINT reaches it once, forwarded (a second SIGINT
    during its torchrun agent's shutdown made that agent send the ranks SIGTERM)."""
    ready = [tmp_path / f"group-{g}" for g in range(2)]
    popen, returned = subprocess.Popen, threading.Event()

    def fake_group(command, **kwargs):
        group = int(command[command.index("--fault_tolerance.replica_id") + 1])
        return popen([sys.executable, "-c", _FAKE_GROUP, str(ready[group]), ends[group]], **kwargs)

    class Lighthouse:
        terminate = wait = staticmethod(lambda: None)

    monkeypatch.setattr(launch, "groups_of_node", lambda *args: [(g, 2, ["localhost"], 0) for g in range(2)])
    monkeypatch.setattr(launch, "_lighthouse", lambda config, port: Lighthouse())
    monkeypatch.setattr(launch, "_check_started", lambda lighthouse: None)
    monkeypatch.setattr(launch.subprocess, "Popen", fake_group)

    def ctrl_c():  # once both groups run, and never after launch_replica_groups gave SIGINT back to pytest
        while not all(path.exists() and path.read_text() for path in ready):
            if returned.wait(0.05):
                return
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c, daemon=True).start()
    try:
        code = launch.launch_replica_groups(4, ["localhost"], 0, 29500, 3, [], None)
    finally:
        returned.set()
    out, err = capsys.readouterr()
    assert (code, err.splitlines()) == (130, said)
    assert sorted(out.splitlines()) == ["[replica 0] training", "[replica 1] training"]
    assert [path.read_text() for path in ready] == ["True", "True"]


def test_ranks_that_never_met_are_one_line_and_a_bug_keeps_its_traceback(monkeypatch, capsys):
    """A rendezvous that fails (a host or port out of reach) is said in one line, exit 1; any
    other exception from the launcher is a bug in its wiring and propagates."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    failure = RendezvousTimeoutError("the node could not join the rendezvous\n(and a second line)")

    def launch(args):
        raise failure
    monkeypatch.setattr(torch.distributed.run, "run", launch)
    monkeypatch.setattr(master_port, "hold_master_ports", lambda: None)
    for name in (faults.LAUNCHER_PID_ENV, "OMP_NUM_THREADS"):
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    assert main._launch_local(2, [], grace_s=5) == 1
    assert capsys.readouterr().err.strip() == \
        "error: 2-process run could not start: the node could not join the rendezvous"
    failure = TypeError("a launcher argument torch no longer takes")
    with pytest.raises(TypeError, match="no longer takes"):
        main._launch_local(2, [], grace_s=5)
