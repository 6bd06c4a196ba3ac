"""A rank killed mid-run, recovered two ways side by side (issue 30): torchft's replica groups,
where the other group trains on and the killed one restarts and recovers live from it (per-step
gradient averaging, and DiLoCo), against a checkpoint restart (`--max_restarts`, torchrun
restarting every rank, which resumes from the newest checkpoint).

Each recovery runs a job of two data-parallel ranks (torchft: two replica groups of one rank)
twice: uninterrupted, and with rank 1 killed before step KILL_AT (the [debug] crash switch: the
process exits at once). Measured per recovery: steps lost (trained again after a restart, or
attempts that did not count and were retried), steps a group sat out (torchft: the steps the
survivor trained alone), the wall seconds the fault cost (the faulty run's wall time less the
uninterrupted one's) and the final weights (torchft: the two groups' digests equal; restart:
equal to the uninterrupted run's). torchft notices a dead group when its heartbeats stop
(torchft's default: 5 s; TESSERA_LIGHTHOUSE_ARGS="--heartbeat_timeout_ms N" changes it).
A recovery that failed is followed by why and the last lines of its faulty run's log.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from pathlib import Path

STEPS, KILL_AT, INTERVAL = 60, 14, 8
TAIL = 40  # lines of a failed recovery's log printed under the table
TWO_GROUPS = ["--nproc", "2", "--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2"]


@dataclasses.dataclass
class Recovery:
    name: str
    extra: list[str]  # the layout and the recovery, both runs
    torchft: bool


RECOVERIES = [
    Recovery("kill-rank-torchft-per-step", TWO_GROUPS, True),
    Recovery("kill-rank-torchft-diloco", [*TWO_GROUPS, "--fault_tolerance.semi_sync_method", "diloco",
                                          "--fault_tolerance.sync_steps", "4"], True),
    Recovery("kill-rank-restart", ["--nproc", "2", "--max_restarts", "1"], False),
]


def _run(dump: Path, extra: list[str], tag: str):
    """One trainer command to its end: the Run, its exit status (-1: orphans) and wall seconds."""
    from faults import Run  # the fault suite's runs, as every fault's

    started = time.perf_counter()
    run = Run(dump, STEPS, extra, tag=tag)
    code = run.finish(timeout=900)
    return run, code, time.perf_counter() - started


def measure(recovery: Recovery, work: Path) -> dict:
    from faults import _weights_difference

    common = [*recovery.extra, "--checkpoint.interval", str(INTERVAL)]
    reference, _, reference_wall = _run(work / f"{recovery.name}-reference", common, "reference")
    faulty, code, wall = _run(work / recovery.name,
                              [*common, "--debug.fault_at_step", str(KILL_AT), "--debug.fault_rank", "1"], "faulty")
    log = faulty.log.read_text()
    row = {"recovery": recovery.name, "wall lost": wall - reference_wall}
    # what failed, by what it says; the fault fires on a first attempt only: a rank that restarted
    # before step KILL_AT (it failed to start) never crashes
    failed = {f"rank 1 never reached step {KILL_AT} on its first attempt": "debug: injected fault" not in log,
              f"exit status {code}": code != 0}
    if recovery.torchft:
        recovered = re.findall(r"^\[replica 1\] fault tolerance: replica group 1 recovered live from replica group 0 at "
                               r"step (\d+)", log, re.M)
        # back after the other group finished: its final checkpoint
        late = re.findall(r"^\[replica 1\] checkpoint: loaded .*step-(\d+);", log, re.M)[-1:] if not recovered else []
        digests = dict(re.findall(r"replica group (\d) ends at step \d+, weights sha256 (\w+)$", log, re.M))
        weights = ("groups equal" if len(set(digests.values())) == 1 else "groups differ") if len(digests) == 2 else \
            f"only group(s) {', '.join(sorted(digests)) or 'none'} ended"
        survivor = [int(s) for s in re.findall(r"^\[replica 0\] step +(\d+)/", log, re.M)]
        failed.update({"no line of group 1 recovering (live, or from the final checkpoint)": len(recovered + late) != 1,
                       f"final weights: {weights}": weights != "groups equal",
                       f"group 0 trained steps {survivor}": survivor != list(range(1, STEPS + 1))})
        row.update(recovered=f"live, step {recovered[0]}" if recovered else f"disk, step {late[0]}" if late else "-",
                   lost=len(re.findall(r"^\[replica 0\] fault tolerance: .* did not count", log, re.M)),
                   sat_out=int(recovered[0]) - KILL_AT + 1 if recovered else STEPS - KILL_AT + 1,
                   weights=weights)
    else:
        steps = [int(s) for s in re.findall(r"^step +(\d+)/", log, re.M)]
        resumed = re.findall(r"^checkpoint: loaded .*step-(\d+);", log, re.M)
        final = faulty.dump / "checkpoint" / f"step-{STEPS}"
        difference = (_weights_difference(final, reference.dump / "checkpoint" / f"step-{STEPS}")
                      if (final / ".metadata").is_file() else float("nan"))
        differs = "no final checkpoint" if math.isnan(difference) else f"final weights differ by {difference:.2g}"
        failed[differs] = difference != 0
        row.update(recovered=f"disk, step {resumed[0]}" if resumed else "-",
                   lost=len(steps) - len(set(steps)), sat_out=0,
                   weights="= uninterrupted" if difference == 0 else differs.removeprefix("final weights "))
    why = [what for what, bad in failed.items() if bad]
    row.update(survived=not why, why=why, tail=log.splitlines()[-TAIL:])
    return row


def table(rows: list[dict]) -> str:
    heartbeat = os.environ.get("TESSERA_LIGHTHOUSE_ARGS") or "torchft's default heartbeat timeout, 5 s"
    lines = [f"rank 1 killed before step {KILL_AT} of {STEPS}, two data-parallel ranks, checkpoints every {INTERVAL} steps "
             f"({heartbeat}):",
             f"{'recovery':26} {'survived':>8} {'recovered':>15} {'steps lost':>10} {'steps a group sat out':>21} "
             f"{'wall s lost':>11}  final weights"]
    for row in rows:
        lines.append(f"{row['recovery']:26} {str(row['survived']):>8} {row['recovered']:>15} {row['lost']:>10} "
                     f"{row['sat_out']:>21} {row['wall lost']:>11.1f}  {row['weights']}")
    for row in rows:  # what a failed recovery's log said, for a failure seen once (in CI) to be read
        if not row["survived"]:
            lines += [f"{row['recovery']} failed: {'; '.join(row['why'])}; the faulty run's last {len(row['tail'])} lines:",
                      *(f"  {line}" for line in row["tail"])]
    return "\n".join(lines)
