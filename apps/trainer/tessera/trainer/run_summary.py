"""The line a run ends with: what it did (steps, tokens, wall time), where the loss ended and how
low it got, and the checkpoint it leaves to resume from, so a log's last line answers "did it
work" without scrolling back."""

from __future__ import annotations

from pathlib import Path


def run_summary(history: list[dict], steps_run: int, tokens_per_step: int, wall_s: float, checkpoint: Path | None) -> str:
    """history: the logged steps' metrics (train.py's `log`, with validation entries beside)."""
    losses = [(entry["loss"], entry["step"]) for entry in history if "loss" in entry]
    parts = [f"run done: {steps_run} steps, {steps_run * tokens_per_step:,} tokens in {wall_s:.1f} s"]
    if losses:
        best, at = min(losses)
        parts.append(f"final loss {losses[-1][0]:.4f}, best {best:.4f} (step {at})")
    validated = [entry["validation_loss"] for entry in history if "validation_loss" in entry]
    if validated:
        parts.append(f"last validation loss {validated[-1]:.4f}")
    parts.append(f"checkpoint {checkpoint}" if checkpoint else "no checkpoint written")
    return "; ".join(parts)
