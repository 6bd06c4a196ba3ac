"""Names of a model's modules and parameters as its state dict has them."""

# modules that activation checkpointing and torch.compile put around a block: not in the names
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def unwrapped_name(name: str) -> str:
    """A module's or parameter's name in the plain model, whatever wraps its block."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name
