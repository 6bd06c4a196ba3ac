"""Checkpoint folder layout: ``<folder>/step-<N>/`` complete, ``.step-<N>.tmp`` in progress,
``step-<N>-model`` (and the trainer's ``step-<N>-hf``) final exports beside the full checkpoint.

A step folder only ever appears by renaming a fully written tmp folder, so any ``step-<N>``
holding a ``.metadata`` file is complete; everything starting with "." is ignored by loading.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from tessera.ckpt.dcp_io import METADATA_FILE

# the names step_folder writes: "step-04" or non-ASCII digits would read as another step's number
_STEP = re.compile(r"step-(0|[1-9][0-9]*)")


def step_folder(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def export_folder(folder: Path, step: int) -> Path:
    """Where the final model-only export goes, beside the full ``step-<N>`` (never loaded to resume)."""
    return folder / f"step-{step}-model"


def hf_export_folder(folder: Path, step: int) -> Path:
    """Where a trainer's Hugging Face export of step ``step`` goes (``export_hf``'s destination)."""
    return folder / f"step-{step}-hf"


def is_complete(path: Path) -> bool:
    return (path / METADATA_FILE).is_file()


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint in ``folder``, ascending."""
    return _steps(folder, complete=True)


def incomplete_steps(folder: Path) -> list[int]:
    """Steps whose ``step-<N>`` lacks its ``.metadata`` (damaged after publishing, or a copy cut
    short), ascending: never loaded, never deleted."""
    return _steps(folder, complete=False)


def _steps(folder: Path, complete: bool) -> list[int]:
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        match = _STEP.fullmatch(entry.name)
        if match and entry.is_dir() and is_complete(entry) == complete:
            steps.append(int(match.group(1)))
    return sorted(steps)


def fsync_path(path: Path) -> None:
    """Makes a file's data, or a folder's entries (new files, renames), durable: without it a
    power loss may leave a published name pointing at an empty file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Atomically turns a fully written tmp folder (its files already fsynced) into its final
    name; its entries are synced first, so the rename cannot outlive them in a power loss."""
    fsync_path(tmp)
    os.rename(tmp, final)
    fsync_path(final.parent)


def remove_stale_tmp(folder: Path) -> None:
    """Deletes leftovers of saves or deletions that crashed (``.step-*`` folders)."""
    if folder.is_dir():
        for entry in folder.iterdir():
            if entry.name.startswith(".step-") and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)


def remove_step(folder: Path, step: int) -> None:
    discard(step_folder(folder, step))


def discard(path: Path) -> None:
    """Hides the folder first, so a crash mid-delete leaves no half-deleted ``step-<N>``."""
    doomed = path.parent / f".{path.name}.deleting"
    os.rename(path, doomed)
    fsync_path(path.parent)
    shutil.rmtree(doomed)


def set_aside(path: Path, why: str = "incomplete") -> Path:
    """Renames ``step-<N>`` to ``step-<N>.<why>`` (``-2``, ``-3``... if taken): out of what loading
    and retention see, so a save of that step can go ahead, with the files kept for whoever
    wants to look (``incomplete``: damaged; ``superseded``: of a timeline a resume left)."""
    target, n = path.with_name(f"{path.name}.{why}"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{why}-{n}")
    os.rename(path, target)
    fsync_path(path.parent)
    return target


LOCK_FILE = ".lock"


class FolderInUse(OSError):
    """Another process holds the folder's lock; ``holder`` says which, as it wrote itself down."""

    def __init__(self, folder: Path, holder: str) -> None:
        super().__init__(f"{folder} is in use by {holder}")
        self.holder = holder


def claim(folder: Path) -> IO | None:
    """Locks ``folder`` (made if need be) for this process until the returned file is closed or
    the process ends, by any death: an flock on ``<folder>/.lock``, which then names its holder.
    FolderInUse if another process (or another claim of this one) holds it; None where the
    filesystem gives no locks, so nothing is claimed. (NFS's locks are the server's: a crashed
    node's lasts until its lease ends, a minute or two. Lustre's ``localflock`` and similar keep
    locks within one node.)"""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    # Held open read-only where the filesystem allows: one open for writing keeps it from being
    # remounted read-only. NFS takes an exclusive flock only on a file open for writing (EBADF).
    for mode in (os.O_RDONLY, os.O_RDWR):
        try:
            lock = os.fdopen(os.open(path, mode | os.O_CREAT, 0o644), "r" if mode == os.O_RDONLY else "r+")
        except PermissionError:  # another user's lock file, not writable by this one
            return None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = lock.read().strip() or "another process"
            lock.close()
            raise FolderInUse(folder, holder) from None
        except OSError as e:
            lock.close()
            if e.errno != errno.EBADF or mode == os.O_RDWR:  # ENOLCK, EOPNOTSUPP: no locks here
                return None
    try:  # who holds it, for the next one's message; the lock stands without it (another user's file)
        path.write_text(f"process {os.getpid()} on {socket.gethostname()}\n")
    except OSError:
        pass
    return lock


def check_writable(folder: Path, size: int) -> None:
    """Writes and deletes ``size`` bytes in ``folder``: raises the OSError a checkpoint write
    would meet there (read-only, no permission, full disk). Folders it has to make are removed
    again, so a check leaves no trace. Processes may check one folder at once (fault tolerance's
    replica groups start together): a folder another check removed meanwhile is made again, and
    one still holding another's probe is left to that check."""
    made = [path for path in (folder, *folder.parents) if not path.exists()]
    try:
        fd, name = _probe_file(folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(bytes(size))
                f.flush()
                os.fsync(f.fileno())
        finally:
            os.unlink(name)
    finally:
        for path in made:  # innermost first
            try:
                path.rmdir()
            except FileNotFoundError:  # never made (the check failed first), or removed by another check
                continue
            except OSError:  # holding another check's probe or another process's files, or no folder at all
                break  # (its parent a file): it and its parents stay, and the check's own error is raised


def _probe_file(folder: Path, attempts: int = 16) -> tuple[int, str]:
    """A new file in ``folder``, made with its parents; made again while other processes' checks,
    each removing the folder once, take it away between the two."""
    failed = 0
    while True:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return tempfile.mkstemp(prefix=".probe-", dir=folder)
        except (FileNotFoundError, FileExistsError):  # FileExistsError: mkdir found it, then it was gone
            failed += 1
            if failed == attempts:  # a file where a folder should be: the same error every time
                raise


ExtraFiles = Mapping[str, bytes | os.PathLike]  # file name -> its content, or a file to copy


def check_extra_files(files: ExtraFiles) -> None:
    """Names of files to put beside a checkpoint's own: plain names, not hidden ones (DCP's
    ``.metadata``, tmp folders)."""
    for name, content in files.items():
        if not name or Path(name).name != name or name.startswith("."):
            raise ValueError(f"extra checkpoint file name {name!r} must be a plain file name not starting with '.'")
        if not isinstance(content, (bytes, os.PathLike)):
            raise ValueError(f"extra checkpoint file {name!r}: {type(content).__name__} is neither bytes nor a path")


def write_extra_files(folder: Path, files: ExtraFiles) -> None:
    """Writes ``files`` into ``folder`` (bytes as given, paths copied), fsynced like DCP's own
    files, before it is published."""
    for name, content in files.items():
        target = folder / name
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            shutil.copyfile(content, target)
        fsync_path(target)
