"""One declaration per config key, beside its field: `key()` gives a section dataclass's field its
default and the facts the trainer acts on (help line, allowed values, bound, whether it is a path,
where its name comes from, why a value other than the default is refused, why a key accepted
for torchtitan's configs has no effect, which switch it needs). Validation, `--help`
and the README's key table read them through `declared`, so nothing restates a key."""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Iterator

from tessera.trainer.errors import ConfigError

# Where a key's name comes from: torchtitan 0.2.2's JobConfig, Tessera, an older torchtitan name
# still read, or a newer torchtitan's (its main branch, after 0.2.2).
TORCHTITAN = "torchtitan 0.2.2"
TESSERA = "tessera"
OLDER_TORCHTITAN = "torchtitan 0.1"
NEWER_TORCHTITAN = "torchtitan main"

# A bound: its test and its error ("{}": the value).
BOUNDS = {
    ">= 1": (lambda v: v >= 1, "{} must be >= 1"),
    ">= 0": (lambda v: v >= 0, "must be >= 0"),
    "> 0": (lambda v: v > 0, "{} must be > 0"),
    "within [0, 1]": (lambda v: 0 <= v <= 1, "{} must be within [0, 1]"),
}


@dataclasses.dataclass(frozen=True)
class Key:
    """What a config key declares besides its type and default."""

    help: str  # one line: what it does here
    choices: tuple | None = None  # the allowed values (of each item, for a list)
    bound: str | None = None  # one of BOUNDS; an unset (None) value passes
    path: bool = False  # a path the user types: a relative one resolves against the user's directory
    origin: str = TORCHTITAN
    refused: str | None = None  # why a value other than the default is refused
    inert: str | None = None  # why any value has no effect here (kept for torchtitan's configs)
    needs: str | None = None  # the switch (a bool key) without which this key has no effect


def key(default: typing.Any, help: str, **facts: typing.Any) -> typing.Any:
    """A config field: its default (a list is copied for each config) and its Key facts."""
    metadata = {"key": Key(help, **facts)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=functools.partial(list, default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def table(cls: type, **facts: typing.Any) -> typing.Any:
    """A field holding a section or nested table. `facts` replace those of each of its keys: the
    same keys may appear under another (older) name, or all need one switch (`needs`, which the
    switch itself then does not)."""
    return dataclasses.field(default_factory=cls, metadata={"facts": facts})


@functools.cache
def declared(cls: type) -> dict[str, Key]:
    """Every key of config class `cls` ("section.key", nested tables dotted), in declaration order."""
    return dict(_walk(cls, "", {}))


def _walk(cls: type, prefix: str, facts: dict) -> Iterator[tuple[str, Key]]:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        name = prefix + field.name
        if dataclasses.is_dataclass(hints[field.name]):
            yield from _walk(hints[field.name], f"{name}.", {**facts, **field.metadata.get("facts", {})})
        elif "key" not in field.metadata:
            raise TypeError(f"config key {name} is not declared with tessera.trainer.schema.key")
        else:
            declared_key = dataclasses.replace(field.metadata["key"], **facts)
            yield name, declared_key if declared_key.needs != name else dataclasses.replace(declared_key, needs=None)


def get_key(config: typing.Any, dotted: str) -> typing.Any:
    """The value of "section.key" or "section.table.key"."""
    return functools.reduce(getattr, dotted.split("."), config)


def check_declared(config: typing.Any, accepted: frozenset[str] = frozenset()) -> None:
    """What the keys declare: a refused key keeps its default unless the caller implements it
    (`accepted`), a key with choices holds one of them, a bounded key keeps its bound."""
    defaults = type(config)()
    for name, facts in declared(type(config)).items():
        value = get_key(config, name)
        if facts.refused and name not in accepted and value != get_key(defaults, name):
            raise ConfigError(f"config key {name} = {value!r}: {facts.refused}")
        if facts.choices is not None:
            if isinstance(value, list):
                unknown = sorted(set(value) - set(facts.choices))
                if unknown:
                    raise ConfigError(f"config key {name}: {unknown} not in {list(facts.choices)}")
            elif value not in facts.choices and not (value is None and get_key(defaults, name) is None):  # None: unset
                raise ConfigError(f"config key {name}: {value!r} is not one of {list(facts.choices)}")
        if facts.bound is not None:
            holds, message = BOUNDS[facts.bound]
            if value is not None and not holds(value):
                raise ConfigError(f"config key {name}: {message.format(value)}")
