"""Checkpoint folder layout: ``<folder>/step-<N>/`` complete, ``.step-<N>.tmp`` in progress.

A step folder only ever appears by renaming a fully written tmp folder, so any ``step-<N>``
holding a ``.metadata`` file is complete; everything starting with "." is ignored by loading.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from tessera.ckpt.dcp_io import METADATA_FILE

_STEP = re.compile(r"step-(\d+)")


def step_folder(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def tmp_folder(folder: Path, step: int) -> Path:
    return folder / f".step-{step}.tmp"


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint in ``folder``, ascending."""
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        match = _STEP.fullmatch(entry.name)
        if match and (entry / METADATA_FILE).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def fsync_dir(path: Path) -> None:
    """Makes a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Atomically turns a fully written tmp folder into its final name."""
    os.rename(tmp, final)
    fsync_dir(final.parent)


def remove_stale_tmp(folder: Path) -> None:
    """Deletes leftovers of saves or deletions that crashed (``.step-*`` folders)."""
    if folder.is_dir():
        for entry in folder.iterdir():
            if entry.name.startswith(".step-") and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)


def remove_step(folder: Path, step: int) -> None:
    """Hides the step folder first, so a crash mid-delete leaves no half-deleted ``step-<N>``."""
    doomed = folder / f".step-{step}.deleting"
    os.rename(step_folder(folder, step), doomed)
    fsync_dir(folder)
    shutil.rmtree(doomed)
