"""CheckpointManager: periodic, atomic, optionally asynchronous DCP checkpoints of a training run."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from tessera.ckpt.dcp_io import (
    METADATA_FILE, check_storage_files, load_into, raise_first_failure, read_metadata, save_state_dict,
)
from tessera.ckpt.folders import (
    ExtraFiles, FolderInUse, check_extra_files, check_writable, claim, complete_steps, export_folder, hf_export_folder,
    incomplete_steps, is_complete, publish, remove_stale_tmp, remove_step, set_aside, step_folder, write_extra_files,
)
from tessera.ckpt.states import ModelState, RankLocalState, Stateful

logger = logging.getLogger("tessera.ckpt")

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


class CheckpointManager:
    """Saves ``states`` to ``<folder>/step-<N>/`` every ``interval`` steps and loads them back.

    Construct it on every rank (it is collective, like every save/load call). ``states`` maps
    a name without "." (the top-level key in the checkpoint) to a Stateful object, typically
    ``{"model": ModelState(parts), "optimizer": OptimizerState(parts, optims),
    "dataloader": RankLocalState(loader, f"dp_rank_{r}"), "rng": rng_state(rank),
    "train": <object holding the step counter>}``.

    A state may list ``optional_keys``: keys of its state dict that older checkpoints lack;
    loading such a checkpoint leaves them out of the dict its ``load_state_dict`` receives.

    ``extra_files`` (name -> bytes, or a path to copy) go into every checkpoint folder written,
    beside DCP's files, before it is published: e.g. a record of the model's args, so a
    conversion tool needs no flags to rebuild the model.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        states: dict[str, Stateful],
        *,
        interval: int,
        async_mode: str = "disabled",
        keep_latest_k: int = 0,
        exclude_from_loading: tuple[str, ...] | list[str] = (),
        last_save_model_only: bool = False,
        export_dtype: str = "float32",
        process_group: dist.ProcessGroup | None = None,
        extra_files: ExtraFiles | None = None,
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"checkpoint interval must be a positive integer, got {interval!r}")
        if async_mode not in ASYNC_MODES:
            raise ValueError(f"checkpoint async_mode {async_mode!r} is not one of {list(ASYNC_MODES)}")
        if isinstance(keep_latest_k, bool) or not isinstance(keep_latest_k, int) or keep_latest_k < 0:
            raise ValueError(f"checkpoint keep_latest_k must be an integer >= 0, got {keep_latest_k!r}")
        if export_dtype not in EXPORT_DTYPES:
            raise ValueError(f"checkpoint export_dtype {export_dtype!r} is not one of {list(EXPORT_DTYPES)}")
        bad_names = [name for name in states if not name or "." in name]
        if bad_names:
            raise ValueError(f"checkpoint state name {bad_names[0]!r} must be non-empty and contain no '.'")
        unknown = sorted(set(exclude_from_loading) - set(states))
        if unknown:
            raise ValueError(f"exclude_from_loading names unknown state {unknown[0]!r}; states: {sorted(states)}")
        check_extra_files(extra_files or {})
        self._model_names = [name for name, state in states.items() if isinstance(state, ModelState)]
        if last_save_model_only and not self._model_names:
            raise ValueError("last_save_model_only needs a ModelState among the checkpoint states")

        self.folder = Path(folder)
        self.states = dict(states)
        self.interval = interval
        self.async_mode = async_mode
        self.keep_latest_k = keep_latest_k
        self.exclude_from_loading = frozenset(exclude_from_loading)
        self.last_save_model_only = last_save_model_only
        self.export_dtype = export_dtype
        self.process_group = process_group
        self.extra_files = dict(extra_files or {})

        self._distributed = dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank(process_group) if self._distributed else 0
        self._async_group = None
        self._stager = None
        self._pending: Future | None = None
        self._passed_over: list[int] | None = None  # set by load(), used up by the next write
        self._claim = None  # rank 0's lock of the folder (claim())
        self._committer: ThreadPoolExecutor | None = None
        if async_mode != "disabled":
            # Background saves get their own gloo group: sharing the training group's
            # collectives from another thread crashed and hung on CPU (shared notes).
            if self._distributed:
                ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
                self._async_group = dist.new_group(ranks=ranks, backend="gloo")
            self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-ckpt")
            if async_mode == "async_with_pinned_mem":
                if torch.cuda.is_available():
                    self._stager = DefaultStager(StagingOptions(
                        use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False,
                    ))
                else:
                    logger.info("checkpoint async_with_pinned_mem: no CUDA, staging in ordinary memory (same as 'async')")

    # ---- saving ----------------------------------------------------------------------------

    def due(self, step: int, last_step: bool = False) -> bool:
        """Whether ``maybe_save(step, last_step)`` writes anything."""
        return last_step or step % self.interval == 0

    def maybe_save(self, step: int, last_step: bool = False) -> None:
        """Saves when ``step`` is a multiple of ``interval`` or ``last_step``; after the last step,
        if ``last_save_model_only``, also the model-only export beside it (``export_model``): an
        export never replaces the full checkpoint that a longer run resumes from."""
        if self.due(step, last_step):
            self.save(step)
        if last_step and self.last_save_model_only:
            self.export_model(step)

    def save(self, step: int, model_only: bool = False) -> bool:
        """Writes ``step-<step>`` atomically; returns once written (sync) or staged (async), True,
        or False when the step's checkpoint was there already.

        A step that already has a complete checkpoint is not saved again, so the last good
        checkpoint is never overwritten; an incomplete ``step-<step>`` (no ``.metadata``: a copy
        cut short or damaged, never a save of ours in progress) is moved to ``step-<step>.incomplete``.
        The first save after ``load()`` first sets aside the newer checkpoints it passed over (see there).
        """
        return self._write(step_folder(self.folder, step), model_only)

    def export_model(self, step: int) -> bool:
        """The model states alone, cast to ``export_dtype``, in ``step-<step>-model``; False when
        that folder is already complete (it is kept as it is)."""
        return self._write(export_folder(self.folder, step), model_only=True)

    def check_writable(self) -> None:
        """Fails now, naming the folder and the OS error, if no checkpoint could be written
        (read-only or unwritable folder), rather than after the first interval of training.
        Collective: rank 0 checks and every rank raises its answer."""
        error = [None]
        if self._rank == 0:
            try:
                check_writable(self.folder, size=4096)
            except OSError as e:
                error[0] = self._unwritable(e)
        self._raise_rank0_error(error)

    def _unwritable(self, e: OSError) -> str:
        return f"checkpoint folder {self.folder} is not writable: {e.strerror or e}"

    def claim(self) -> None:
        """Collective: makes this manager the folder's one writer until close() or the process
        ends (a crash included). Another writer on it, in this run or another, raises OSError
        naming the holder: two writers share the in-progress names and retention, so their saves
        would mix into one "complete" checkpoint. Leftovers of saves that crashed (a full disk's
        partial folder holds its space) are removed then, which only the one writer may do. A
        filesystem without locks (some network mounts) leaves the folder unclaimed."""
        error = [None]
        if self._rank == 0 and self._claim is None:
            try:
                self._claim = claim(self.folder)
                if self._claim is None:
                    logger.warning("checkpoint folder %s could not be locked (no locks on this filesystem, or its "
                                   "lock file is another user's): nothing keeps a second run from writing it too",
                                   self.folder)
                else:  # only the one writer may: another's save in progress looks the same
                    remove_stale_tmp(self.folder)
            except FolderInUse as e:
                error[0] = (f"checkpoint folder {self.folder} is in use by {e.holder}: two runs writing one folder "
                            "would mix their checkpoints; wait for it to end or use another folder")
            except OSError as e:
                error[0] = self._unwritable(e)
        self._raise_rank0_error(error)

    def _raise_rank0_error(self, error: list) -> None:
        """Collective: rank 0's ``error[0]`` (a message, or None) reaches every rank, which raises
        it as an OSError, so no rank goes on into a collective the others have left."""
        if self._distributed:
            source = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
            dist.broadcast_object_list(error, src=source, group=self.process_group)
        if error[0] is not None:
            raise OSError(error[0])

    def _storage_error(self) -> OSError | None:
        """DCP reports a full disk as, e.g., the zip writer's "unexpected pos"; a probe write
        recovers the OS error behind a failed save, named with the folder."""
        try:
            check_writable(self.folder, size=1 << 20)
        except OSError as e:
            return OSError(f"cannot write checkpoint to {self.folder}: {e.strerror or e}")
        return None

    def _write(self, final: Path, model_only: bool) -> bool:
        self.wait()
        self._set_aside_passed_over()
        if is_complete(final):
            logger.info("checkpoint %s already exists; not saving it again", final)
            return False
        if self._rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            remove_stale_tmp(self.folder)
            if final.exists():
                kept = set_aside(final)
                logger.warning("%s is incomplete (no %s); moved it to %s and saving this step anew", final,
                               METADATA_FILE, kept.name)
        self._barrier()
        tmp = self.folder / f".{final.name}.tmp"
        started = time.perf_counter()
        state_dict = self._model_export() if model_only else {name: state.state_dict() for name, state in self.states.items()}
        if self.async_mode == "disabled":
            try:
                with self._storage_errors_named():
                    save_state_dict(state_dict, tmp, self.process_group)
                self._finish_save(tmp, final, started)
            finally:  # a failure on rank 0 alone (publishing) must not leave the others waiting
                self._barrier()
            return True
        upload = dcp.async_save(
            state_dict,
            storage_writer=FileSystemWriter(tmp),
            process_group=self._async_group,
            async_stager=self._stager,
            no_dist=not self._distributed,
        )
        upload = getattr(upload, "upload_completion", upload)  # AsyncSaveResponse with some stagers
        logger.info("checkpoint %s staged in %.2fs, writing in the background", final.name, time.perf_counter() - started)
        self._pending = self._committer.submit(self._finish_async_save, upload, tmp, final, started)
        return True

    def _set_aside_passed_over(self) -> None:
        """At the first write after ``load()`` (collective): the complete checkpoints newer than
        the step loaded that were there at the load, and their exports (``step-<N>-model``,
        ``-hf``), are of a timeline this run left; renamed ``<name>.superseded`` they are kept but
        no longer resumed from, counted by retention, kept instead of this run's own save of their
        step, or taken for this run's final export."""
        steps, self._passed_over = self._passed_over, None
        if steps is None:
            return
        error = [None]
        if self._rank == 0:
            try:
                moved = [set_aside(path, "superseded").name for step in steps
                         for path, there in ((step_folder(self.folder, step), is_complete),
                                             (export_folder(self.folder, step), Path.is_dir),
                                             (hf_export_folder(self.folder, step), Path.is_dir)) if there(path)]
                if moved:
                    logger.warning("this run resumed from an older step and now saves its own: set the newer "
                                   "checkpoints aside as %s (never loaded or deleted; remove them when unwanted)",
                                   ", ".join(moved))
            except OSError as e:
                error[0] = f"cannot set aside the checkpoints after the one resumed from in {self.folder}: {e}"
        self._raise_rank0_error(error)  # every rank looks for the step to save only after the renames

    def _finish_async_save(self, upload: Future, tmp: Path, final: Path, started: float) -> None:
        with self._storage_errors_named():
            try:
                upload.result()
            except CheckpointException as e:  # a BaseException: turn it into an ordinary error
                raise_first_failure(e)
        self._finish_save(tmp, final, started)

    @contextlib.contextmanager
    def _storage_errors_named(self) -> Iterator[None]:
        """A failed write re-raised as the folder's own OS error when one explains it (a full
        disk otherwise reads as the zip writer's "unexpected pos"), or as the write's own
        OSError (the disk was full at the time, or a rank's files failed), named with the folder."""
        try:
            yield
        except Exception as e:
            error = self._storage_error()
            if error is None and isinstance(e, OSError):
                error = OSError(f"cannot write checkpoint to {self.folder}: {e.strerror or e}")
            if error is None:
                raise
            raise error from None

    def _finish_save(self, tmp: Path, final: Path, started: float) -> None:
        """After DCP returns every rank's files and the metadata are written (it gathers all
        write results before the coordinator writes .metadata), so rank 0 publishes alone."""
        if self._rank != 0:
            return
        write_extra_files(tmp, self.extra_files)
        publish(tmp, final)
        logger.info("checkpoint saved to %s in %.2fs", final, time.perf_counter() - started)
        if self.keep_latest_k:  # the newest k, and always the one just written (a seed among newer steps)
            for old in complete_steps(self.folder)[: -self.keep_latest_k]:
                if step_folder(self.folder, old) != final:
                    remove_step(self.folder, old)

    def _model_export(self) -> dict[str, Any]:
        dtype = EXPORT_DTYPES[self.export_dtype]
        return {
            name: {
                key: value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
                for key, value in self.states[name].state_dict().items()
            }
            for name in self._model_names
        }

    def failed(self) -> bool:
        """Whether a background save has ended in an error, which `wait` (or the next save, or
        `close`) raises. Local and non-blocking: a trainer shares it with the other ranks (one
        may learn first) and all call `wait` together, so the error surfaces a step after the
        write failed rather than at the next save."""
        return self._pending is not None and self._pending.done() and self._pending.exception() is not None

    def wait(self) -> None:
        """Blocks until an in-flight async save is written and published (collective)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        try:
            pending.result()
        finally:  # as in save: every rank reaches the barrier, then the failing ones raise
            self._barrier()

    def close(self) -> None:
        """Waits for the last save and gives up the folder (claim()), even when that save failed;
        call it before the process exits."""
        try:
            self.wait()
        finally:
            if self._claim is not None:
                self._claim.close()
                self._claim = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._committer is not None:
                self._committer.shutdown()
                self._committer = None

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier(group=self.process_group)

    # ---- loading ---------------------------------------------------------------------------

    def incomplete_steps(self) -> list[int]:
        """Steps whose ``step-<N>`` lacks its ``.metadata``: never loaded; set aside as
        ``step-<N>.incomplete`` when that step is saved anew."""
        return incomplete_steps(self.folder)

    def resume_step(self) -> tuple[int | None, list[int]]:
        """The step ``load()`` resumes from: the newest complete checkpoint holding more than the
        model, else the newest model-only one (a seed checkpoint), else None; and the newer
        model-only steps passed over."""
        steps = complete_steps(self.folder)
        for i in reversed(range(len(steps))):
            if not self._is_model_only(step_folder(self.folder, steps[i])):
                return steps[i], steps[i + 1:]
        return (steps[-1], []) if steps else (None, [])

    def _is_model_only(self, path: Path) -> bool:
        stored = {fqn.split(".", 1)[0] for fqn in read_metadata(path).state_dict_metadata}
        return bool(stored) and stored <= set(self._model_names)

    def _template(self, name: str, metadata) -> dict[str, Any]:
        """What state `name` loads: its state dict, less the optional keys the checkpoint lacks."""
        template = self.states[name].state_dict()
        for key in getattr(self.states[name], "optional_keys", ()):
            stored = f"{name}.{key}"
            if not any(fqn == stored or fqn.startswith(f"{stored}.") for fqn in metadata.state_dict_metadata):
                template.pop(key, None)
        return template

    def load(self, step: int = -1) -> int | None:
        """Restores the states (except ``exclude_from_loading``) from ``step``, or from
        ``resume_step()`` when -1. Returns the step loaded, or None if there is none.

        A model-only checkpoint restores just the model states. The first state is read and
        applied before the others, so a check of its own fails before their shapes are compared.

        The complete checkpoints newer than ``step`` found as the load starts are another timeline
        once this run trains on from ``step``: the next ``save()`` or ``export_model()`` sets them
        and their exports aside as ``<name>.superseded`` (kept, but never loaded, counted by
        retention or deleted), so retention never counts them against the checkpoint resumed
        from or the one just written, this run saves its own of their steps and exports, and a
        later ``load()`` resumes from this run's progress. A load alone (no save) changes
        nothing; checkpoints published while or after it loads (another writer) are not touched.
        """
        self.wait()
        if step == -1:
            step, passed = self.resume_step()
            damaged = [f"step-{n}" for n in incomplete_steps(self.folder) if step is None or n > step]
            if damaged:
                logger.warning("passing over incomplete checkpoints (no %s): %s", METADATA_FILE, ", ".join(damaged))
            if step is None:
                logger.info("no checkpoint in %s; starting from scratch", self.folder)
                return None
            if passed:
                logger.warning("checkpoint steps %s hold only the model; resuming from step %d", passed, step)
        elif not self.folder.is_dir():
            raise FileNotFoundError(f"checkpoint folder {self.folder} does not exist")
        elif not step_folder(self.folder, step).is_dir():
            raise ValueError(f"no checkpoint for step {step} in {self.folder}; available steps: {complete_steps(self.folder)}")
        path = step_folder(self.folder, step)
        newer = [n for n in complete_steps(self.folder) if n > step]  # before reading: later ones are another writer's
        started = time.perf_counter()
        metadata = read_metadata(path)
        check_storage_files(path, metadata)

        names = [name for name in self.states if name not in self.exclude_from_loading]
        stored = {fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata}
        if stored and stored <= set(self._model_names):
            skipped = [name for name in names if name not in stored]
            if skipped:
                logger.info("checkpoint %s is model-only; not restoring %s", path, skipped)
            names = [name for name in names if name in stored]
        optional = tuple(
            f"{name}." for name in names
            if isinstance(self.states[name], RankLocalState) and not self.states[name].required
        )
        # the first state alone first: its own check (a trainer's record of the model that wrote
        # the checkpoint) speaks before any tensor of another model is found the wrong shape
        for group in ([names[0]], names[1:]) if len(names) > 1 else [names]:
            state_dict = {name: self._template(name, metadata) for name in group}
            load_into(state_dict, path, metadata=metadata, process_group=self.process_group, optional_prefixes=optional)
            for name in group:
                self.states[name].load_state_dict(state_dict[name])
        logger.info("checkpoint step %d loaded from %s in %.2fs", step, path, time.perf_counter() - started)
        self._passed_over = newer
        return step
