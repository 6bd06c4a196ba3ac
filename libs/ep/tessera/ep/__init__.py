"""tessera.ep: expert parallelism — each rank of an ep group holds a slice of every MoE layer's
routed experts, and tokens travel to their experts and back by all-to-all."""

from tessera.ep.degrees import check_ep_degree
from tessera.ep.dispatch import Exchange, combine, combine_equal, dispatch, dispatch_equal, plan_exchange
from tessera.ep.experts import apply_ep, find_experts

__all__ = ["Exchange", "apply_ep", "check_ep_degree", "combine", "combine_equal", "dispatch", "dispatch_equal",
           "find_experts", "plan_exchange"]
