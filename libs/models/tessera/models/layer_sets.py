"""Sets of layer indices a family's args name (window layers, NoPE layers, MoE layers): checked
once here, and cut to the model's depth, so that a model cut to its first layers
(``dataclasses.replace(args, n_layers=n)``, as the estimator's traces cut it) keeps their pattern."""


def kept_layers(args, name: str) -> None:
    """``args.<name>`` (a frozen dataclass field) checked to be increasing layer indices and cut
    to those below ``args.n_layers``; anything else is a ValueError naming the field."""
    layers = getattr(args, name)
    if list(layers) != sorted(set(layers)) or not all(isinstance(i, int) and i >= 0 for i in layers):
        raise ValueError(f"{type(args).__name__}: {name}={layers} are not increasing layer indices")
    object.__setattr__(args, name, tuple(i for i in layers if i < args.n_layers))
