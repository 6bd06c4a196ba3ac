"""Where one training step goes: a torch.profiler chrome trace (CPU ops) split into matmuls,
attention, norms, RoPE, SwiGLU, residual adds, the MoE layer's routing, permutation and routed
experts, embedding, loss, clipping, optimizer, casts and the framework's own time (Python between
ops: hooks, the loop, data).

The trace comes from the trainer's own profiling (`profiling.enable_profiling`), Tessera's or
torchtitan's, so both are split by one rule:

1. an op inside ``Optimizer.step`` / ``Optimizer.zero_grad`` is optimizer time; a collective
   is comms;
2. else an op inside a region of a whole part of the MoE layer (``INCLUSIVE``: the router, the
   routed experts, the layer itself, whose own ops are its permutations) takes that part, its
   matmuls included, unless a region of another kind lies closer around it (the shared experts'
   feed-forward inside the layer);
3. else the outermost op whose name says what it is decides (``aten::linear`` and ``mm``:
   matmul; ``scaled_dot_product_attention``: attention; ``rms_norm``: norms; ...);
4. else the innermost region that `annotate` opened around a model function (the RoPE
   function, the feed-forward, the block's residual, the loss, the clipping) decides;
5. else casts and copies, or "other ops".

A backward node takes the category of the forward op that recorded it (the trace's
forward-backward links), so a norm's backward counts as norm time. "framework" is Python: the
step's wall time outside any op (module calls, hooks, the loop, data), annotations' own time
included. The profiler's per-op cost inflates small
ops, so the split is a guide to where time goes, not a throughput figure.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

CATEGORIES = ("matmul", "attention", "norms", "rope", "swiglu", "residual", "routing", "permutation", "experts",
              "embedding", "loss", "grad clip", "optimizer", "comms", "casts/copies", "other ops", "framework")
# regions that take every op inside them, matmuls too: the MoE layer's parts
INCLUSIVE = ("routing", "permutation", "experts")
_COMMS = ("c10d::", "record_param_comms", "all_gather", "reduce_scatter", "all_reduce", "allreduce", "all_to_all",
          "alltoall")

# (substring of an op or autograd-node name, category), first match wins
_OP_RULES = (
    ("scaled_dot_product", "attention"), ("ScaledDotProduct", "attention"),
    ("aten::linear", "matmul"), ("aten::matmul", "matmul"), ("aten::mm", "matmul"), ("aten::addmm", "matmul"),
    ("aten::bmm", "matmul"), ("MmBackward", "matmul"), ("AddmmBackward", "matmul"), ("BmmBackward", "matmul"),
    ("rms_norm", "norms"), ("RmsNorm", "norms"), ("RMSNorm", "norms"), ("layer_norm", "norms"),
    ("cross_entropy", "loss"), ("log_softmax", "loss"), ("nll_loss", "loss"), ("LogSoftmax", "loss"), ("NllLoss", "loss"),
    ("aten::embedding", "embedding"), ("EmbeddingBackward", "embedding"),
    ("_foreach_norm", "grad clip"), ("linalg_vector_norm", "grad clip"),
    ("_fused_adam", "optimizer"),
    *((needle, "comms") for needle in _COMMS),
)
_CASTS = ("aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous", "ToCopyBackward",
          "CloneBackward")
_PHASES = ("Optimizer.step", "Optimizer.zero_grad")
REGION_PREFIX = "split:"


def _by_name(name: str) -> str | None:
    for needle, category in _OP_RULES:
        if needle in name:
            return category
    return None


def _step_events(trace: dict) -> tuple[list[dict], dict]:
    """The ops and annotations of the (last) profiled step, and that step's event."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("trace holds no ProfilerStep: not a torch.profiler trace with a schedule")
    step = max(steps, key=lambda e: e["ts"])
    end = step["ts"] + step["dur"]
    inside = [e for e in events if e is not step and e["tid"] == step["tid"] and step["ts"] <= e["ts"] < end]
    inside.sort(key=lambda e: (e["ts"], -e["dur"]))
    return inside, step


def _parents(events: list[dict]) -> list[int | None]:
    parents, stack = [], []
    for i, e in enumerate(events):
        while stack and events[stack[-1]]["ts"] + events[stack[-1]]["dur"] <= e["ts"]:
            stack.pop()
        parents.append(stack[-1] if stack else None)
        stack.append(i)
    return parents


def split(trace_path: str | Path) -> dict[str, float]:
    """Milliseconds of the last profiled step per category (`CATEGORIES`; they sum to the step)."""
    trace = json.loads(Path(trace_path).read_text())
    events, step = _step_events(trace)
    parents = _parents(events)

    def ancestry(i: int | None) -> Iterator[int]:
        while i is not None:
            yield i
            i = parents[i]

    # forward op <-> backward node: the flow events share an id; a flow starts where its op starts
    starts = sorted((e["ts"], i) for i, e in enumerate(events))
    start_ts = [ts for ts, _ in starts]
    flows = defaultdict(dict)
    for e in trace["traceEvents"]:
        if e.get("cat") == "fwdbwd" and e.get("ph") in ("s", "f") and e.get("tid") == step["tid"]:
            k = bisect.bisect_left(start_ts, e["ts"] - 1e-3)
            same = [i for ts, i in starts[k:k + 64] if abs(ts - e["ts"]) < 1e-3]
            if same:  # the innermost op starting there: the one autograd recorded
                flows[e["id"]][e["ph"]] = max(same, key=lambda i: sum(1 for _ in ancestry(i)))
    forward_of = {}
    for pair in flows.values():
        if "s" in pair and "f" in pair:
            forward_of[pair["f"]] = pair["s"]
            # the engine's own work for the node (summing gradients, reducing broadcasts) runs
            # beside the node, inside its evaluate_function event
            if parents[pair["f"]] is not None and events[parents[pair["f"]]]["name"].startswith("autograd::engine"):
                forward_of[parents[pair["f"]]] = pair["s"]

    @functools.lru_cache(maxsize=None)
    def category(i: int) -> str:
        chain = list(ancestry(i))
        names = [events[j]["name"] for j in chain]
        if any(name.startswith(_PHASES) for name in names):
            return "optimizer"
        if any(needle in names[0] for needle in _COMMS):
            return "comms"
        if i not in forward_of:
            for name in names:  # innermost region first: a whole MoE part, unless another kind is closer
                if name.startswith(REGION_PREFIX):
                    if name[len(REGION_PREFIX):] in INCLUSIVE:
                        return name[len(REGION_PREFIX):]
                    break
        for j in reversed(chain):  # outermost first
            if j in forward_of:  # a backward node: what its forward op was
                return category(forward_of[j])
            found = _by_name(events[j]["name"])
            if found:
                return found
        for name in names:  # innermost region first
            if name.startswith(REGION_PREFIX):
                return name[len(REGION_PREFIX):]
        return "casts/copies" if any(name.startswith(_CASTS) for name in names) else "other ops"

    totals = dict.fromkeys(CATEGORIES, 0.0)
    child_time = defaultdict(float)
    for i, parent in enumerate(parents):
        if parent is not None:
            child_time[parent] += events[i]["dur"]
    for i, e in enumerate(events):
        own = max(e["dur"] - child_time[i], 0.0)
        if e.get("cat") == "cpu_op":
            totals[category(i)] += own
        else:  # an annotation's own time is Python: the optimizer's, or the framework's
            totals["optimizer" if category(i) == "optimizer" else "framework"] += own
    totals["framework"] += step["dur"] - sum(e["dur"] for e, parent in zip(events, parents) if parent is None)
    return {name: us / 1e3 for name, us in totals.items()}


@contextlib.contextmanager
def annotate(targets: dict[str, tuple[object, str]]) -> Iterator[None]:
    """Wraps ``getattr(owner, attribute)`` in a profiler region named ``split:<category>`` for
    each ``category: (owner, attribute)``, restoring them on exit. Owners are modules (for
    functions looked up at call time) or classes (for methods)."""
    saved = []
    try:
        for category, (owner, attribute) in targets.items():
            original = getattr(owner, attribute)
            saved.append((owner, attribute, original))

            def wrapped(*args, __original=original, __name=REGION_PREFIX + category, **kwargs):
                with torch.profiler.record_function(__name):
                    return __original(*args, **kwargs)

            setattr(owner, attribute, functools.wraps(original)(wrapped))
        yield
    finally:
        for owner, attribute, original in reversed(saved):
            setattr(owner, attribute, original)


def format_table(columns: dict[str, dict[str, float]]) -> str:
    """One row per category: ms and share of the step for each column (a run)."""
    names = list(columns)
    head = f"{'category':14}" + "".join(f"{name:>24}" for name in names)
    lines = [head, "-" * len(head)]
    for cat in CATEGORIES:
        cells = "".join(f"{columns[n][cat]:>14.1f} ms {100 * columns[n][cat] / sum(columns[n].values()):>5.1f}%" for n in names)
        lines.append(f"{cat:14}{cells}")
    lines.append(f"{'step':14}" + "".join(f"{sum(columns[n].values()):>14.1f} ms {100.0:>5.1f}%" for n in names))
    return "\n".join(lines)
