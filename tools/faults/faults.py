"""faults: inject faults into short trainer runs and check that nothing is lost.

    bazel run //tools/faults [-- --steps 8 --only sigkill-step]

Each fault runs the trainer as a separate process (the debug model, tiny batches, a checkpoint
every 2 steps), injects the fault, then re-runs the same command as an operator would and
compares with an uninterrupted run of the same layout. Printed per fault: survived (the final
state was reached), steps lost (trained again after the restart), data lost (checkpoints that
were complete before the fault and unreadable after it: must be 0), and the largest difference
of the logged losses and of the final weights from the uninterrupted run (must be 0: every
fault here resumes exactly).
Exit status 1 if any fault was not survived, lost data or resumed inexactly.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tessera.ckpt import read_dcp

SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
         "--metrics.disable_color_printing", "true", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
         "--checkpoint.last_save_model_only", "false"]
FSDP2 = ["--nproc", "2", "--parallelism.data_parallel_shard_degree", "2"]


def _command(dump: Path, steps: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "tessera.trainer.main", *SMALL, "--training.steps", str(steps),
            "--job.dump_folder", str(dump), *extra]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")


def _complete(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("step-*") if re.fullmatch(r"step-\d+", p.name) and (p / ".metadata").is_file())


def _readable(step: Path) -> bool:
    try:
        read_dcp(step)
        return True
    except Exception:  # noqa: BLE001  any failure to read is data lost
        return False


class Run:
    """One trainer process (with its ranks, in a process group of their own), its output in
    <dump>.<tag>.log."""

    def __init__(self, dump: Path, steps: int, extra: list[str], preexec_fn: Callable | None = None, tag: str = "run") -> None:
        self.dump, self.log = dump, Path(f"{dump}.{tag}.log")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(_command(dump, steps, extra), env=_env(), stdout=out, stderr=out,
                                         preexec_fn=preexec_fn, start_new_session=True)

    def wait_until(self, condition: Callable[[], bool], timeout: float = 600) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def finish(self, timeout: float = 600) -> int:
        """The exit status; ranks left behind (orphans) are killed and make it -1."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        time.sleep(1)  # orphans get their parent-death signal
        left = _living_members(self.proc.pid)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        if code is None:
            self.proc.kill()
            self.proc.wait()
        return -1 if left or code is None else code

    def steps_trained(self) -> list[int]:
        return list(self.losses())

    def losses(self) -> dict[int, float]:
        """Step -> logged loss (printed to 4 decimals)."""
        return {int(step): float(loss) for step, loss in re.findall(r"^step +(\d+)/\d+ +loss +(\S+)", self.log.read_text(), re.M)}


def _living_members(group: int) -> list[int]:
    """Processes of the process group that are not zombies (an unreaped orphan is harmless)."""
    living = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            living.append(int(stat.parent.name))
    return living


def _weights_difference(a: Path, b: Path) -> float:
    left, right = read_dcp(a, only="model"), read_dcp(b, only="model")
    return max((left[k].float() - right[k].float()).abs().max().item() for k in left)


def _fault(name: str, layout: list[str], inject: Callable[[Run, Path], None], steps: int, work: Path, reference: Run,
           preexec_fn: Callable | None = None) -> dict:
    """Runs, injects, restarts once; the row of the table."""
    dump = work / name
    first = Run(dump, steps, layout, preexec_fn, tag="faulty")
    folder = dump / "checkpoint"
    inject(first, folder)
    orphans = first.finish() == -1
    before, trained = _complete(folder), max(first.steps_trained(), default=0)
    second = Run(dump, steps, layout, tag="restart")
    code = second.finish()
    trained_again = [s for s in second.steps_trained() if s <= trained]
    final = folder / f"step-{steps}"
    survived = code == 0 and not orphans and (final / ".metadata").is_file()
    expected, resumed = reference.losses(), second.losses()
    return {
        "fault": name, "survived": survived, "steps lost": len(trained_again),
        "data lost": sum(not _readable(step) for step in before),
        "loss diff": max((abs(loss - expected[step]) for step, loss in resumed.items()), default=float("nan")),
        "weight diff": (_weights_difference(final, reference.dump / "checkpoint" / f"step-{steps}") if survived
                        else float("nan")),
    }


def _kill_at_random_step(rng: random.Random, steps: int) -> Callable[[Run, Path], None]:
    at = rng.randint(3, steps - 1)

    def inject(run: Run, folder: Path) -> None:
        run.wait_until(lambda: at in run.steps_trained())
        run.proc.kill()  # the launcher alone: its ranks must die with it
    return inject


def _kill_mid_save(run: Run, folder: Path) -> None:
    run.wait_until(lambda: any(folder.glob(".step-4.tmp/*")))
    run.proc.kill()


def _sigterm(run: Run, folder: Path) -> None:
    run.wait_until(lambda: 3 in run.steps_trained())
    run.proc.send_signal(signal.SIGTERM)


def _limit_file_size() -> None:
    """After the first checkpoint's worth of files, writes fail (EFBIG) as on a full disk."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _nothing(run: Run, folder: Path) -> None:
    pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="chooses the random kill steps")
    parser.add_argument("--only", default="", help="run the faults whose name contains this")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="tessera-faults-"))
    faults = [
        ("sigkill-step-single", "single", [], _kill_at_random_step(rng, args.steps), None),
        ("sigkill-step-fsdp2", "fsdp2", FSDP2, _kill_at_random_step(rng, args.steps), None),
        ("sigkill-mid-save-sync-single", "single", [], _kill_mid_save, None),
        ("sigkill-mid-save-async-single", "single", ["--checkpoint.async_mode", "async"], _kill_mid_save, None),
        ("sigkill-mid-save-sync-fsdp2", "fsdp2", FSDP2, _kill_mid_save, None),
        ("sigkill-mid-save-async-fsdp2", "fsdp2", [*FSDP2, "--checkpoint.async_mode", "async"], _kill_mid_save, None),
        ("sigterm-single", "single", [], _sigterm, None),
        ("sigterm-fsdp2", "fsdp2", FSDP2, _sigterm, None),
        ("disk-full-single", "single", [], _nothing, _limit_file_size),
    ]
    rows, references = [], {}
    for name, layout_name, layout, inject, preexec_fn in faults:
        if args.only not in name:
            continue
        if layout_name not in references:  # the uninterrupted run of this layout
            references[layout_name] = Run(work / f"reference-{layout_name}", args.steps, FSDP2 if layout_name == "fsdp2" else [])
            references[layout_name].finish()
        rows.append(_fault(name, layout, inject, args.steps, work, references[layout_name], preexec_fn=preexec_fn))
    print(f"{'fault':32} {'survived':>8} {'steps lost':>10} {'data lost':>9} {'loss diff':>9} {'weight diff':>11}")
    for row in rows:
        print(f"{row['fault']:32} {str(row['survived']):>8} {row['steps lost']:>10} {row['data lost']:>9} "
              f"{row['loss diff']:>9.2g} {row['weight diff']:>11.2g}")
    print(f"{len(rows)} faults injected, {sum(row['survived'] for row in rows)} survived, "
          f"{sum(row['data lost'] for row in rows)} checkpoints lost")
    print("not injected here: a stalled rank and NaN (apps/trainer/tests/test_reliability.py), a real full disk "
          "(a small tmpfs needs mount rights; file-size limits stand in)")
    bad = [row for row in rows
           if not row["survived"] or row["data lost"] or row["loss diff"] or row["weight diff"]]
    shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
