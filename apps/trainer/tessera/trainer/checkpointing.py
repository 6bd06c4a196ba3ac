"""The run's checkpoints ([checkpoint] keys) over tessera.ckpt: what a checkpoint holds,
resuming, initial weights from a DCP or Hugging Face folder, seed checkpoints and the final
Hugging Face export."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from tessera.ckpt import (
    EXPORT_DTYPES, CheckpointManager, ModelState, OptimizerState, RankLocalState, check_state_dict, load_hf, load_into,
    rng_state, save_hf,
)
from tessera.trainer.config import ConfigError, JobConfig


class TrainState:
    """Steps completed, and the model they trained: resuming another model's run is refused
    even where the shapes agree (llama2 and llama3 debug models)."""

    def __init__(self, model: str) -> None:
        self.step = 0
        self.model = model

    def state_dict(self) -> dict:
        return {"step": self.step, "model": self.model}

    def load_state_dict(self, state: dict) -> None:
        if state["model"] != self.model:
            raise ValueError(f"checkpoint was written by a {state['model']} run, this run trains {self.model} (model.name/model.flavor)")
        self.step = state["step"]


def _check_config(config: JobConfig, spec, world_size: int) -> None:
    ckpt = config.checkpoint
    if ckpt.create_seed_checkpoint and world_size != 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint needs a single process, not {world_size}: seed weights are written before any sharding")
    if not ckpt.enable and ckpt.load_step != -1:
        raise ConfigError("checkpoint.load_step needs checkpoint.enable = true")
    if not ckpt.enable and ckpt.last_save_in_hf:
        raise ConfigError("checkpoint.last_save_in_hf needs checkpoint.enable = true")
    if ckpt.initial_load_in_hf and not ckpt.initial_load_path:
        raise ConfigError("checkpoint.initial_load_in_hf needs checkpoint.initial_load_path (a Hugging Face folder)")
    if ckpt.initial_load_in_hf and not ckpt.initial_load_model_only:
        raise ConfigError("checkpoint.initial_load_in_hf loads model weights only: set initial_load_model_only = true")
    if (ckpt.initial_load_in_hf or ckpt.last_save_in_hf) and spec.hf_adapter is None:
        raise ConfigError(f"model {spec.name} has no Hugging Face adapter (checkpoint.initial_load_in_hf/last_save_in_hf)")


class Checkpointer:
    """Saves and restores the run: model, optimizer, lr_scheduler, dataloader (per dp rank),
    train_state and rng (per rank) in ``<dump_folder>/<checkpoint.folder>/step-<N>``.

    Build it on every rank once the model is parallelized and the optimizer, scheduler and
    loader exist; every method is collective.
    """

    def __init__(self, config: JobConfig, spec, args, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler, dataloader, dp_rank: int, rank: int, world_size: int) -> None:
        _check_config(config, spec, world_size)
        self.config = config.checkpoint
        self.spec, self.args, self.model, self.rank = spec, args, model, rank
        self.folder = Path(config.job.dump_folder) / self.config.folder
        self.train_state = TrainState(f"{config.model.name}/{config.model.flavor}")
        # train_state first: loading applies states in this order, so a wrong model fails first
        self.states = {
            "train_state": self.train_state,
            "model": ModelState([model]),
            "optimizer": OptimizerState([model], [optimizer]),
            "lr_scheduler": scheduler,  # holds no lr function: the horizon stays training.steps
            "dataloader": RankLocalState(dataloader, f"dp_rank_{dp_rank}"),
            "rng": rng_state(rank),
        }
        self.manager = None
        if self.config.enable or self.config.create_seed_checkpoint:
            self.manager = CheckpointManager(
                self.folder, self.states, interval=self.config.interval, async_mode=self.config.async_mode,
                keep_latest_k=self.config.keep_latest_k, exclude_from_loading=self.config.exclude_from_loading,
                last_save_model_only=self.config.last_save_model_only, export_dtype=self.config.export_dtype,
            )

    def _say(self, message: str) -> None:
        if self.rank == 0:
            print(f"checkpoint: {message}", flush=True)

    def restore(self) -> int:
        """Loads checkpoint.load_step (-1: the newest) from the run's folder or, when that has
        none, checkpoint.initial_load_path. Returns the number of steps already trained."""
        loaded = self.manager.load(self.config.load_step) if self.config.enable else None
        if loaded is not None:
            self._say(f"loaded {self.folder / f'step-{loaded}'}; training continues after step {self.train_state.step}")
        elif self.config.initial_load_path:
            self._load_initial(Path(self.config.initial_load_path))
        return self.train_state.step

    def _load_initial(self, path: Path) -> None:
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint.initial_load_path {path} does not exist or is not a folder")
        if self.config.initial_load_in_hf:
            self._load_full_model_state(self.spec.hf_adapter.from_hf(load_hf(path), self.args), f"Hugging Face checkpoint {path}")
            self._say(f"initial weights from Hugging Face checkpoint {path}")
            return
        excluded = set(self.config.exclude_from_loading)
        names = ["model"] if self.config.initial_load_model_only else [n for n in self.states if n not in excluded]
        state_dict = {name: self.states[name].state_dict() for name in names}
        load_into(state_dict, path, optional_prefixes=("rng.",))  # more ranks than saved keep their seeded rng
        for name in names:
            self.states[name].load_state_dict(state_dict[name])
        self._say(f"initial {'weights' if self.config.initial_load_model_only else 'state'} from {path}")

    def _load_full_model_state(self, state_dict: dict[str, torch.Tensor], source: str) -> None:
        """Full (unsharded) tensors, read on every rank, into the possibly sharded model."""
        # DTensor .shape is the global shape
        expected = {key: tuple(value.shape) for key, value in get_model_state_dict(self.model).items()}
        check_state_dict(state_dict, expected, source, "the model")
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(full_state_dict=True))

    def save_seed(self) -> None:
        """Writes the initial weights as the model-only checkpoint ``step-0``."""
        seed = self.folder / "step-0"
        if seed.exists():
            raise ValueError(f"seed checkpoint {seed} already exists; remove it or choose another checkpoint.folder")
        self.manager.save(0, model_only=True)
        self.close()
        self._say(f"seed checkpoint written to {seed}")

    def after_step(self, step: int, last_step: bool) -> None:
        self.train_state.step = step
        if self.manager is None:
            return
        self.manager.maybe_save(step, last_step=last_step)
        if last_step and self.config.last_save_in_hf:
            self._export_hf(step)

    def _export_hf(self, step: int) -> None:
        """The model as Hugging Face safetensors in ``step-<N>-hf``, cast to export_dtype;
        written under a ``.step-*`` tmp name (removed by the next save if this one crashes)."""
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        try:
            if self.rank == 0:
                final = self.folder / f"step-{step}-hf"
                if final.exists():
                    self._say(f"{final} already exists; not exporting again")
                    return
                dtype = EXPORT_DTYPES[self.config.export_dtype]
                hf = {key: value.to(dtype) for key, value in self.spec.hf_adapter.to_hf(full, self.args).items()}
                tmp = self.folder / f".step-{step}-hf.tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                save_hf(hf, tmp)
                os.rename(tmp, final)
                self._say(f"Hugging Face export written to {final}")
        finally:  # the other ranks wait for the file, and for a failure to surface on rank 0
            if dist.is_initialized():
                dist.barrier()

    def close(self) -> None:
        """Waits for an in-flight async save; call before the process group goes."""
        if self.manager is not None:
            self.manager.close()
