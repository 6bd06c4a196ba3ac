"""faults: inject faults into short trainer runs and check that nothing is lost.

    bazel run //tools/faults [-- --steps 8 --only sigkill-step,pp2]

Each fault runs the trainer as a separate process (the debug model, tiny batches, a checkpoint
every 2 steps) under one layout (LAYOUTS: one process, FSDP 2, PP 2, CP 2, DeepSeek-V3 under
EP 2 x FSDP 2; the name ends with it), injects the fault, then re-runs the same command as an
operator would (for a full or read-only disk: after making room) and compares with an
uninterrupted run of the same layout. Printed per fault: survived (the final state was reached; for NaN: the run stopped
non-zero after training.max_skipped_steps with one line), steps lost (trained again after the
restart), data lost (checkpoints that were complete before the fault and unreadable after it,
plus any holding non-finite weights: must be 0), the largest difference of the logged losses
and of the final weights from the uninterrupted run (must be 0: every fault here resumes
exactly), and how the faulty run ended.

Disk faults use a real tmpfs (a little larger than one checkpoint, then remounted bigger; or
remounted read-only mid-run) when this process may mount one (root with CAP_SYS_ADMIN);
otherwise a file-size limit stands in for a full disk and the table says so.
A second table (recovery.py, the `kill-rank-*` names) kills a rank of a two-rank job and sets
torchft's live recovery (replica groups; per-step and DiLoCo) beside a checkpoint restart: steps
lost, steps a group sat out, wall seconds lost, final weights.
Exit status 1 if any fault was not survived, lost data or resumed inexactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import recovery
from tessera.ckpt import read_dcp

SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
         "--metrics.disable_color_printing", "true", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
         "--checkpoint.last_save_model_only", "false"]
FSDP2 = ["--nproc", "2", "--parallelism.data_parallel_shard_degree", "2"]
ONE_DP_RANK = ["--nproc", "2", "--parallelism.data_parallel_shard_degree", "1"]
# The layouts a fault runs under (its name ends with the key), beside the uninterrupted run of each
LAYOUTS = {
    "single": [],
    "fsdp2": FSDP2,
    "pp2": [*ONE_DP_RANK, "--parallelism.pipeline_parallel_degree", "2"],  # 1F1B over 2 micro-batches
    "cp2": [*ONE_DP_RANK, "--parallelism.context_parallel_degree", "2"],
    "ep2": [*FSDP2, "--model.name", "deepseek_v3", "--model.flavor", "tiny", "--parallelism.expert_parallel_degree", "2"],
}
ASYNC = ["--checkpoint.async_mode", "async"]
STALL_TIMEOUT_S = 3  # comm.train_timeout_seconds of the stalled-rank run; the rank stalls twice that
# --steps' least: the stalled rank stalls at step 5, a mid-save kill waits for step 4's (not the
# last) checkpoint, a kill at a step picks one of 3..steps-1
MIN_STEPS = 5


def _command(dump: Path, steps: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "tessera.trainer.main", *SMALL, "--training.steps", str(steps),
            "--job.dump_folder", str(dump), *extra]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")


def _complete(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("step-*") if re.fullmatch(r"step-\d+", p.name) and (p / ".metadata").is_file())


def _lost(step: Path) -> bool:
    """Unreadable, or holding non-finite weights (every resume from it would be poisoned)."""
    try:
        model = read_dcp(step, only="model")
    except Exception:  # noqa: BLE001  any failure to read is data lost
        return True
    return not all(torch.isfinite(value).all() for value in model.values() if isinstance(value, torch.Tensor))


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
        """The exit status; ranks left behind (orphans), or a run past `timeout`, are killed and
        make it -1 (`ending` says which)."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        left = _living_members(self.proc.pid)
        deadline = time.monotonic() + 1  # orphans get their parent-death signal
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = _living_members(self.proc.pid)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        if code is None:
            self.proc.kill()
            self.proc.wait()
        self.ending = f"past its {timeout:g} s" if code is None else "orphaned ranks" if left else f"exit {code}"
        return -1 if left or code is None else code

    def steps_trained(self) -> list[int]:
        return list(self.losses())

    def losses(self) -> dict[int, float]:
        """Step -> logged loss (printed to 4 decimals)."""
        return {int(step): float(loss) for step, loss in re.findall(r"^step +(\d+)/\d+ +loss +(\S+)", self.log.read_text(), re.M)}

    def first_error(self) -> str:
        errors = re.findall(r"^error: (.*)$", self.log.read_text(), re.M)
        return errors[0] if errors else ""


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


# ---- a real disk: tmpfs -----------------------------------------------------------------------

def _mount_tmpfs(folder: Path, size: int) -> str | None:
    """Mounts a tmpfs of `size` bytes on `folder`: None, or why it could not."""
    if os.geteuid() != 0:
        return "not root"
    folder.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True)
    return None if result.returncode == 0 else (result.stderr.strip() or f"mount exited {result.returncode}")


def _remount(folder: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(folder)], check=True, capture_output=True)


def _unmount(folder: Path) -> None:
    subprocess.run(["umount", "--lazy", str(folder)], check=False, capture_output=True)


def _tmpfs_unavailable(work: Path) -> str | None:
    probe = work / "mount-probe"
    why = _mount_tmpfs(probe, 1 << 20)
    if why is None:
        _unmount(probe)
    return why


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ---- faults ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Fault:
    name: str
    layout: str  # a key of LAYOUTS: which uninterrupted run it is compared with
    inject: Callable[[Run, Path], None]
    extra: list[str] = dataclasses.field(default_factory=list)  # both runs' arguments beyond the layout
    faulty_extra: list[str] = dataclasses.field(default_factory=list)  # the faulty run's alone (the fault switch)
    preexec_fn: Callable | None = None
    disk: str = ""  # "full" or "read-only": the dump folder lives on a tmpfs
    resumes: bool = True  # False (NaN): the run must stop, there is nothing to resume


def _fault(fault: Fault, steps: int, work: Path, reference: Run) -> dict:
    """Runs, injects, restarts once; the row of the table."""
    dump = work / fault.name
    layout = [*LAYOUTS[fault.layout], *fault.extra]
    checkpoint_bytes = _folder_bytes(_complete(reference.dump / "checkpoint")[0])
    if fault.disk:  # room for one checkpoint and a half, or plenty to be made read-only
        why = _mount_tmpfs(dump, checkpoint_bytes * (3 if fault.disk == "full" else steps) // 2)
        assert why is None, why  # probed before
    try:
        return _faulty_then_restart(fault, dump, layout, steps, reference, checkpoint_bytes)
    finally:
        if fault.disk:
            _unmount(dump)


def _faulty_then_restart(fault: Fault, dump: Path, layout: list[str], steps: int, reference: Run, checkpoint_bytes: int) -> dict:
    first = Run(dump, steps, [*layout, *fault.faulty_extra], fault.preexec_fn, tag="faulty")
    folder = dump / "checkpoint"
    fault.inject(first, folder)
    code = first.finish()
    orphans, error = code == -1, first.first_error()
    row = {"fault": fault.name, "resumes": fault.resumes, "ended": first.ending + (f": {error}" if not orphans and error else "")}
    row["ended"] = row["ended"].replace(str(dump), "<dump>")
    before, trained = _complete(folder), max(first.steps_trained(), default=0)
    if not fault.resumes:
        stopped = code == 1 and "optimizer steps skipped, more than training.max_skipped_steps" in error
        return {**row, "survived": stopped and bool(before), "steps lost": math.nan,
                "data lost": sum(_lost(step) for step in before), "loss diff": math.nan, "weight diff": math.nan}
    if fault.disk:
        _remount(dump, f"rw,size={checkpoint_bytes * (steps + 2)}")  # the operator made room
    second = Run(dump, steps, layout, tag="restart")
    code = second.finish()
    trained_again = [s for s in second.steps_trained() if s <= trained]
    final = folder / f"step-{steps}"
    finished = (final / ".metadata").is_file()
    survived = code == 0 and not orphans and finished
    expected, resumed = reference.losses(), second.losses()
    if not survived:  # why, for a fault that fails only on some machine: the restart's last lines
        tail = second.log.read_text().splitlines()[-15:]
        missing = "" if finished else f", no {final.name}"
        faulty = f"the faulty run's ending: {first.ending}; " if orphans else ""
        row["why"] = [f"{fault.name} failed: {faulty}the restart's ending: {second.ending}{missing}; its last "
                      f"{len(tail)} lines:", *(f"  {line}" for line in tail)]
    return {
        **row, "survived": survived, "steps lost": len(trained_again),
        "data lost": sum(_lost(step) for step in before),
        "loss diff": max((abs(loss - expected[step]) for step, loss in resumed.items()), default=math.nan),
        "weight diff": (_weights_difference(final, reference.dump / "checkpoint" / f"step-{steps}") if survived
                        else math.nan),
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


def _read_only_after_step_2(run: Run, folder: Path) -> None:
    run.wait_until(lambda: (folder / "step-2" / ".metadata").is_file())
    _remount(folder.parent, "ro")


def _limit_file_size() -> None:
    """After the first checkpoint's worth of files, writes fail (EFBIG) as on a full disk."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _nothing(run: Run, folder: Path) -> None:
    pass


def faults(rng: random.Random, steps: int, tmpfs: bool) -> list[Fault]:
    stall = ["--debug.fault_at_step", "5", "--debug.fault_rank", "1", "--debug.fault_kind", "stall",
             "--comm.train_timeout_seconds", str(STALL_TIMEOUT_S)]
    nan = ["--optimizer.lr", "1e6", "--lr_scheduler.warmup_steps", "0", "--training.max_skipped_steps", "2",
           "--training.steps", "100"]  # diverges within a few steps, whatever --steps says
    disks = [
        Fault("disk-full-tmpfs-sync-single", "single", _nothing, disk="full"),
        Fault("disk-full-tmpfs-async-single", "single", _nothing, ASYNC, disk="full"),
        Fault("read-only-tmpfs-async-single", "single", _read_only_after_step_2, ASYNC, disk="read-only"),
    ] if tmpfs else [Fault("disk-full-fsize-limit-single", "single", _nothing, preexec_fn=_limit_file_size)]
    return [
        Fault("sigkill-step-single", "single", _kill_at_random_step(rng, steps)),
        Fault("sigkill-step-fsdp2", "fsdp2", _kill_at_random_step(rng, steps)),
        Fault("sigkill-mid-save-sync-single", "single", _kill_mid_save),
        Fault("sigkill-mid-save-async-single", "single", _kill_mid_save, ASYNC),
        Fault("sigkill-mid-save-sync-fsdp2", "fsdp2", _kill_mid_save),
        Fault("sigkill-mid-save-async-fsdp2", "fsdp2", _kill_mid_save, ASYNC),
        Fault("sigterm-single", "single", _sigterm),
        Fault("sigterm-fsdp2", "fsdp2", _sigterm),
        *disks,
        Fault("stalled-rank-fsdp2", "fsdp2", _nothing, faulty_extra=stall),
        *(fault for layout in ("pp2", "cp2", "ep2") for fault in (
            Fault(f"sigkill-step-{layout}", layout, _kill_at_random_step(rng, steps)),
            Fault(f"sigkill-mid-save-sync-{layout}", layout, _kill_mid_save),
            Fault(f"sigterm-{layout}", layout, _sigterm))),
        Fault("nan-lr-1e6-single", "single", _nothing, faulty_extra=nan, resumes=False),
    ]


def _names() -> list[str]:
    """Every fault's (with a tmpfs or without) and recovery's name, known before the tmpfs probe."""
    rng = random.Random(0)  # the kill steps do not matter here
    every = [fault.name for tmpfs in (True, False) for fault in faults(rng, MIN_STEPS, tmpfs)]
    return [*dict.fromkeys(every), *(r.name for r in recovery.RECOVERIES)]


def _only(parser: argparse.ArgumentParser, only: str | None) -> list[str]:
    """The --only parts (without it: "", which every name contains); a part that matches no name,
    or an --only of none, is refused rather than running fewer faults, or all."""
    if only is None:
        return [""]
    parts = [part.strip() for part in only.split(",") if part.strip()]
    names = _names()
    unknown = [part for part in parts if not any(part in name for name in names)]
    if not parts:
        parser.error(f"--only {only!r} names nothing; the names: {', '.join(names)}")
    if unknown:
        parser.error(f"--only: no fault or recovery name contains {' or '.join(map(repr, unknown))}; "
                     f"the names: {', '.join(names)}")
    return parts


def _cell(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help=f"steps per run (at least {MIN_STEPS})")
    parser.add_argument("--seed", type=int, default=0, help="chooses the random kill steps")
    parser.add_argument("--only", help="run the faults whose name contains one of these (comma-separated)")
    args = parser.parse_args(argv)
    if args.steps < MIN_STEPS:
        parser.error(f"--steps must be >= {MIN_STEPS}: faults strike as late as step {MIN_STEPS} (the stalled rank)")
    only = _only(parser, args.only)
    # removed however the run ends: a crash inside it, a refusal, Ctrl-C
    with tempfile.TemporaryDirectory(prefix="tessera-faults-", ignore_cleanup_errors=True) as work:
        return _inject_and_measure(parser, args, only, Path(work))


def _inject_and_measure(parser: argparse.ArgumentParser, args: argparse.Namespace, only: list[str], work: Path) -> int:
    """The chosen faults and recoveries in `work`, their tables; 1 if any failed."""
    no_tmpfs = _tmpfs_unavailable(work)
    chosen = [fault for fault in faults(random.Random(args.seed), args.steps, tmpfs=no_tmpfs is None)
              if any(part in fault.name for part in only)]
    recoveries = [r for r in recovery.RECOVERIES if any(part in r.name for part in only)]
    if not chosen and not recoveries:  # tmpfs faults alone, and no tmpfs here
        parser.error(f"--only {args.only!r} matches only faults on a real tmpfs, which cannot be mounted here ({no_tmpfs})")
    rows, references = [], {}
    for fault in chosen:
        if fault.layout not in references:  # the uninterrupted run of this layout
            references[fault.layout] = Run(work / f"reference-{fault.layout}", args.steps, LAYOUTS[fault.layout])
            references[fault.layout].finish()
        rows.append(_fault(fault, args.steps, work, references[fault.layout]))
    if chosen:
        print(f"{'fault':32} {'survived':>8} {'steps lost':>10} {'data lost':>9} {'loss diff':>9} {'weight diff':>11}  "
              "faulty run ended")
        for row in rows:
            print(f"{row['fault']:32} {str(row['survived']):>8} {_cell(row['steps lost']):>10} {row['data lost']:>9} "
                  f"{_cell(row['loss diff']):>9} {_cell(row['weight diff']):>11}  {row['ended'][:90]}")
        print(f"{len(rows)} faults injected, {sum(row['survived'] for row in rows)} survived, "
              f"{sum(row['data lost'] for row in rows)} checkpoints lost")
        for line in (line for row in rows for line in row.get("why", [])):
            print(line.replace(str(work), "<work>"))
        if no_tmpfs is not None:
            print(f"disk faults on a real tmpfs skipped ({no_tmpfs}): a file-size limit stands in for a full disk")
    recovered = [recovery.measure(r, work) for r in recoveries]  # a killed rank: torchft against a restart
    if recovered:
        print(recovery.table(recovered))
    bad = [row for row in rows if not row["survived"] or row["data lost"]
           or (row["resumes"] and (row["loss diff"] != 0 or row["weight diff"] != 0))]
    bad += [row for row in recovered if not row["survived"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
