"""Tessera tensor + sequence parallelism: a role-based plan applied with ``parallelize_module``."""

from tessera.tp.async_tp import enable_async_tp
from tessera.tp.degree import check_tp_degree
from tessera.tp.local import ColwiseFromShare, LocalShards, PartialRegion, local_share, replicated_as_share
from tessera.tp.loss import loss_parallel_context
from tessera.tp.plan import DEFAULT_STYLES, ROLES, Layouts, StyleFactory, apply_tp, resolve_plan, styles_with

__all__ = [
    "ColwiseFromShare",
    "DEFAULT_STYLES",
    "ROLES",
    "Layouts",
    "LocalShards",
    "PartialRegion",
    "StyleFactory",
    "apply_tp",
    "check_tp_degree",
    "enable_async_tp",
    "local_share",
    "loss_parallel_context",
    "replicated_as_share",
    "resolve_plan",
    "styles_with",
]
