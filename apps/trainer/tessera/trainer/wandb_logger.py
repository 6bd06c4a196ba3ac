"""Weights & Biases as a metrics sink (`metrics.enable_wandb`), opened as torchtitan 0.2.2 opens
its run, so that its users' projects and dashboards read Tessera's runs; and a reader of a run's
log file, for the tests and tools/compare.

wandb is optional: it is imported only when a run opens or a log is read (the job plan refuses
`enable_wandb` without it, naming `pip install wandb`)."""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

from tessera.trainer.config import JobConfig, to_dict
from tessera.trainer.errors import ConfigError
from tessera.trainer.metrics import Sink

# torchtitan 0.2.2's variables for wandb.init's arguments; where one is unset wandb reads its own
# (WANDB_ENTITY, WANDB_NAME, WANDB_RUN_ID, WANDB_NOTES, WANDB_TAGS, WANDB_RUN_GROUP, WANDB_JOB_TYPE).
TORCHTITAN_ENV = {
    "entity": "WANDB_TEAM", "name": "WANDB_RUN_NAME", "id": "WANDB_RUN_ID", "notes": "WANDB_RUN_NOTES",
    "tags": "WANDB_RUN_TAGS", "group": "WANDB_RUN_GROUP", "job_type": "WANDB_RUN_JOB_TYPE",
    "resume_from": "WANDB_RESUME_FROM", "fork_from": "WANDB_FORK_FROM",
}


def wandb_sink(folder: Path, config: JobConfig) -> Sink:
    """A W&B run holding the job config, its files under `folder`/wandb (torchtitan's `dir=`: the
    run's metrics folder, beside the TensorBoard events), in project $WANDB_PROJECT or torchtitan's
    default, "torchtitan"."""
    import wandb

    folder.mkdir(parents=True, exist_ok=True)
    named = {arg: os.environ[var] for arg, var in TORCHTITAN_ENV.items() if os.environ.get(var)}
    if "tags" in named:  # comma-separated, as WANDB_TAGS (torchtitan hands the string on: one tag per character)
        named["tags"] = [tag.strip() for tag in named["tags"].split(",") if tag.strip()]
    try:
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "torchtitan"), dir=folder, config=to_dict(config),
                         mode=_mode(), **named)
    except wandb.errors.Error as e:  # the environment's settings: a mode, key or host wandb refuses
        wandb.teardown()
        raise ConfigError(f"metrics.enable_wandb: {e}") from None
    return Sink(lambda step, values: run.log(values, step=step), lambda: _finish(run))


def _mode() -> str | None:
    """"offline" where nothing says how to reach W&B: no WANDB_MODE, no credentials (WANDB_API_KEY,
    WANDB_IDENTITY_TOKEN_FILE, a `wandb login` in the netrc file), where wandb itself would refuse to
    start; `wandb sync` uploads the run later. Else None: wandb's own choice."""
    if any(os.environ.get(var) for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE")):
        return None
    from wandb.errors import AuthenticationError
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib.wbauth import read_netrc_auth

    try:  # the host of WANDB_BASE_URL or of `wandb login --host`, else W&B's
        logged_in = read_netrc_auth(host=wandb_setup.singleton().settings.base_url) is not None
    except AuthenticationError:  # a malformed key: wandb says so when it starts
        logged_in = True
    return None if logged_in else "offline"


def _finish(run) -> None:
    """Ends the run, as failed while an exception is on its way out (the logger closes in the
    training loop's `finally`), and stops wandb's service process (wandb-core), which would
    otherwise outlive the run until the interpreter exits."""
    import wandb

    run.finish(exit_code=0 if sys.exc_info()[0] is None else 1)
    wandb.teardown()


# A run's log (`run-<id>.wandb`, what `wandb sync` uploads): a header, then 32 KiB blocks of chunks,
# each a CRC-32 (of its kind and data), a length and a kind, and then the data: one record whole or
# its first, a middle or its last part; a block's tail too short for a chunk header is padding. A
# record is a protobuf `wandb_internal_pb2.Record`. wandb 0.31 reads these only in its Go core.
_HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
_CHUNK = struct.Struct("<IHB")
_BLOCK = 32 * 1024
_WHOLE, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def run_records(folder: Path) -> Iterator:
    """The records (`wandb_internal_pb2.Record`) of the log in a W&B run folder (`offline-run-…` or
    `run-…`, holding `run-<id>.wandb`), up to the last complete one (a live run's log grows)."""
    from wandb.proto.wandb_internal_pb2 import Record

    logs = sorted(folder.glob("run-*.wandb"))
    if not logs:
        raise ValueError(f"{folder}: no W&B run log (run-<id>.wandb) in it")
    data = logs[-1].read_bytes()
    if not data.startswith(_HEADER):
        raise ValueError(f"{logs[-1]} is not a W&B run log")
    position, parts = len(_HEADER), []
    while position + _CHUNK.size <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < _CHUNK.size:
            position += left
            continue
        checksum, length, kind = _CHUNK.unpack_from(data, position)
        start = position + _CHUNK.size
        chunk = data[start:start + length]
        if len(chunk) < length:
            return
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != checksum or kind not in (_WHOLE, _FIRST, _MIDDLE, _LAST):
            raise ValueError(f"{logs[-1]}: damaged at byte {position}")
        parts = [chunk] if kind in (_WHOLE, _FIRST) else [*parts, chunk]
        if kind in (_WHOLE, _LAST):
            yield Record.FromString(b"".join(parts))
        position = start + length


def read_run(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every number logged in a W&B run folder, wandb's own `_step`,
    `_runtime` and `_timestamp` left out."""
    scalars: dict[str, dict[int, float]] = {}
    for record in run_records(folder):
        if record.WhichOneof("record_type") != "history":
            continue
        for item in record.history.item:
            tag, value = item.key or ".".join(item.nested_key), json.loads(item.value_json)
            if not tag.startswith("_") and isinstance(value, (int, float)) and not isinstance(value, bool):
                scalars.setdefault(tag, {})[record.history.step.num] = float(value)
    return scalars
