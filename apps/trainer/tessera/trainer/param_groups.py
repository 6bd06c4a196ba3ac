"""Which optimizer, weight decay and lr each parameter gets, from [optimizer]'s param_groups and
Muon's split, decided by the job plan on the meta model (so every error is raised there) and
looked up by name when each model part builds its optimizers.

An entry of optimizer.param_groups is a list of selectors and settings, e.g. ["norms", "biases",
"weight_decay=0"] (on the command line "norms,biases,weight_decay=0;output,lr_scale=0.5"); a
setting left out is optimizer.weight_decay, or lr_scale 1. A selector is a role below or a
name pattern with '*' wildcards; a parameter joins the first entry that selects it, else the
default group (torchtitan's single group when there are no entries). Under Muon every group
splits into the matrices Muon steps and the rest (1-D parameters, optimizer.muon_exclude),
which AdamW steps with the same settings.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Callable

import torch
from torch import nn

from tessera import tp
from tessera.models import ModelSpec, unwrapped_name
from tessera.trainer.errors import ConfigError
from tessera.trainer.sub_plans import ParamGroup

SETTINGS = ("weight_decay", "lr_scale")
_NORMS = (nn.RMSNorm, nn.LayerNorm, nn.GroupNorm)


def _roles(model: nn.Module, spec: ModelSpec) -> dict[str, Callable[[str], bool]]:
    """Role name -> does it select this parameter name. Norms and embeddings are module types;
    output is the module the family's tensor-parallel plan shards on vocab; experts and router
    are the attribute names of the MoE seam (tessera.models.moe)."""
    modules = dict(model.named_modules())
    owner = {name: name.rpartition(".")[0] for name, _ in model.named_parameters()}
    outputs = {path for path, role in tp.resolve_plan(model, spec.tp_plan, set(spec.tp_plan.values()), missing_ok=True).items()
               if role == "vocab_output"}

    def of_type(types):
        return lambda name: isinstance(modules[owner[name]], types)

    return {
        "norms": of_type(_NORMS),
        "biases": lambda name: name.rpartition(".")[2] == "bias",
        "embeddings": of_type(nn.Embedding),
        "output": lambda name: owner[name] in outputs,
        "experts": lambda name: "experts" in name.split(".")[:-1],
        "router": lambda name: "router" in name.split(".")[:-1],
    }


def _selector(text: str, roles: dict[str, Callable[[str], bool]], key: str) -> Callable[[str], bool]:
    if text in roles:
        return roles[text]
    if "*" in text or "." in text:
        return lambda name: fnmatch.fnmatchcase(name, text)
    raise ConfigError(f"{key}: {text!r} is neither a role ({', '.join(roles)}) nor a name pattern (with '*' or '.')")


def _parse(entry: list[str], default_decay: float) -> tuple[list[str], dict[str, float]]:
    key = f"optimizer.param_groups {entry}"
    selectors = [item for item in entry if "=" not in item]
    if not selectors:
        raise ConfigError(f"{key}: names no selector (a role or a name pattern) before its settings")
    settings = {"weight_decay": default_decay, "lr_scale": 1.0}
    for item in (item for item in entry if "=" in item):
        name, _, value = (part.strip() for part in item.partition("="))
        if name not in SETTINGS:
            raise ConfigError(f"{key}: {item!r} is not one of {', '.join(f'{s}=<number>' for s in SETTINGS)}")
        try:
            settings[name] = float(value)
        except ValueError:
            raise ConfigError(f"{key}: {name} {value!r} is not a number") from None
        if settings[name] < 0:
            raise ConfigError(f"{key}: {name} must be >= 0")
    return selectors, settings


def resolve_groups(opt, meta_model: Callable[[], nn.Module], spec: ModelSpec,
                   flavor: str) -> tuple[tuple[ParamGroup, ...], list[str]]:
    """The groups of every parameter of the model (meta_model() builds it on the meta device,
    only when there are entries or Muon), and warnings for selectors that select nothing. An
    entry that selects nothing (every parameter it names already taken) is refused: it would
    change nothing."""
    if not opt.param_groups and opt.name != "Muon":
        return (ParamGroup("default", "adamw", opt.weight_decay, 1.0, None),), []
    model = meta_model()
    roles, warnings = _roles(model, spec), []
    shapes = {name: p.ndim for name, p in model.named_parameters()}
    unclaimed = list(shapes)
    chosen: list[tuple[str, dict[str, float], list[str]]] = []
    for entry in opt.param_groups:
        selectors, settings = _parse(entry, opt.weight_decay)
        tests = [_selector(s, roles, f"optimizer.param_groups {entry}") for s in selectors]
        warnings += [f"optimizer.param_groups {entry}: {s!r} selects no parameter of {flavor}"
                     for s, test in zip(selectors, tests) if not any(map(test, shapes))]
        names = [name for name in unclaimed if any(test(name) for test in tests)]
        if not names:
            raise ConfigError(f"optimizer.param_groups {entry} selects no parameter of {flavor} that an earlier entry "
                              "has not taken")
        chosen.append((",".join(entry), settings, names))
        taken = set(names)
        unclaimed = [name for name in unclaimed if name not in taken]
    if unclaimed:
        chosen.append(("default", {"weight_decay": opt.weight_decay, "lr_scale": 1.0}, unclaimed))

    muon = set()
    if opt.name == "Muon":
        excluded = [_selector(s, roles, "optimizer.muon_exclude") for s in opt.muon_exclude]
        warnings += [f"optimizer.muon_exclude: {s!r} selects no parameter of {flavor}"
                     for s, test in zip(opt.muon_exclude, excluded) if not any(map(test, shapes))]
        muon = {name for name in shapes if shapes[name] >= 2 and not any(test(name) for test in excluded)}
    groups = []
    for label, settings, names in chosen:
        for algorithm, members in (("adamw", [n for n in names if n not in muon]), ("muon", [n for n in names if n in muon])):
            if members:
                groups.append(ParamGroup(label, algorithm, settings["weight_decay"], settings["lr_scale"], tuple(members)))
    return tuple(groups), warnings


def part_groups(part: nn.Module, groups: tuple[ParamGroup, ...]) -> list[tuple[ParamGroup, list[torch.Tensor]]]:
    """The groups this model part (the model, or a pipeline stage) holds parameters of, with them."""
    index = {name: i for i, group in enumerate(groups) for name in group.names or ()}
    rest = next((i for i, group in enumerate(groups) if group.names is None), None)
    members: dict[int, list[torch.Tensor]] = {}
    for name, param in part.named_parameters():
        i = index.get(unwrapped_name(name), rest)
        if i is None:
            raise RuntimeError(f"parameter {name} is in no optimizer group: the job plan saw another model")
        members.setdefault(i, []).append(param)
    return [(groups[i], members[i]) for i in sorted(members)]


def signature(groups: tuple[ParamGroup, ...]) -> list[list]:
    """What a checkpoint records of the grouping: a resume must find the same (optimizer state is
    stored per parameter, and its group settings would silently stay the checkpoint's)."""
    return [[g.label, g.algorithm, g.weight_decay, g.lr_scale, "all" if g.names is None else len(g.names),
             "" if g.names is None else hashlib.sha256(",".join(g.names).encode()).hexdigest()[:16]] for g in groups]
