"""Parallel-dimension arithmetic: how the world splits into pp x dp_replicate x dp_shard x cp x tp."""

from __future__ import annotations

import dataclasses

# Mesh dimension order, outermost first: pipeline stages talk least often, tensor parallel most,
# so tp ranks are adjacent (same node) and pp ranks are farthest apart.
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees of every parallel dimension; their product is the world size.

    Expert parallelism does not add ranks: an ep group is all of cp and part of dp_shard
    (dp_shard = dp_shard_mod_ep x dp_shard_in_ep, ep = dp_shard_in_ep x cp), and all of tp too
    when ``ep_spans_tp`` (torchtitan's expert_tensor_parallel_degree 1; otherwise each expert is
    split over tp and the ep group is ranks of equal tp index).
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    ep_spans_tp: bool = False

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards over dp_shard x cp: context-parallel ranks hold the same weights and must
        average their gradients, so cp alone turns FSDP on (as in torchtitan)."""
        return self.dp_shard * self.cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_shard_in_ep(self) -> int:
        """The part of dp_shard inside one ep group: ep takes all of cp and this much of dp_shard."""
        return self.ep // (self.cp * (self.tp if self.ep_spans_tp else 1)) if self.ep_enabled else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        """The dp_shard ranks that hold the same experts, so expert weights are FSDP-sharded over them."""
        return self.dp_shard // self.dp_shard_in_ep

    def degrees(self) -> dict[str, int]:
        """Degree of each mesh dimension, in mesh order."""
        return {name: getattr(self, name) for name in MESH_ORDER}


def _check_degree(name: str, value: object, allow_rest: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"parallel degree {name}={value!r} must be an integer")
    if value >= 1 or (allow_rest and value == -1):
        return value
    rest = " or -1 (the rest of the world)" if allow_rest else ""
    raise ValueError(f"parallel degree {name}={value} must be >= 1{rest}")


def resolve_parallel_dims(
    world_size: int,
    *,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    cp: int = 1,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    ep_spans_tp: bool = False,
) -> ParallelDims:
    """Validates the degrees against world_size and fills dp_shard=-1 with what is left.
    ``ep_spans_tp``: the ep group takes all tp ranks too (kept only when ep and tp are > 1)."""
    world_size = _check_degree("world_size", world_size)
    dp_replicate = _check_degree("dp_replicate", dp_replicate)
    dp_shard = _check_degree("dp_shard", dp_shard, allow_rest=True)
    cp, tp, pp, ep = (_check_degree(n, v) for n, v in (("cp", cp), ("tp", tp), ("pp", pp), ("ep", ep)))

    others = dp_replicate * cp * tp * pp
    if dp_shard == -1:
        if world_size % others:
            raise ValueError(
                f"world size {world_size} is not divisible by dp_replicate*cp*tp*pp = "
                f"{dp_replicate}*{cp}*{tp}*{pp} = {others}, so dp_shard=-1 cannot fill the rest"
            )
        dp_shard = world_size // others
    product = others * dp_shard
    if product != world_size:
        raise ValueError(
            f"dp_replicate*dp_shard*cp*tp*pp = {dp_replicate}*{dp_shard}*{cp}*{tp}*{pp} = {product} "
            f"does not equal the world size {world_size}"
        )
    ep_spans_tp = ep_spans_tp and ep > 1 and tp > 1
    taken, names = (cp * tp, "cp*tp") if ep_spans_tp else (cp, "cp")
    if ep > 1 and ep % taken:
        raise ValueError(f"ep={ep} must be a multiple of {names}={taken}: an ep group takes all {names} ranks and part of dp_shard")
    if (dp_shard * taken) % ep:
        raise ValueError(f"ep={ep} must divide dp_shard*{names} = {dp_shard}*{taken} = {dp_shard * taken}")
    return ParallelDims(dp_replicate, dp_shard, cp, tp, pp, ep, world_size, ep_spans_tp)


def data_parallel_rank_and_size(dims: ParallelDims, rank: int) -> tuple[int, int]:
    """This rank's index in the dp group and the dp group size, from the global rank alone.

    Needed before a mesh exists (e.g. to shard the data loader) and matches the mesh layout:
    ranks are laid out row-major over MESH_ORDER, an order that splitting dp_shard for expert
    parallelism keeps.
    """
    coords = {}
    remaining = rank
    for name in reversed(MESH_ORDER):
        degree = getattr(dims, name)
        coords[name] = remaining % degree
        remaining //= degree
    return coords["dp_replicate"] * dims.dp_shard + coords["dp_shard"], dims.dp
