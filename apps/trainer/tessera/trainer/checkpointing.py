"""The run's checkpoints ([checkpoint] keys) over tessera.ckpt: what a checkpoint holds,
resuming, initial weights from a DCP or Hugging Face folder, seed checkpoints and the final
Hugging Face export (with config.json and the tokenizer's files, see hf_assets)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tessera.ckpt import (
    EXPORT_DTYPES, CheckpointManager, ModelState, OptimizerState, RankLocalState, export_folder, export_hf,
    hf_export_folder, import_hf, load_into, rng_state, stored_keys,
)
from tessera.models.spec import ARGS_FILE, hf_export_note
from tessera.trainer.config import JobConfig
from tessera.trainer.errors import ConfigError
from tessera.trainer.faults import TrainingError, weights_finite
from tessera.trainer.hf_assets import export_files, initial_load_folder
from tessera.trainer.param_groups import signature
from tessera.trainer.plan import JobPlan, tokenizer_source


class TrainState:
    """Steps completed, the model they trained and its optimizer groups: resuming another model's
    run is refused even where the shapes agree (llama2 and llama3 debug models), and so is a
    resume with other groups, whose state and settings would load into the wrong places. The
    batch (sequences, tokens each) its steps took: a resume with another is told
    (`batch_before`), as another layout changes it where global_batch_size is left at -1. The
    tokens a rank routes at once (a micro-batch's, over context parallel): where experts have a
    capacity, which slots they drop depends on it (`routed_before`)."""

    # checkpoints before tessera-trainer 0.12 lack the optimizer groups (one AdamW group), before 0.22
    # the batch, before 0.23 the routed tokens
    optional_keys = ("optimizer", "batch", "routed")

    def __init__(self, model: str, optimizer: list[list], batch: list[int], routed: int) -> None:
        self.step = 0
        self.model = model
        self.optimizer = optimizer  # param_groups.signature
        self.batch = batch  # [sequences per step, seq_len]
        self.routed = routed
        self.batch_before: list[int] | None = None  # the checkpoint's, where it differs
        self.routed_before: int | None = None  # likewise

    def state_dict(self) -> dict:
        return {"step": self.step, "model": self.model, "optimizer": self.optimizer, "batch": self.batch,
                "routed": self.routed}

    def load_state_dict(self, state: dict) -> None:
        if state["model"] != self.model:
            raise ValueError(f"checkpoint was written by a {state['model']} run, this run trains {self.model} (model.name/model.flavor)")
        saved = state.get("optimizer")
        if saved is None and [group[4] for group in self.optimizer] == ["all"]:
            saved = self.optimizer  # an older checkpoint: AdamW over one group, as this run
        if saved != self.optimizer:
            raise ValueError(f"checkpoint was written with optimizer groups {_groups_text(saved)}, this run has "
                             f"{_groups_text(self.optimizer)} (optimizer.name, param_groups, weight_decay, muon_exclude)")
        self.step = state["step"]
        self.batch_before = state["batch"] if state.get("batch", self.batch) != self.batch else None
        self.routed_before = state["routed"] if state.get("routed", self.routed) != self.routed else None


def _torchtitan_layout(path: Path, model_state: dict) -> bool:
    """Whether the DCP checkpoint at `path` keeps the model's weights at its top level, as
    torchtitan writes them (its CheckpointManager flattens the model state beside "optimizer",
    "train_state"...), where Tessera's sit under "model"."""
    stored = stored_keys(path)
    return not any(key.startswith("model.") for key in stored) and not stored.isdisjoint(model_state)


def _routed_at_once(plan: JobPlan) -> int:
    """Tokens a rank's MoE layers route at once: a micro-batch's (a pipeline's own micro-batch
    under pipeline parallel), its share under context parallel."""
    sequences = plan.batch.local // (plan.pipeline.microbatches if plan.pipeline is not None else 1)
    return sequences * plan.batch.seq_len // plan.dims.cp


def _batch_keys(before: list[int], batch, pipelined: bool) -> str:
    """The keys that give this layout the checkpoint's [sequences per step, seq_len]: its global
    batch, with a local batch that divides it over this run's data-parallel ranks (under pipeline
    parallel, whose schedule has rules of its own for the micro-batches, in words)."""
    global_size, seq_len = before
    keys = [f"--training.seq_len {seq_len}"] if seq_len != batch.seq_len else []
    if global_size != batch.global_size:
        keys.insert(0, f"--training.global_batch_size {global_size}")
        if global_size % (batch.local * batch.dp):
            local = max((n for n in range(1, batch.local) if global_size % (n * batch.dp) == 0), default=None)
            keys.insert(1, "with a local_batch_size its data-parallel ranks and pipeline micro-batches split it into"
                        if pipelined else f"--training.local_batch_size {local}" if local else
                        "on a data-parallel degree that divides it")
    return " ".join(keys)


def _groups_text(signature: list[list] | None) -> str:
    if signature is None:
        return "[one AdamW group]"
    return "[" + "; ".join(f"{label}: {count} parameters, {algorithm} weight_decay={wd:g} lr_scale={scale:g}"
                           for label, algorithm, wd, scale, count, _ in signature) + "]"


class Checkpointer:
    """Saves and restores the run: model, optimizer, lr_scheduler, dataloader (global position),
    train_state and rng (per rank) in ``<dump_folder>/<checkpoint.folder>/step-<N>``.

    Build it on every rank once the model is parallelized and the optimizer, scheduler and
    loader exist; every method is collective. The job plan has checked the [checkpoint] keys.
    """

    def __init__(self, config: JobConfig, plan, parts: list[nn.Module], optimizers: list[list[torch.optim.Optimizer]],
                 scheduler, dataloader, rank: int, pp_group=None, tokenizer=None, extra_states: dict | None = None,
                 writes: Callable[[], bool] = lambda: True, shared: bool = False) -> None:
        """parts: the model, or this rank's pipeline stages (the optimizers of each); pp_group:
        the pipeline's process group, which a Hugging Face export gathers the stages over;
        tokenizer: the run's, whose bos/eos ids an export's config.json states; extra_states:
        more state a checkpoint holds (fault tolerance's semi-sync state); writes: whether this
        job writes the checkpoints (of fault tolerance's replica groups, one writes them); shared:
        whether other jobs write the folder in turn (live fault tolerance's groups), else the
        folder is claimed for this run and a second run on it refused."""
        self.config = config.checkpoint
        spec, args = plan.spec, plan.model_args
        self.spec, self.args, self.parts, self.rank, self.pp_group = spec, args, parts, rank, pp_group
        self.initial = initial_load_folder(config)
        dcp_files, self.hf_files = export_files(config, spec, args, tokenizer, tokenizer_source(config))
        self.folder = Path(config.job.dump_folder) / self.config.folder
        self.steps = config.training.steps
        self.train_state = TrainState(f"{config.model.name}/{config.model.flavor}", signature(plan.optimizer.groups),
                                      [plan.batch.global_size, plan.batch.seq_len],
                                      _routed_at_once(plan))
        self.batch, self.pipelined = plan.batch, plan.pipeline is not None
        self.capacity_factor = plan.experts.capacity_factor
        # train_state first: loading applies states in this order, so a wrong model fails first
        self.states = {
            "train_state": self.train_state,
            "model": ModelState(parts),
            "optimizer": OptimizerState(parts, optimizers),
            "lr_scheduler": scheduler,  # holds no lr function: the horizon stays training.steps
            # The loader's state is a global position, equal on every rank: one copy under the
            # key a one-process run writes, so any data-parallel layout loads any other's.
            "dataloader": RankLocalState(dataloader, "dp_rank_0"),
            "rng": rng_state(rank),
            **(extra_states or {}),
        }
        self.writes = writes
        self.manager = None
        self.last_saved: Path | None = None  # the newest checkpoint this run wrote (the run's summary names it)
        if self.config.enable or self.config.create_seed_checkpoint:
            self.manager = CheckpointManager(
                self.folder, self.states, interval=self.config.interval, async_mode=self.config.async_mode,
                keep_latest_k=self.config.keep_latest_k, exclude_from_loading=self.config.exclude_from_loading,
                last_save_model_only=self.config.last_save_model_only, export_dtype=self.config.export_dtype,
                extra_files=dcp_files,
            )
            if not self.config.load_only:  # a load_only run may read from read-only storage
                if not shared:  # first: it clears crashed saves' leftovers, which may hold the space checked next
                    self.manager.claim()
                self.manager.check_writable()

    def _say(self, message: str) -> None:
        if self.rank == 0:
            print(f"checkpoint: {message}", flush=True)

    def restore(self) -> int:
        """Loads checkpoint.load_step (-1: the newest) from the run's folder or, when that has
        none, checkpoint.initial_load_path (for initial_load_in_hf without one: model.hf_assets_path).
        Returns the number of steps already trained."""
        if self.config.enable:
            step = self.config.load_step
            if step == -1:
                step, passed = self.manager.resume_step()
                if passed:
                    self._say(f"{self.folder / f'step-{passed[-1]}'} holds only the model; resuming from the newest "
                              f"full checkpoint, step-{step}")
            self._refuse_torchtitan_resume(step)
        loaded = self.manager.load(self.config.load_step) if self.config.enable else None
        if loaded is not None:
            self._resumed(loaded)
        else:
            if self.initial is not None:
                self._load_initial(*self.initial)
            self._check_outputs_free()
        return self.train_state.step

    def _resumed(self, loaded: int) -> None:
        """After a load from the run's folder: says so (and what it passed over or left unused). A run
        found at training.steps (re-run after it finished, or crashed right after its last checkpoint)
        writes the final exports it lacks."""
        if "train_state" in self.config.exclude_from_loading and not self.config.load_only:
            # back at step 0 over its own checkpoints, never overwritten: its saves would be skipped
            raise ConfigError(f"checkpoint.exclude_from_loading 'train_state' would restart this run at step 0 over its "
                              f"own checkpoints in {self.folder}, which are never overwritten: to start over from "
                              f"step-{loaded}, load it with checkpoint.initial_load_path into another checkpoint.folder")
        self._check_within_steps(self.folder / f"step-{loaded}")
        damaged = [f"step-{n}" for n in self.manager.incomplete_steps() if n > loaded]
        why = (f" (passing over {', '.join(damaged)}: no .metadata, damaged after it was written; set aside as "
               "step-N.incomplete when that step is saved again)" if damaged else "")
        unused = (f"; {self.initial[0]} {self.initial[1]} is not loaded: the run resumes its own checkpoints"
                  if self.initial is not None else "")
        self._say(f"loaded {self.folder / f'step-{loaded}'}{why}; training continues after step "
                  f"{self.train_state.step}{unused}")
        self._lr_from_here(excluded="lr_scheduler" in self.config.exclude_from_loading)
        if self.train_state.batch_before is not None:  # e.g. global_batch_size -1 under another data-parallel degree
            before, now = self.train_state.batch_before, self.train_state.batch
            self._say(f"step-{loaded} was trained on {before[0]} sequences x {before[1]} tokens per step, this run takes "
                      f"{now[0]} x {now[1]}: to go on as that run would, set {_batch_keys(before, self.batch, self.pipelined)}")
        elif self.train_state.routed_before is not None and self.capacity_factor is not None:
            self._say(f"experts keep a capacity per rank and micro-batch (parallelism.expert_capacity_factor): step-{loaded}'s "
                      f"ranks routed {self.train_state.routed_before} tokens at once, this run's {self.train_state.routed}, so "
                      "other slots are dropped and the losses differ from that run's")
        if self.train_state.step == self.steps and not self.config.load_only and self.writes():
            self._say(f"step {self.steps} is training.steps: nothing left to train; writing any final export "
                      "that is missing")
            self._final_exports(self.steps)

    def _whose(self, path: Path) -> str:
        """Initial weights of another model with the same shapes (Llama 2's and 3's debug models)
        load without a word from the tensors: said from the checkpoint's model_args.json, read
        leniently (an older trainer's record, a model this run has not registered, a damaged file:
        the tensors decide whether the weights load, not this remark)."""
        try:
            record = json.loads((path / ARGS_FILE).read_text())
            theirs = f"{record['model']}/{record.get('flavor', '?')}"
        except (OSError, ValueError, TypeError, KeyError):
            return ""
        return f" (weights of a {theirs} model; this run builds {self.train_state.model})" \
            if theirs != self.train_state.model else ""

    def _refuse_torchtitan_resume(self, step: int | None) -> None:
        """A torchtitan run's checkpoint folder holds step-<N> folders too, but its optimizer, data
        and schedule states are not Tessera's: its weights load as initial weights instead."""
        path = self.folder / f"step-{step}"
        if step is not None and path.is_dir() and _torchtitan_layout(path, self.states["model"].state_dict()):
            raise ConfigError(f"{path} is a torchtitan checkpoint (the model's weights at its top level), which this "
                              f"run cannot resume; start from its weights with checkpoint.initial_load_path {path} "
                              "and another checkpoint.folder")

    def _check_within_steps(self, loaded: Path, initial: bool = False) -> None:
        """A checkpoint past training.steps would leave this run nothing to train, silently; so would an
        initial one at training.steps. (The run's own at training.steps is a finished run re-run: it
        writes the final exports a crash left out.)"""
        step = self.train_state.step
        if step > self.steps or (initial and step == self.steps):
            raise ConfigError(f"{loaded} is at step {step}, {'past' if step > self.steps else 'at'} training.steps "
                              f"{self.steps}: this run would train nothing (raise training.steps or load another checkpoint)")

    def _lr_from_here(self, excluded: bool) -> None:
        """After a load: every group's lr is this run's schedule's at the position loaded (its own
        when the schedule was left out), not a loaded optimizer's; a changed optimizer.lr is said."""
        scheduler = self.states["lr_scheduler"]
        if excluded:
            scheduler.load_state_dict(scheduler.state_dict())
        if scheduler.replaced is not None:
            self._say(f"optimizer.lr {scheduler.lr:g} replaces the checkpoint's {scheduler.replaced:g} from step "
                      f"{self.train_state.step + 1} on")

    def _check_outputs_free(self) -> None:
        """A run that did not resume from this folder, whose final export is already there, is
        another run: that export would be kept and this run's weights not exported, so it is
        refused before training. A resume after a crash or a damaged checkpoint keeps the export
        it finds and says so; one from an older checkpoint.load_step sets the newer steps' exports
        aside with their checkpoints at its first save (tessera.ckpt), and exports its own."""
        if self.manager is None or self.config.load_only or not self.config.enable:
            return
        for final, wanted in ((hf_export_folder(self.folder, self.steps), self.config.last_save_in_hf),
                              (export_folder(self.folder, self.steps), self.config.last_save_model_only)):
            if wanted and final.exists():
                raise ConfigError(f"{final} already exists from another run, and this run (resuming from no checkpoint "
                                  f"of {self.folder}) would export its own weights there; exports are never "
                                  "overwritten: move it away or use another checkpoint.folder")

    def _load_initial(self, key: str, path: Path) -> None:
        if not path.is_dir():
            raise FileNotFoundError(f"{key} {path} does not exist or is not a folder")
        if self.config.initial_load_in_hf:
            # tensor by tensor into the (possibly sharded) model: no rank holds the whole model;
            # a pipeline stage reads only its own tensors, checked against the whole model's names
            shapes = None
            if self.pp_group is not None:
                with torch.device("meta"):
                    shapes = {key: tuple(value.shape) for key, value in self.spec.build(self.args).state_dict().items()}
            adapter = self.spec.hf_adapter
            stacked = getattr(adapter, "stacked_slice", None)  # MoE experts: one HF tensor per expert
            for part in self.parts:
                import_hf(part, path, lambda state_dict: adapter.from_hf(state_dict, self.args), model_shapes=shapes,
                          stacked=stacked and (lambda name: stacked(name, self.args)))
            self._say(f"initial weights from Hugging Face checkpoint {path}")
            return
        model = self.states["model"].state_dict()
        if _torchtitan_layout(path, model):
            if not self.config.initial_load_model_only:
                raise ConfigError(f"{key} {path} is a torchtitan checkpoint (the model's weights at its top level): "
                                  "only its weights load here; set checkpoint.initial_load_model_only true")
            load_into(model, path)
            self.states["model"].load_state_dict(model)
            self._say(f"initial weights from torchtitan checkpoint {path}")
            return
        excluded = set(self.config.exclude_from_loading)
        names = ["model"] if self.config.initial_load_model_only else [n for n in self.states if n not in excluded]
        state_dict = {name: self.states[name].state_dict() for name in names}
        load_into(state_dict, path, optional_prefixes=("rng.",))  # more ranks than saved keep their seeded rng
        for name in names:
            self.states[name].load_state_dict(state_dict[name])
        self._check_within_steps(path, initial=True)
        self._say(f"initial {'weights' if self.config.initial_load_model_only else 'state'} from {path}{self._whose(path)}")
        if "optimizer" in names:
            self._lr_from_here(excluded="lr_scheduler" not in names)

    def save_seed(self) -> None:
        """Writes the initial weights as the model-only checkpoint ``step-0``."""
        seed = self.folder / "step-0"
        if seed.exists():
            raise ValueError(f"seed checkpoint {seed} already exists; remove it or choose another checkpoint.folder")
        self.manager.save(0, model_only=True)
        self.close()
        self._say(f"seed checkpoint written to {seed}")

    def after_step(self, step: int, last_step: bool) -> None:
        """Saves when due (every interval, the last step, step 1 with enable_first_step_checkpoint);
        never with load_only."""
        self.train_state.step = step
        if self.manager is None or self.config.load_only or not self.writes():
            return
        first = step == 1 and self.config.enable_first_step_checkpoint and not self.manager.due(step, last_step)
        if first or self.manager.due(step, last_step):
            self._check_finite(step)
            started = time.perf_counter()
            if self.manager.save(step):
                self.last_saved = self.folder / f"step-{step}"
                self._say_saved(step, time.perf_counter() - started)
            else:
                self._say(f"{self.folder / f'step-{step}'} already holds a complete checkpoint, kept as it is "
                          "(checkpoints are never overwritten)")
        if last_step:
            self._final_exports(step)

    def _final_exports(self, step: int) -> None:
        """The last step's model-only and Hugging Face exports, each kept as it is if already there."""
        if self.config.last_save_model_only and not self.manager.export_model(step):
            self._say(f"{export_folder(self.folder, step)} already exists, kept as it is (exports are never overwritten)")
        if self.config.last_save_in_hf:
            self._export_hf(step)

    def _say_saved(self, step: int, blocking_s: float) -> None:
        where = self.folder / f"step-{step}"
        if self.config.async_mode == "disabled":
            self._say(f"saved {where} in {blocking_s:.2f} s")
        else:
            self._say(f"step {step} staged in {blocking_s:.2f} s (training blocked that long); {where} is written in the background")

    def save_now(self, step: int) -> bool:
        """A full checkpoint of ``step`` outside the interval (a stop signal); False when
        checkpointing is off."""
        self.train_state.step = step
        if self.manager is None or not self.config.enable or self.config.load_only:
            return False
        if not self.writes():
            return True  # another replica group writes it
        self._check_finite(step)
        if self.manager.save(step):
            self.last_saved = self.folder / f"step-{step}"
        return True

    def _check_finite(self, step: int) -> None:
        """A checkpoint with non-finite weights would poison every resume from it."""
        device = next(p.device for part in self.parts for p in part.parameters())
        if not weights_finite((p for part in self.parts for p in part.parameters()), device.type):
            raise TrainingError(f"step {step}: model weights are not finite; not writing a checkpoint "
                                f"(the newest one in {self.folder} stays)")

    def _export_hf(self, step: int) -> None:
        """The model as Hugging Face safetensors in ``step-<N>-hf``, cast to export_dtype, one
        tensor gathered at a time, with config.json and the tokenizer's files beside; written
        under a ``.step-*`` tmp name (removed by the next save if this one crashes)."""
        final = hf_export_folder(self.folder, step)
        note = hf_export_note(self.spec, self.args)
        if note:
            self._say(f"warning: {note}")
        adapter = self.spec.hf_adapter
        group = getattr(adapter, "export_group", None)  # model tensors HF fuses into one (Llama 4's experts)
        exported = export_hf(self.parts, final, lambda state_dict: adapter.to_hf(state_dict, self.args),
                             dtype=EXPORT_DTYPES[self.config.export_dtype], pp_group=self.pp_group,
                             extra_files=self.hf_files, together=group and (lambda key: group(key, self.args)))
        self._say(f"Hugging Face export written to {final}" if exported else f"{final} already exists, kept as it is (exports are never overwritten)")

    def save_failed(self) -> bool:
        """A background save of this rank failed (its error is raised by `close`)."""
        return self.manager is not None and self.manager.failed()

    def close(self, after_failure: bool = False) -> None:
        """Waits for an in-flight async save; call before the process group goes. After the run
        failed (a lost rank) that save's own failure is its consequence: said, not raised over
        the run's error."""
        if self.manager is None:
            return
        try:
            self.manager.close()
        except Exception as e:
            if not after_failure:
                raise
            self._say(f"the background save failed too: {(str(e).splitlines() or [type(e).__name__])[0]}")
