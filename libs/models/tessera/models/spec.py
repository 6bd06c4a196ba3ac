"""Registry of model specs: what the trainer and the parallelism libraries need to know
about a model family, so a custom model plugs in by registering its own spec."""

import dataclasses
import json
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from tessera.models.masks import CAUSAL, AttentionMask


def _no_loss_scale(model: nn.Module, scale: float, tp: int) -> None:
    pass


def _no_step(model: nn.Module, group: Any) -> dict:
    return {}


def _no_force(model: nn.Module) -> None:
    pass


def _no_mtp_scale(model: nn.Module, scale: float) -> None:
    pass


def _no_capacity(model: nn.Module, factor: float | None, overflow: str) -> None:
    pass


@dataclass(frozen=True)
class RunLayout:
    """What a family may refuse a run for (``ModelSpec.refusals``): the parallel degrees, the
    device and the wrappers the job plan resolved."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    dp: int = 1
    compile: bool = False
    device: str = "cpu"


def _no_refusals(args, layout: RunLayout) -> tuple[tuple[str, str], ...]:
    return ()


def _causal_layers(args) -> tuple[tuple[AttentionMask, bool], ...]:
    return ((CAUSAL, False),)


@dataclass(frozen=True)
class StepHooks:
    """A family's part in each training step, for state outside the parameters (MoE routers).

    set_loss_scale(model, scale, tp): once after building; ``scale`` is the factor the trainer
        applies to each micro-batch's loss before backward (1 / micro-batches per step), for
        losses the model adds inside its forward (the MoE sequence-wise balance loss); ``tp`` the
        tensor-parallel degree: under tessera.tp's share convention each rank's backward gives
        its share of a gradient, so a loss the family computes whole on every tp rank takes
        scale / tp. The family knows which of its losses are whole; the trainer does not.
    after_optimizer_step(model, group) -> {name: tensor}: after every optimizer step, on every
        rank, for the model or each pipeline stage; ``group`` spans the ranks that see different
        tokens (data and context parallel; None alone). Returns readings for metrics (MoE: each
        layer's tokens per expert; with a capacity factor also ``<layer>/dropped``, the slots it
        dropped, [] long), read by the trainer at log steps only.
    force_load_balance(model): a debugging switch for benchmarks: MoE routers send tokens to
        experts round-robin, so every expert gets the same load.
    set_mtp_scale(model, scale): once after building, for a model with multi-token prediction
        (``ModelSpec.mtp_layers``): the factor its loss (the mean over the depths) gets in
        backward, the MTP weight (torchtitan's ``loss.mtp_scale``) times the factor the trainer
        applies to each micro-batch's loss. That loss is computed as the main one is (under
        tensor parallel, loss-parallel logits), so it takes no division by tp.
    set_expert_capacity(model, factor, overflow): once after building: MoE layers dispatch with
        a capacity of ``factor`` times their even share of the routed slots per expert (static
        shapes; ``overflow`` "drop" or "reroute" says what becomes of the slots over it), or
        dropless with ``factor`` None.
    """

    set_loss_scale: Callable[[nn.Module, float, int], None] = _no_loss_scale
    after_optimizer_step: Callable[[nn.Module, Any], dict] = _no_step
    force_load_balance: Callable[[nn.Module], None] = _no_force
    set_mtp_scale: Callable[[nn.Module, float], None] = _no_mtp_scale
    set_expert_capacity: Callable[[nn.Module, float | None, str], None] = _no_capacity


NO_STEP_HOOKS = StepHooks()


@dataclass(frozen=True)
class ModelSpec:
    """A model family.

    name: registry key, e.g. "llama3".
    flavors: flavor name -> args (a dataclass the trainer can ``dataclasses.replace``
        ``max_seq_len`` and ``vocab_size`` on, whose fields are JSON values or such dataclasses:
        checkpoints record them, ``args_record``).
    build: args -> nn.Module. Must work under ``torch.device("meta")``; the module offers
        ``init_weights(buffer_device=None)`` to initialise after ``to_empty``.
    flops_per_token: (args, seq_len) -> training FLOPs per token (forward + backward).
    tp_plan: module-path pattern ("*" stands for the layer index) -> a role name. tessera.tp owns
        the role names and their meaning (its ``DEFAULT_STYLES``; other libraries add roles), and
        the trainer's job plan refuses a role nobody gives a style. tessera.tp's roles:
        "vocab_embedding" (embedding sharded on vocab), "vocab_output" (output projection
        sharded on vocab), "norm" (sequence-parallel norm), "block_input" (a module whose first
        positional input gets redistributed), "colwise", "rowwise", "replicated" (run whole on
        every rank), "head_norm" (a norm over the local heads), "local" (parameters split on the
        dims the module declares in ``tp_shard_dims``: attention sinks), "experts",
        "partial_region", "partial_colwise", "rowwise_partial" (an MoE layer: ``tessera.models.moe.moe_tp_plan``).
    tp_divisible: args -> {quantity name: value} that a tensor-parallel degree must divide.
    hf_adapter: object with ``to_hf(state_dict, args)`` and ``from_hf(state_dict, args)``
        converting state dicts to and from Hugging Face names, or None. A family whose tensors
        stack several HF tensors on dim 0 (MoE experts) adds ``stacked_slice(hf_name, args)`` ->
        (key, index) or None, so that a streaming import places them one at a time; one whose
        ``to_hf`` fuses several model tensors into one HF tensor (Llama 4's experts) adds
        ``export_group(key, args)`` -> the fused tensor's name or None, so that a streaming
        export hands them over together; one whose ``from_hf`` dequantises adds
        ``quantized_formats`` (e.g. ("mxfp4",), transformers' quant_method names), which lets a
        trainer load a quantized checkpoint; a format that cannot hold all of the trained state
        adds ``export_note(args)`` -> one line saying what an export loses, or None, which
        exporters print.
    hf_config: object turning a Hugging Face ``config.json`` dict into args and back, or None:
        ``args_from_config(config, source)``, ``config_from_args(args, *, dtype=None,
        bos_token_id=None, eos_token_id=None)``, and ``check_config(args, config, source, target)``
        raising a ValueError that names the first field where they differ.
    step_hooks: what a training loop calls on the family's models every step (``StepHooks``);
        the default does nothing.
    n_experts: args -> routed experts per MoE layer (0: a dense model), held by modules under
        the attribute name ``experts`` that follow the expert seam (``tessera.models.moe``);
        expert parallelism splits them.
    refusals: (args, RunLayout) -> ((what, why), ...): layouts the family cannot train and why
        (MLA under context parallel); a job plan stops on the first with one line
        "<what> is not supported yet for <model>/<flavor>: <why>".
    mtp_layers: args -> multi-token-prediction modules (0: none), the last blocks of ``layers``.
        With any, the model's forward takes the micro-batch's next-token labels as ``labels=``
        ([B, T]) in training and adds their loss to the gradients itself, at the scale
        ``StepHooks.set_mtp_scale`` gives; a pipeline keeps those blocks on its last stage.
    attention_kinds: args -> the distinct (mask, has sinks) pairs of the model's layers
        (``tessera.models.attention.InnerAttention``'s mask and sinks), so a job plan chooses
        kernels and the context-parallel exchange without building the model; default: plain
        causal attention without sinks everywhere.
    with_context: (args, max_seq_len) -> the same model stated for another context length
        (what a trained model's records state: the architecture's length, not the run's);
        default: ``dataclasses.replace``. A family whose positions depend on the length (DeepSeek's
        YaRN above the original context) fixes them first.
    """

    name: str
    flavors: Mapping[str, Any]
    build: Callable[[Any], nn.Module]
    flops_per_token: Callable[[Any, int], float]
    tp_plan: Mapping[str, str]
    tp_divisible: Callable[[Any], dict[str, int]]
    hf_adapter: Any = None
    hf_config: Any = None
    step_hooks: "StepHooks" = dataclasses.field(default_factory=lambda: NO_STEP_HOOKS)
    n_experts: Callable[[Any], int] = lambda args: 0
    mtp_layers: Callable[[Any], int] = lambda args: 0
    attention_kinds: Callable[[Any], tuple[tuple[AttentionMask, bool], ...]] = _causal_layers
    refusals: Callable[[Any, RunLayout], tuple[tuple[str, str], ...]] = _no_refusals
    with_context: Callable[[Any, int], Any] = lambda args, max_seq_len: dataclasses.replace(args, max_seq_len=max_seq_len)


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


def hf_export_note(spec: ModelSpec, args) -> str | None:
    """The family's line on what a Hugging Face export of ``args`` loses (``hf_adapter.export_note``),
    or None."""
    note = getattr(spec.hf_adapter, "export_note", None)
    return note(args) if note is not None else None


ARGS_FILE = "model_args.json"


def args_record(spec: ModelSpec, args, **extra) -> bytes:
    """``model_args.json`` for weights saved beside it: the spec's name, the args (nested
    dataclasses as objects) and ``extra`` JSON-able values (flavor, token ids), so a tool can
    rebuild the model without being told its shape."""
    return (json.dumps({"model": spec.name, "args": dataclasses.asdict(args), **extra}, indent=2) + "\n").encode()


def read_args_record(folder: str | os.PathLike) -> tuple[ModelSpec, Any, dict] | None:
    """(spec, args, the whole record) from ``<folder>/model_args.json``, or None when the folder
    has none. A malformed record or an unregistered model is a ValueError naming the file."""
    path = Path(folder) / ARGS_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        spec = get_model_spec(record["model"])
        return spec, _dataclass_from_dict(type(next(iter(spec.flavors.values()))), record["args"]), record
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a model args record: {e!r}") from None
    except ValueError as e:  # an unregistered model, args the model refuses
        raise ValueError(f"{path}: {e}") from None


def _is_a(value, hint) -> bool:
    """Whether a JSON value holds what a field's type hint says (an int for a float, a list for a
    tuple), so that a hand-edited record fails here, not inside the model."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is_a(value, option) for option in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        element = typing.get_args(hint)[0]
        return isinstance(value, list) and all(_is_a(item, element) for item in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (type(None), bool, str):
        return isinstance(value, hint)
    return True  # a field type the records do not constrain here


def _type_text(hint) -> str:
    """A field's type as a reader says it: "an int or null", "a list of int"."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_text(option) for option in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"a list of {_type_text(typing.get_args(hint)[0]).split(' ', 1)[1]}"
    return {int: "an int", float: "a number", bool: "true or false", str: "a string",
            type(None): "null"}.get(hint, getattr(hint, "__name__", str(hint)))


def _dataclass_from_dict(cls: type, data: dict) -> Any:
    """``cls(**data)`` with nested dataclass fields rebuilt from their dicts and tuple fields from
    their JSON lists."""
    if not isinstance(data, dict):
        raise ValueError(f"{data!r} is not an object of {cls.__name__} fields")
    hints = typing.get_type_hints(cls)
    known = {field.name for field in dataclasses.fields(cls) if field.init}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a field of {cls.__name__}")
    values = {}
    for name, value in data.items():
        nested = [t for t in typing.get_args(hints[name]) or (hints[name],) if dataclasses.is_dataclass(t)]
        if nested and value is not None:
            value = _dataclass_from_dict(nested[0], value)
        elif not _is_a(value, hints[name]):
            raise ValueError(f"{cls.__name__}.{name} {value!r} is not {_type_text(hints[name])}")
        elif isinstance(value, list) and typing.get_origin(hints[name]) is tuple:
            value = tuple(value)
        values[name] = value
    try:
        return cls(**values)
    except TypeError as e:
        raise ValueError(str(e)) from None
