"""Fault tolerance without restarts, through torchft (issue 30): replica groups that keep
training while one of them fails, restarts and catches up from a live peer.

Each replica group is a whole job (its own torchrun, FSDP x TP x PP ...); across the groups the
data-parallel dimension is torchft's: a `Manager` per group, whose quorum over the Lighthouse
says which groups take part in a step. Rank r of every group holds the same shard (the groups'
layouts are identical), so the ranks r of all groups form torchft's process group and average
their local gradient shards. Per step (semi_sync_method none, torchft's OptimizerWrapper
semantics made explicit):

  quorum (a group behind its peers receives their weights, optimizer and lr schedule: healing)
  -> forward/backward -> gradients and loss averaged over the groups that take part
  -> should_commit: the optimizer steps only if every rank of the group and enough groups
     (min_replica_size) made it; a step that did not count is retried with the same batches.

Semi-sync (local_sgd, diloco) runs torchft's LocalSGD / DiLoCo as they are, driven once per step
by a clock optimizer whose step hooks they use; their syncs quorum and heal.

A restarted group rejoins at the next quorum and heals from a peer, not from disk: one line per
recovery names the group, the peer and the step. Each group reads its own share of the data; its
loader position after every step it trained is recorded per group (`ft-replica-<id>` under the
checkpoint folder, checkpoint.enable_ft_dataloader_checkpoints), and a group that comes back
resumes its data where it last trained, so no sample is trained twice or skipped.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from tessera.trainer.config import ConfigError, JobConfig
from tessera.trainer.faults import StopSignals, TrainingError
from tessera.trainer.ft_plan import FaultTolerancePlan, torchft_missing
from tessera.trainer.replica_sync import ALONE

# Set by Tessera's launcher for the groups it starts together: their first quorum waits for all
# of them (a fresh or resumed job starts with every group, as a job without fault tolerance does).
START_TOGETHER_ENV = "TESSERA_FT_START_TOGETHER"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own
# What a healing group receives from its peer (the checkpoint's states but the per-group ones:
# data loader, rng); the data stays the group's own.
LIVE_STATES = ("train_state", "model", "optimizer", "lr_scheduler")
# DiLoCo's outer optimizer, as torchtitan 0.2.2 builds it (components/ft/manager.py)
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def replica_group(plan, rank: int, world_size: int, parts: Sequence[nn.Module], loader):
    """This group's torchft side, or NoReplicas without fault tolerance. Call once the model is
    built and before the checkpointer (which holds the semi-sync state)."""
    if not plan.fault_tolerance.enabled:
        return NoReplicas()
    return ReplicaGroup(plan, rank, world_size, parts, loader)


class NoReplicas:
    """Without fault tolerance: the job's own checkpoints and steps, unchanged."""

    sync = ALONE

    def checkpoint_config(self, config: JobConfig) -> JobConfig:
        return config

    def checkpoint_states(self) -> dict:
        return {}

    def writes_checkpoints(self) -> bool:
        return True

    def shares_checkpoint_folder(self) -> bool:
        return False

    def join(self, checkpointer, start_step: int) -> int:
        return start_step

    def steps(self, train_step: Callable) -> Callable:
        return train_step

    def stopped(self) -> None:
        pass

    def close(self) -> None:
        pass


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_tree(state):
    """A state dict with every DTensor replaced by this rank's shard: what travels to the same
    rank of another group, whose layout is the same."""
    if isinstance(state, dict):
        return {key: _local_tree(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_local_tree(value) for value in state)
    return _local(state)


def _like(received, own):
    """`received` (local shards) as tensors of their own memory, laid out like this rank's own
    state `own`."""
    if isinstance(own, dict):
        return {key: _like(received[key], own[key]) if key in own else received[key] for key in received}
    if not isinstance(received, torch.Tensor):
        return received
    # a copy: what torchft's transport read is a read-only buffer, and an optimizer keeps what it loads
    tensor = received.to(own.device if isinstance(own, torch.Tensor) else received.device, copy=True)
    if isinstance(own, DTensor):
        return DTensor.from_local(tensor, own.device_mesh, own.placements, run_check=False, shape=own.shape,
                                  stride=own.stride())
    return tensor


def _bytes(state) -> int:
    if isinstance(state, dict):
        return sum(_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_bytes(value) for value in state)
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


def _first_line(error) -> str:
    text = str(getattr(error, "original_exception", error)).strip()
    return (text.splitlines()[0] if text else type(error).__name__).split("] ", 1)[-1][:200]


class _Replay:
    """The micro-batches of one step, kept until the step counts: a retry trains the same ones."""

    def __init__(self, batches: Iterator) -> None:
        self.batches, self.taken, self.position = batches, [], 0

    def __iter__(self) -> "_Replay":
        return self

    def __next__(self):
        if self.position == len(self.taken):
            self.taken.append(next(self.batches))
        self.position += 1
        return self.taken[self.position - 1]

    def rewind(self) -> None:
        self.position = 0


class _Fragment(nn.Module):
    """A DiLoCo fragment: the model's modules it names, under their names ('.' -> '_')."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({name.replace(".", "_"): model.get_submodule(name) for name in names})


class _SemiSyncState:
    """What a group's own checkpoint holds of semi-sync training beyond the model: the manager's
    sync count and, for DiLoCo, each fragment's global weights (where its last sync left them) and
    outer optimizer — laid out as the model, so DCP reshards them like the weights."""

    def __init__(self, fragments: Sequence[nn.Module], outer: Sequence[torch.optim.Optimizer]) -> None:
        self.fragments, self.outer = list(fragments), list(outer)
        self.manager = None  # set once made (after a restore, which fills `manager_state`)
        self.manager_state = {"step": 0, "batches_committed": 0}
        self.diloco = None  # set once built (after a restore, which may fill `loaded`)
        self.loaded: list[dict[str, torch.Tensor]] | None = None

    def _globals(self, i: int) -> dict[str, torch.Tensor]:
        if self.diloco is not None:
            return self.diloco._fragments[i].original_parameters  # noqa: SLF001  torchft keeps them there
        return {name: _local(p.detach()).clone() for name, p in self.fragments[i].named_parameters()}

    def state_dict(self) -> dict:
        state = {"manager": self.manager.state_dict() if self.manager is not None else dict(self.manager_state)}
        for i, (fragment, outer) in enumerate(zip(self.fragments, self.outer)):
            params = dict(fragment.named_parameters())
            globals_ = self._globals(i)
            state[f"fragment{i}"] = {
                "globals": {name: _like(globals_[name], params[name].data) for name in params},
                "outer": get_optimizer_state_dict(fragment, outer, options=StateDictOptions(flatten_optimizer_state_dict=True)),
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        self.manager_state = dict(state["manager"])
        self.loaded = []
        for i, (fragment, outer) in enumerate(zip(self.fragments, self.outer)):
            saved = state[f"fragment{i}"]
            set_optimizer_state_dict(fragment, outer, saved["outer"],
                                     options=StateDictOptions(flatten_optimizer_state_dict=True))
            self.loaded.append({name: _local(value) for name, value in saved["globals"].items()})

    def attach(self, diloco) -> None:
        self.diloco = diloco
        for fragment, loaded in zip(diloco._fragments, self.loaded or ()):  # noqa: SLF001
            for name, value in loaded.items():
                fragment.original_parameters[name].copy_(value)


class ReplicaGroup:
    """One replica group's torchft Manager, its step seam (gradient average, commit) and its
    recovery. Every method is collective over the group's ranks."""

    def __init__(self, plan, rank: int, world_size: int, parts: Sequence[nn.Module], loader) -> None:
        missing = torchft_missing()
        if missing:
            raise ConfigError(missing)
        if not os.environ.get(LIGHTHOUSE_ENV):
            raise ConfigError(f"fault_tolerance.enable needs torchft's Lighthouse: launch with --nproc (which starts "
                              f"one), or start torchft_lighthouse and set {LIGHTHOUSE_ENV}=http://HOST:PORT")
        # torchft logs every quorum and commit (Rust, at import: RUST_LOG) and every error it handles
        # with its traceback (Python); its events come as one line each here instead
        os.environ.setdefault("RUST_LOG", "warn")
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
        # the received state is read from a read-only buffer; _like copies every tensor out of it
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        self.ft: FaultTolerancePlan = plan.fault_tolerance
        self.plan, self.rank, self.world_size, self.parts, self.loader = plan, rank, world_size, list(parts), loader
        self.say = rank == 0
        self.manager = None  # made by join: a Manager heartbeats from its start, and the Lighthouse holds
        # the other groups' quorum while a known group heartbeats without joining (torchft's split-brain rule)
        self.committed = 0  # steps this group's weights hold
        self.training_step = 1  # the step being trained
        self.counts = False  # the latest step's commit decision
        self.participants = 0
        self.joined = False  # the join's quorum is the first step's: every group quorums once per step
        self.recovered: tuple[int, int, int] | None = None  # (peer group, step, bytes) of the latest heal
        self.states: dict = {}
        self.positions: dict[int, dict] = {}  # step -> the loader's position after it (this group's)
        self.config = plan.config
        # semi-sync: the fragments and their outer optimizers exist before the checkpointer, which
        # saves them; torchft's LocalSGD / DiLoCo object once the weights are restored (it copies them)
        self.fragments, self.outer, self.method, self.clock = [], [], None, None
        if self.ft.semi_sync == "diloco":
            model = self.parts[0]
            self.fragments = [_Fragment(model, names) for names in self.ft.fragments] or [model]
            self.outer = [torch.optim.SGD([p for p in f.parameters() if p.requires_grad], lr=OUTER_LR,
                                          momentum=OUTER_MOMENTUM, nesterov=True) for f in self.fragments]
        self.semi_sync_state = _SemiSyncState(self.fragments, self.outer) if self.ft.semi_sync else None
        self.sync = self if not self.ft.semi_sync else ALONE

    # ---- checkpoints ---------------------------------------------------------------------------

    def checkpoint_config(self, config: JobConfig) -> JobConfig:
        """Every group steps the same weights: one checkpoint folder, written by the group that
        ranks first in the quorum (torchtitan's rule). Semi-sync groups diverge between syncs
        (and their inner optimizers always): each writes its own, under replica-<id>."""
        if not self.ft.semi_sync:
            return config
        import dataclasses

        folder = f"{config.checkpoint.folder}/replica-{self.ft.replica_id}"
        return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, folder=folder))

    def checkpoint_states(self) -> dict:
        return {"replicas": self.semi_sync_state} if self.semi_sync_state is not None else {}

    def writes_checkpoints(self) -> bool:
        # before joining (a restore: a group back after the others finished) it has written nothing
        # and writes nothing: the group that wrote that checkpoint wrote its exports
        return bool(self.ft.semi_sync) or (self.manager is not None and self.manager.participating_rank() == 0)

    def shares_checkpoint_folder(self) -> bool:
        """Live recovery's groups write one folder, whichever group leads at the time; semi-sync's
        each their own."""
        return not self.ft.semi_sync

    # ---- the data each group reads ------------------------------------------------------------

    def _data_file(self) -> Path:
        folder = Path(self.config.job.dump_folder) / self.config.checkpoint.folder
        return folder / f"ft-replica-{self.ft.replica_id}" / "dataloader.pt"

    def _read_positions(self) -> dict[int, dict]:
        path = self._data_file()
        return torch.load(path, weights_only=True) if self.ft.dataloader_checkpoints and path.is_file() else {}

    def _record_data(self, step: int) -> None:
        """The loader's position after `step` (rank 0 writes the group's file: its ranks walk the
        same stream), kept for the steps a resume may start from."""
        if not self.ft.dataloader_checkpoints or not self.say:
            return
        keep = 2 * self.config.checkpoint.interval + 1  # back to the newest complete checkpoint, async ones too
        # positions past `step` were a run's before it resumed from an earlier checkpoint
        self.positions = {s: p for s, p in self.positions.items() if step - keep < s < step}
        self.positions[step] = self.loader.state_dict()
        path = self._data_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(self.positions, tmp)
        tmp.replace(path)

    def _restore_data(self, step: int) -> int | None:
        """The group's loader where it stood after the last step it trained up to `step` (a step
        it did not take part in left its data untouched)."""
        trained = [s for s in self.positions if s <= step]
        if not trained:
            return None
        self.loader.load_state_dict(self.positions[max(trained)])
        return max(trained)

    # ---- live recovery --------------------------------------------------------------------------

    def _state_dict(self) -> dict:
        state = {name: _local_tree(self.states[name].state_dict()) for name in LIVE_STATES}
        # the step the weights hold: before this step's update (quorum at its start), or after it
        # (semi-sync: the sync follows the step)
        state["train_state"]["step"] = self.training_step if self.ft.semi_sync else self.training_step - 1
        return {"group": self.ft.replica_id, "states": state}

    def _load_state_dict(self, received: dict) -> None:
        for name in LIVE_STATES:
            own = self.states[name].state_dict()
            self.states[name].load_state_dict(_like(received["states"][name], own))
        step = received["states"]["train_state"]["step"]
        self.committed = step
        self.recovered = (received["group"], step, _bytes(received["states"]))

    # ---- joining ------------------------------------------------------------------------------

    def join(self, checkpointer, start_step: int) -> int:
        """After the checkpoint restore: live recovery set up, the first quorum (waiting for every
        group where the launcher started them together), healing when behind; returns the step
        to continue after."""
        self.states = checkpointer.states
        self._make_manager()
        self.manager.register_state_dict_fn("tessera", self._load_state_dict, self._state_dict)
        self.positions = self._read_positions()
        self._restored(start_step)
        started = time.perf_counter()
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.ft.semi_sync:
            self._build_semi_sync(resumed=first_attempt)
        if self.ft.semi_sync and not first_attempt:
            self._advance_clock_to_sync()  # a restarted group joins its peers at their next sync
        else:
            self._quorum()
            if first_attempt and os.environ.get(START_TOGETHER_ENV):
                self._wait_for_every_group()
            elif self.participants == 1 < self.ft.groups and self.recovered is None:
                # back to find no other group (they finished, or died): the freshest state is the newest
                # checkpoint, which they may have written while this group restarted
                self._restored(checkpointer.restore())
        if self.recovered is not None:
            self._say_recovered(time.perf_counter() - started)
        self.joined = True
        self._say_digest()  # a group back after the others finished holds their final weights now
        return self.committed

    def _restored(self, step: int) -> None:
        """After a checkpoint restore of `step`: the manager's step and the group's data."""
        self.committed = step
        if not self.ft.semi_sync:
            self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self._restore_data(step)

    def _make_manager(self) -> None:
        import torchft

        timeout = datetime.timedelta(seconds=self.ft.timeout_s)
        pg = torchft.ProcessGroupGloo(timeout=timeout) if self.ft.backend == "gloo" else torchft.ProcessGroupNCCL(timeout=timeout)
        store = _group_store()
        self.manager = torchft.Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=self.ft.min_replicas,
            use_async_quorum=False,  # a group behind heals before its step, and takes part in it at once
            replica_id=f"tessera_{self.ft.replica_id}", init_sync=False,  # seeded weights start equal
            quorum_timeout=datetime.timedelta(seconds=self.config.comm.init_timeout_seconds),
            rank=self.rank, world_size=self.world_size, store_addr=store[0], store_port=store[1],
        )
        self._store = store[2]  # a lone process's own store, kept alive
        if self.semi_sync_state is not None:
            self.semi_sync_state.manager = self.manager
            self.manager.load_state_dict(self.semi_sync_state.manager_state)  # the syncs a resumed group made

    def _build_semi_sync(self, resumed: bool) -> None:
        from torchft import local_sgd

        # the clock: a zero-lr optimizer of one scalar, stepped once per training step (after the
        # lr schedule), on whose step hooks torchft's LocalSGD / DiLoCo count steps and sync
        self._tick = nn.Parameter(torch.zeros(()))
        self.clock = torch.optim.SGD([self._tick], lr=0.0)
        if self.ft.semi_sync == "local_sgd":
            self.method = local_sgd.LocalSGD(self.manager, self.parts[0], self.clock, self.ft.sync_steps)
            self.cadence = self.ft.sync_steps
        else:
            self.method = local_sgd.DiLoCo(
                self.manager, self.fragments, self.clock, self.outer, self.ft.sync_steps,
                should_quantize=self.ft.should_quantize, fragment_sync_delay=self.ft.fragment_sync_delay,
                fragment_update_alpha=self.ft.fragment_update_alpha)
            self.semi_sync_state.attach(self.method)
            self.cadence = self.ft.sync_steps // len(self.fragments)
        self.method.__enter__()
        for _ in range(self.committed % self.cadence if resumed else 0):  # where a resumed run stood between syncs
            self.clock.step()

    def _advance_clock_to_sync(self) -> None:
        """Steps the clock to the point of the inner cycle where the peers quorum: the last tick
        waits in that quorum with them, heals, and takes part in their sync."""
        quorum_at = self.cadence - self.ft.fragment_sync_delay if self.ft.semi_sync == "diloco" else self.cadence
        self.training_step = self.committed  # nothing trained here: the weights hold `committed`
        for _ in range(quorum_at):
            self.clock.step()
        self.participants = self.manager.num_participants()

    def _quorum(self, say: bool = True) -> None:
        self.manager.start_quorum()
        self._say_participants(self.manager.num_participants(), say)

    def _say_participants(self, participants: int, say: bool = True) -> None:
        if participants != self.participants and self.participants and say and self.say:
            what = "sync" if self.ft.semi_sync else "train"
            print(f"fault tolerance: replica group {self.ft.replica_id}: from step {self.committed + (0 if self.ft.semi_sync else 1)}, "
                  f"{participants} of {self.ft.groups} replica groups {what}", flush=True)
        self.participants = participants

    def _wait_for_every_group(self) -> None:
        deadline = time.monotonic() + self.config.comm.init_timeout_seconds
        while self.participants < self.ft.groups and time.monotonic() < deadline:
            time.sleep(0.05)
            self._quorum(say=False)
        if self.say:
            print(f"fault tolerance: replica group {self.ft.replica_id} of {self.ft.groups} starts after step "
                  f"{self.committed} with {self.participants} group(s)", flush=True)

    def _say_recovered(self, seconds: float) -> None:
        peer, step, size = self.recovered
        if self.ft.dataloader_checkpoints:
            data = self._restore_data(step)
            where = f"its data resumes after its step {data}" if data is not None else "no data position recorded"
        else:
            where = "its data position is the checkpoint's (checkpoint.enable_ft_dataloader_checkpoints false)"
        if self.say:
            print(f"fault tolerance: replica group {self.ft.replica_id} recovered live from replica group {peer} at "
                  f"step {step} (weights, optimizer, lr schedule: {size / 2**20:.1f} MiB per rank, {seconds:.2f} s); "
                  f"{where}", flush=True)
        self.recovered = None

    # ---- the step seam (semi_sync_method none) -------------------------------------------------

    def average(self, params: Sequence[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        """Every gradient shard and the loss averaged over the groups in the quorum, one
        all-reduce per dtype (torchft's Manager.allreduce: a failed peer makes it a no-op and the
        step not count)."""
        grads = []
        for p in params:
            if p.grad is None:  # a parameter this batch left untouched: its zeros still take part
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        loss = loss.detach().float().reshape(1)
        stop = StopSignals.active
        # a stop signal to any group stops every group after this step (each saw it in this mean)
        stopping = torch.tensor([float(stop is not None and stop.received is not None)], device=loss.device)
        by_dtype.setdefault(torch.float32, []).extend([loss, stopping])
        works = []
        for dtype, tensors in by_dtype.items():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            works.append((self.manager.allreduce(flat), flat, tensors))
        for work, flat, tensors in works:
            work.wait()
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        if stop is not None:  # the loop stops on what every group saw here, not on a signal come since
            stop.agreed = stopping.item() > 0
            if stop.agreed and stop.received is None:
                stop.received = "a stop signal to another replica group"
        return loss.reshape(())

    def commit(self) -> bool:
        self.counts = self.manager.should_commit()
        return self.counts

    # ---- the loop's steps ------------------------------------------------------------------------

    def steps(self, train_step: Callable) -> Callable:
        """train_step as the loop calls it: one call, one step that counted."""
        if self.ft.semi_sync:
            return self._semi_sync_step(train_step)

        def step(batches: Iterator):
            replay = _Replay(batches)
            self.training_step = self.committed + 1
            waiting = False
            while True:
                if not self.joined:
                    self._quorum()
                self.joined = False
                if self.recovered is not None:  # the peers counted a step this group did not
                    raise TrainingError(f"replica group {self.ft.replica_id}: step {self.training_step} counted for "
                                        f"the other groups but not here; restarting the group to recover from them")
                if self.participants < self.ft.min_replicas:  # no step could count: wait for more groups
                    if self.say and not waiting:
                        print(f"fault tolerance: replica group {self.ft.replica_id}: step {self.training_step} waits for "
                              f"{self.ft.min_replicas} replica groups (fault_tolerance.min_replica_size)", flush=True)
                    waiting = True
                    time.sleep(0.5)
                    continue
                result = train_step(replay)
                if self.counts:
                    break
                if self.say:
                    why = self.manager.errored()
                    print(f"fault tolerance: replica group {self.ft.replica_id}: step {self.training_step} did not "
                          f"count ({_first_line(why) if why else 'too few replica groups'}); retrying it with the same "
                          "batches", flush=True)
                replay.rewind()
            self.committed = self.training_step
            self._record_data(self.committed)
            self._say_digest()
            return result

        return step

    def _semi_sync_step(self, train_step: Callable) -> Callable:
        def step(batches: Iterator):
            self.training_step = self.committed + 1
            result = train_step(batches)
            self.committed = self.training_step
            started = time.perf_counter()
            self.clock.step()  # LocalSGD / DiLoCo: every cadence-th step a quorum and a sync
            if self.recovered is not None:
                self._say_recovered(time.perf_counter() - started)
            if self.committed % self.cadence == 0:
                self._say_participants(self.manager.num_participants())
            self._record_data(self.committed)
            self._say_digest()
            return result

        return step

    def stopped(self) -> None:
        """The run ends before its last step (a stop signal; every rank of the group calls this):
        the digest too, as after the last step."""
        self._say_digest(ending=True)

    def _say_digest(self, ending: bool = False) -> None:
        """After the last step (or a stop, `ending`): one line with a digest of the group's weights
        (every rank's shard, bit for bit), so the groups' final weights can be compared from their logs."""
        if self.committed != self.config.training.steps and not ending:
            return
        digest = hashlib.sha256()
        for part in self.parts:
            for value in part.state_dict().values():
                digest.update(_local(value).detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
        digests = [digest.hexdigest()]
        if dist.is_initialized() and dist.get_world_size() > 1:
            digests = [None] * dist.get_world_size()
            dist.all_gather_object(digests, digest.hexdigest())
        if self.say:
            combined = hashlib.sha256("".join(digests).encode()).hexdigest()[:16]
            print(f"fault tolerance: replica group {self.ft.replica_id} ends at step {self.committed}, weights "
                  f"sha256 {combined}", flush=True)

    def close(self) -> None:
        if self.method is not None:
            self.method.__exit__(None, None, None)
        if self.manager is not None:
            self.manager.shutdown(wait=False)


def _group_store() -> tuple[str, int, object]:
    """The group's TCPStore (torchrun's MASTER_ADDR:MASTER_PORT), or for a process started
    without a launcher a store of its own."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    return "localhost", store.port, store
