"""compare: loss (and any other logged scalar) of several runs side by side, as a PNG and a table.

  compare RUN_A RUN_B [...] [--scalar loss --scalar grad_norm] [--out compare.png] [--names a,b]

A RUN is a run's job.dump_folder, its TensorBoard folder, or one TensorBoard run folder; a
folder holding several TensorBoard runs (one per start, `tb/<time stamp>`) reads the newest, and
says so. Where a RUN holds no TensorBoard events, its W&B runs (`wandb/offline-run-…` or
`run-…`, metrics.enable_wandb's) are read alike. Scalars are read by their tag, Tessera's or torchtitan's (`loss` or
`loss_metrics/global_avg_loss`, tools' README), so torchtitan's runs compare with Tessera's. The
PNG draws each scalar against the step and, where the runs log tokens seen, against tokens; the
table prints each run's last and lowest value and, against the first run at the steps both
logged, the largest and the mean absolute difference. Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from tessera.trainer.metrics import TORCHTITAN_TAGS
from tessera.trainer.wandb_logger import read_run

TOKENS = "tokens_seen"


class CompareError(Exception):
    """Bad input: one line naming the culprit."""


def run_scalars(run: Path) -> dict[str, dict[int, float]]:
    """The scalars of `run` (see the module docstring): its newest TensorBoard run's or, where it has
    none, its newest W&B run's."""
    if not run.exists():
        raise CompareError(f"{run}: no such run folder")
    events = {path.parent for path in run.rglob("events.out.tfevents.*")}
    if events:
        return read_scalars(_newest(run, events, "TensorBoard"))
    logs = {path.parent for path in run.rglob("run-*.wandb")}
    if not logs:
        raise CompareError(f"{run}: no TensorBoard event files or W&B runs below it "
                           "(was metrics.enable_tensorboard or metrics.enable_wandb on?)")
    try:
        return read_run(_newest(run, logs, "W&B"))
    except ValueError as e:  # a damaged log
        raise CompareError(str(e)) from None


def _newest(run: Path, folders: set[Path], kind: str) -> Path:
    """The last written of `folders` below `run`; prints which, when it chose."""
    ordered = sorted(folders, key=lambda folder: max(p.stat().st_mtime for p in folder.iterdir()))
    if len(ordered) > 1:
        print(f"{run}: {len(ordered)} {kind} runs below it; reading the newest, {ordered[-1]}")
    return ordered[-1]


def read_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every scalar in a TensorBoard run folder (the last value where a
    step was logged twice, as after a resume)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def series(scalars: dict[str, dict[int, float]], name: str) -> dict[int, float] | None:
    """A scalar by Tessera's name or, in a torchtitan run, by the tag torchtitan gives it."""
    return scalars.get(name) or scalars.get(TORCHTITAN_TAGS.get(name, ""))


def table(names: list[str], runs: list[dict], scalar: str) -> list[str]:
    """One row per run: last and lowest value, and the differences from the first run."""
    rows = [f"{scalar}:", f"  {'run':20} {'steps':>6} {'last':>12} {'lowest':>12} {'max |diff|':>12} {'mean |diff|':>12}"]
    reference = series(runs[0], scalar)
    for name, scalars in zip(names, runs):
        values = series(scalars, scalar)
        steps = sorted(values)
        shared = sorted(set(values) & set(reference))
        diffs = [abs(values[s] - reference[s]) for s in shared]
        max_diff, mean_diff = (f"{max(diffs):12.6g}", f"{sum(diffs) / len(diffs):12.6g}") if diffs else (f"{'-':>12}",) * 2
        rows.append(f"  {name:20} {len(steps):6d} {values[steps[-1]]:12.6g} {min(values.values()):12.6g} {max_diff} {mean_diff}")
    return rows


def check_out(out: Path) -> None:
    """Refuses an --out whose suffix names no format matplotlib writes (it would fail, or append
    .png, only after every run was read), or one it cannot write here."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    kind = out.suffix[1:].lower()
    if kind not in formats:
        raise CompareError(f"--out {out}: its suffix must name an image format, one of "
                           f"{', '.join('.' + name for name in sorted(formats))}")
    _check_writable(out, kind, formats[kind])


def _check_writable(out: Path, kind: str, name: str) -> None:
    """Writes a figure with text as `kind` into memory: a format whose backend runs a program that
    is missing (.pgf: a TeX one) fails here, not with a traceback and a partial file after every
    run was read."""
    from matplotlib.figure import Figure

    probe = Figure(figsize=(1, 1))
    probe.text(0.5, 0.5, "probe")  # text is what those programs typeset
    try:
        probe.savefig(io.BytesIO(), format=kind)
    except (RuntimeError, OSError) as e:  # matplotlib's errors for a missing or failing program
        why = str(e).strip().partition("\n")[0] or type(e).__name__  # a TeX error holds its whole log
        raise CompareError(f"--out {out}: matplotlib cannot write {name} here: {why}") from None


def plot(names: list[str], runs: list[dict], scalars: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    by_tokens = all(series(run, TOKENS) for run in runs)
    columns = 2 if by_tokens else 1
    figure, axes = plt.subplots(len(scalars), columns, figsize=(6 * columns, 3.5 * len(scalars)), squeeze=False)
    for row, scalar in enumerate(scalars):
        for name, run in zip(names, runs):
            values = series(run, scalar)
            steps = sorted(values)
            axes[row][0].plot(steps, [values[s] for s in steps], label=name)
            if by_tokens:
                tokens = series(run, TOKENS)
                shared = [s for s in steps if s in tokens]
                axes[row][1].plot([tokens[s] for s in shared], [values[s] for s in shared], label=name)
        for column, x in enumerate(["step", "tokens"][:columns]):
            axes[row][column].set(xlabel=x, ylabel=scalar)
            axes[row][column].grid(alpha=0.3)
            axes[row][column].legend()
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="runs' dump, TensorBoard or W&B run folders")
    parser.add_argument("--scalar", action="append", help="a logged scalar to compare (repeatable; default: loss)")
    parser.add_argument("--out", type=Path, default=Path("compare.png"), help="the image to write; its suffix gives the format (.png, .pdf, .svg, ...)")
    parser.add_argument("--names", help="comma-separated names of the runs in the legend (default: the folders' names)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        scalars = args.scalar or ["loss"]
        names = args.names.split(",") if args.names else [run.name or str(run) for run in args.runs]
        if len(names) != len(args.runs):
            raise CompareError(f"--names gives {len(names)} names for {len(args.runs)} runs")
        check_out(args.out)
        runs = [run_scalars(run) for run in args.runs]
        for run, scalars_of_run in zip(args.runs, runs):
            for scalar in scalars:
                if not series(scalars_of_run, scalar):
                    raise CompareError(f"{run}: no scalar {scalar!r} (it logs {', '.join(sorted(scalars_of_run))})")
        for scalar in scalars:
            print("\n".join(table(names, runs, scalar)))
        plot(names, runs, scalars, args.out)
        print(f"wrote {args.out}")
    except (CompareError, OSError) as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
