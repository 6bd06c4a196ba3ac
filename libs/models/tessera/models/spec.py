"""Registry of model specs: what the trainer and the parallelism libraries need to know
about a model family, so a custom model plugs in by registering its own spec."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """A model family.

    name: registry key, e.g. "llama3".
    flavors: flavor name -> args (a dataclass the trainer can ``dataclasses.replace``
        ``max_seq_len`` and ``vocab_size`` on).
    build: args -> nn.Module. Must work under ``torch.device("meta")``; the module offers
        ``init_weights(buffer_device=None)`` to initialise after ``to_empty``.
    flops_per_token: (args, seq_len) -> training FLOPs per token (forward + backward).
    tp_plan: module-path pattern ("*" stands for the layer index) -> a role name. tessera.tp owns
        the role names and their meaning (its ``DEFAULT_STYLES``; other libraries add roles), and
        the trainer's job plan refuses a role nobody gives a style. tessera.tp's roles:
        "vocab_embedding" (embedding sharded on vocab), "vocab_output" (output projection
        sharded on vocab), "norm" (sequence-parallel norm), "block_input" (a module whose first
        positional input gets redistributed), "colwise", "rowwise".
    tp_divisible: args -> {quantity name: value} that a tensor-parallel degree must divide.
    hf_adapter: object with ``to_hf(state_dict, args)`` and ``from_hf(state_dict, args)``
        converting state dicts to and from Hugging Face names, or None.
    """

    name: str
    flavors: Mapping[str, Any]
    build: Callable[[Any], nn.Module]
    flops_per_token: Callable[[Any, int], float]
    tp_plan: Mapping[str, str]
    tp_divisible: Callable[[Any], dict[str, int]]
    hf_adapter: Any = None


_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    """Add ``spec`` under ``spec.name``; a taken name is a ValueError."""
    if spec.name in _REGISTRY:
        raise ValueError(f"model spec {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; registered: {list_model_specs()}") from None


def list_model_specs() -> list[str]:
    return sorted(_REGISTRY)


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of parameters (shared ones once); ``exclude_embedding`` leaves out every
    ``nn.Embedding`` weight (and so a weight tied to it)."""
    params = {id(p): p.numel() for p in model.parameters()}
    if exclude_embedding:
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                params.pop(id(module.weight), None)
    return sum(params.values())
