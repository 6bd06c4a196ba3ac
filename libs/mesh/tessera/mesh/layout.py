"""The world mesh and its named meshes, described from the parallel degrees alone.

A job planner, `--check` and memory estimates need to know which ranks each parallelism spans
before any process group exists; build_meshes builds exactly what this describes.
"""

from __future__ import annotations

import dataclasses
import math

from tessera.mesh.parallel_dims import MESH_ORDER, ParallelDims

# Under expert parallelism dp_shard is two world dims, so the ep group (dp_shard_in_ep x cp) and
# the expert-FSDP group (dp_shard_mod_ep) are real sub-meshes, as in torchtitan 0.2.
_EP_SPLIT = {"dp_shard": ("dp_shard_mod_ep", "dp_shard_in_ep")}

# Named 1-D meshes spanning several dims, each as the dims it spans: "dp_shard" (its two parts
# joined again under ep), "dp" shards the data loader's batches, "dp_shard_cp" is what FSDP shards
# parameters over (cp ranks hold the same weights), "dp_cp" averages the loss and gradient norm,
# "ep" exchanges tokens between expert holders (and spans tp too when dims.ep_spans_tp).
_FLATTENED = {
    "dp_shard": ("dp_shard",),
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "ep": ("dp_shard_in_ep", "cp"),
}

# The keys of the Meshes mapping: what build_meshes returned as a dict before it had accessors.
MAPPING_KEYS = ("world", *MESH_ORDER, "dp", "dp_shard_cp", "dp_cp")

ACCESSORS = ("world", "batch", "loss", "fsdp", "dp_replicate", "tp", "pp", "cp", "ep", "expert_fsdp")


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """The world mesh's dims and, for each named mesh, the world dims it spans.

    `groups`: every 1-D mesh build_meshes keeps (each holds a process group), by name, as the
    world dims it flattens; a world dim is its own group. `accessors`: each enabled accessor of
    Meshes as the groups that are its mesh dims, outermost first; a disabled one is absent.
    """

    world: tuple[tuple[str, int], ...]
    groups: tuple[tuple[str, tuple[str, ...]], ...]
    accessors: tuple[tuple[str, tuple[str, ...]], ...]

    @property
    def dim_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.world)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(degree for _, degree in self.world)

    @property
    def mapping_keys(self) -> tuple[str, ...]:
        """The keys of the Meshes mapping for these degrees."""
        return tuple(key for key in MAPPING_KEYS if key == "world" or key in dict(self.groups))

    def spans(self, accessor: str) -> tuple[tuple[str, ...], ...] | None:
        """The world dims under each mesh dim of an accessor; None when it is off."""
        if accessor == "world":
            return tuple((name,) for name in self.dim_names)
        axes = dict(self.accessors).get(accessor)
        groups = dict(self.groups)
        return None if axes is None else tuple(groups[axis] for axis in axes)

    def shape_of(self, accessor: str) -> tuple[int, ...] | None:
        """The accessor's mesh shape; None when it is off."""
        spans = self.spans(accessor)
        degrees = dict(self.world)
        return None if spans is None else tuple(math.prod(degrees[d] for d in span) for span in spans)

    def size(self, accessor: str) -> int:
        """How many ranks the accessor's mesh holds; 1 when it is off."""
        return math.prod(self.shape_of(accessor) or (1,))

    def describe(self) -> str:
        """One line for `--check`: the world mesh, then each enabled accessor's dims and sizes."""
        world = ", ".join(f"{name}={degree}" for name, degree in self.world)
        named = " ".join(f"{name}={self._describe(name)}" for name, _ in self.accessors)
        return f"world ({world})" + (f"; {named}" if named else "")

    def _describe(self, accessor: str) -> str:
        axes = [f"{'*'.join(span)}[{size}]" for span, size in zip(self.spans(accessor), self.shape_of(accessor))]
        return axes[0] if len(axes) == 1 else f"({','.join(axes)})"


def _parts(dims: ParallelDims, name: str) -> tuple[str, ...]:
    """The world dims a parallel dim becomes: itself, or dp_shard's two parts under ep."""
    return _EP_SPLIT.get(name, (name,)) if dims.ep_enabled else (name,)


def world_dims(dims: ParallelDims) -> dict[str, int]:
    """The world mesh's dims and degrees in mesh order: dims with degree > 1, dp_shard split under ep.

    dp_shard_mod_ep stays even at degree 1 so experts always have an FSDP mesh (their weights must
    not be averaged with other ep ranks'); a 1-rank world keeps a single dp_shard dim.
    """
    degrees = {part: getattr(dims, part) for name in MESH_ORDER for part in _parts(dims, name)}
    kept = {name: degree for name, degree in degrees.items() if degree > 1 or name == "dp_shard_mod_ep"}
    return kept or {"dp_shard": 1}


def mesh_dim_names(dims: ParallelDims) -> tuple[str, ...]:
    return tuple(world_dims(dims))


def mesh_shape(dims: ParallelDims) -> tuple[int, ...]:
    return tuple(world_dims(dims).values())


def _spanned(dims: ParallelDims, names: tuple[str, ...]) -> tuple[str, ...]:
    """The world dims that split ranks within `names` (a 1-rank world's lone dim counts)."""
    world = world_dims(dims)
    active = {name for name, degree in world.items() if degree > 1} or set(world)
    return tuple(part for name in names for part in _parts(dims, name) if part in active)


def _flattened(dims: ParallelDims, name: str) -> tuple[str, ...]:
    return (*_FLATTENED[name], "tp") if name == "ep" and dims.ep_spans_tp else _FLATTENED[name]


def flattened_dims(dims: ParallelDims) -> dict[str, tuple[str, ...]]:
    """The flattened meshes "dp", "dp_shard_cp" and "dp_cp", each as the world dims it spans."""
    return {name: _spanned(dims, _FLATTENED[name]) for name in ("dp", "dp_shard_cp", "dp_cp")}


def _accessor_groups(dims: ParallelDims) -> dict[str, tuple[str, ...]]:
    """Each enabled accessor as the groups that are its mesh dims.

    Under HSDP the FSDP meshes are 2-D so FSDP replicates over dp_replicate and shards inside it.
    """
    replicate = ("dp_replicate",) if dims.dp_replicate > 1 else ()
    wanted = {
        "batch": (dims.dp > 1, ("dp",)),
        "loss": (dims.dp * dims.cp > 1, ("dp_cp",)),
        "fsdp": (dims.dp_shard * dims.cp > 1, (*replicate, "dp_shard_cp")),
        "dp_replicate": (dims.dp_replicate > 1, ("dp_replicate",)),
        "tp": (dims.tp_enabled, ("tp",)),
        "pp": (dims.pp_enabled, ("pp",)),
        "cp": (dims.cp_enabled, ("cp",)),
        "ep": (dims.ep_enabled, ("ep",)),
        "expert_fsdp": (dims.ep_enabled, (*replicate, "dp_shard_mod_ep")),
    }
    return {name: groups for name, (enabled, groups) in wanted.items() if enabled}


def mesh_layout(dims: ParallelDims) -> MeshLayout:
    """What build_meshes builds for these degrees, without touching torch.distributed.

    Only groups that a mapping key or an enabled accessor uses are kept: each costs a process group.
    """
    world = world_dims(dims)
    accessors = _accessor_groups(dims)
    used = {*MAPPING_KEYS, *(group for groups in accessors.values() for group in groups)}
    candidates = {name: (name,) for name in world}
    for name in _FLATTENED:
        candidates.setdefault(name, _spanned(dims, _flattened(dims, name)))
    return MeshLayout(
        world=tuple(world.items()),
        groups=tuple((name, parts) for name, parts in candidates.items() if parts and name in used),
        accessors=tuple(accessors.items()),
    )
