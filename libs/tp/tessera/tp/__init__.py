"""Tessera tensor + sequence parallelism: a role-based plan applied with ``parallelize_module``."""

from tessera.tp.async_tp import enable_async_tp
from tessera.tp.degree import check_tp_degree
from tessera.tp.loss import loss_parallel_context
from tessera.tp.plan import DEFAULT_STYLES, ROLES, Layouts, StyleFactory, apply_tp, resolve_plan, styles_with

__all__ = [
    "DEFAULT_STYLES",
    "ROLES",
    "Layouts",
    "StyleFactory",
    "apply_tp",
    "check_tp_degree",
    "enable_async_tp",
    "loss_parallel_context",
    "resolve_plan",
    "styles_with",
]
