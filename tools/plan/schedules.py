"""Pipeline schedules as data: the stages per rank (v) each can run and the idle time (bubble) it
leaves per step, from the papers' formulas (README.md, "Pipeline schedules").

`idle(pp, v, f, b, w)` takes one micro-batch's seconds on a rank, all its local stages together:
f forward, b input-gradient backward (AC recompute included), w weight-gradient backward.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from tessera import pp as tessera_pp


def _flush(pp: int, v: int, f: float, b: float, w: float) -> float:
    """GPipe, 1F1B (Huang et al. 2019; Narayanan et al. 2021): pp - 1 micro-batch slots of one
    stage idle; interleaving v stages per rank makes each slot v times shorter."""
    return (pp - 1) * (f + b + w) / v


def _zero_bubble_h1(pp: int, v: int, f: float, b: float, w: float) -> float:
    """ZB-H1 (Qi et al. 2024, arXiv 2401.10241 §2.1): (pp - 1)(T_F + T_B - T_W) per stage; the
    weight-gradient passes fill the rest. Per chunk of an interleaved rank: / v."""
    return (pp - 1) * max(0.0, f + b - w) / v


def _zero_bubble_v(pp: int, v: int, f: float, b: float, w: float) -> float:
    """ZB-V (ibid. §6): 1F1B's memory, and zero bubble when T_F = T_B = T_W; we take ZB-H2's
    (pp - 1)(T_F + T_B - 2·T_W) (ibid. §2.2) over its chunks (half a rank's layers, / v), which is
    that zero at equal times and grows as backward outweighs the weight gradients (AC recompute,
    attention)."""
    return (pp - 1) * max(0.0, f + b - 2 * w) / v


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str  # as tessera.pp (and the trainer's pipeline_parallel_schedule) spells it
    stages_per_rank: tuple[int, ...]  # the v the planner tries
    idle: Callable[[int, int, float, float, float], float]


SCHEDULES = {s.name: s for s in (
    Schedule("GPipe", (1,), _flush),
    Schedule("1F1B", (1,), _flush),
    Schedule("Interleaved1F1B", (2, 4), _flush),
    Schedule("InterleavedZeroBubble", (2, 4), _zero_bubble_h1),
    Schedule("ZBVZeroBubble", (2,), _zero_bubble_v),
)}


def layers_per_stage(schedule: str, pp: int, v: int, n_layers: int) -> int | None | bool:
    """The trainer's pipeline_parallel_layers_per_stage giving `v` stages per rank: None where its
    default count does (pp stages, 2·pp for multi-stage schedules), False where no value does
    (tessera.pp.stage_count, the trainer's own rule, decides; the embedding and the head weigh one
    block each, the trainer's default)."""
    if v == (1 if tessera_pp.is_single_stage(schedule) else 2):
        return None
    per_stage = math.ceil((n_layers + 2) / (pp * v))
    try:
        stages = tessera_pp.stage_count(pp, schedule, n_layers, layers_per_stage=per_stage)
    except ValueError:
        return False
    return per_stage if stages == pp * v else False
