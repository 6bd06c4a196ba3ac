import pytest

from tessera.mesh import (
    data_parallel_rank_and_size,
    flattened_dims,
    mesh_dim_names,
    mesh_shape,
    resolve_parallel_dims,
)


def test_dp_shard_fills_the_rest():
    dims = resolve_parallel_dims(16, dp_replicate=2, tp=2, pp=2)
    assert dims.dp_shard == 2
    assert dims.dp == 4
    assert mesh_dim_names(dims) == ("pp", "dp_replicate", "dp_shard", "tp")
    assert mesh_shape(dims) == (2, 2, 2, 2)
    assert dims.hsdp_enabled and dims.fsdp_enabled and dims.tp_enabled and dims.pp_enabled
    assert not dims.cp_enabled and not dims.ep_enabled


def test_single_process_is_one_dp_shard():
    dims = resolve_parallel_dims(1)
    assert dims.degrees() == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
    assert mesh_dim_names(dims) == ("dp_shard",)
    assert not dims.dp_enabled


def test_flattened_dims_name_only_active_dims():
    dims = resolve_parallel_dims(8, dp_shard=2, cp=2, tp=2)
    assert flattened_dims(dims) == {
        "dp": ("dp_shard",),
        "dp_shard_cp": ("dp_shard", "cp"),
        "dp_cp": ("dp_shard", "cp"),
    }
    assert flattened_dims(resolve_parallel_dims(2, tp=2))["dp"] == ()


@pytest.mark.parametrize(
    "world, kwargs, message",
    [
        (8, dict(dp_replicate=3), "not divisible by dp_replicate*cp*tp*pp"),
        (8, dict(dp_shard=2, tp=2), "does not equal the world size 8"),
        (4, dict(tp=0), "tp=0 must be >= 1"),
        (4, dict(dp_shard=-2), "dp_shard=-2 must be >= 1 or -1"),
        (4, dict(pp=1.5), "pp=1.5 must be an integer"),
        (4, dict(ep=3), "ep=3 must divide dp_shard*cp"),
        (8, dict(dp_shard=2, cp=4, ep=2), "ep=2 must be a multiple of cp=4"),
        (8, dict(dp_shard=2, tp=4, ep=2, ep_spans_tp=True), "ep=2 must be a multiple of cp*tp=4"),
        (4, dict(tp=2, ep=8, ep_spans_tp=True), "ep=8 must divide dp_shard*cp*tp = 2*2 = 4"),
        (0, dict(), "world_size=0"),
    ],
)
def test_errors_name_the_culprit(world, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")):
        resolve_parallel_dims(world, **kwargs)


def test_expert_parallel_borrows_from_dp_shard_and_cp():
    dims = resolve_parallel_dims(8, dp_shard=4, cp=2, ep=8)
    assert dims.ep == 8 and dims.world_size == 8
    assert (dims.dp_shard_mod_ep, dims.dp_shard_in_ep) == (1, 4)


@pytest.mark.parametrize("kwargs", [dict(dp_replicate=2, dp_shard=2, tp=2), dict(pp=2, dp_shard=2, tp=2), dict(dp_shard=8)])
def test_data_parallel_rank_matches_row_major_mesh(kwargs):
    import itertools

    dims = resolve_parallel_dims(8, **kwargs)
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    coords = itertools.product(*(range(getattr(dims, n)) for n in names))
    for rank, c in enumerate(coords):
        at = dict(zip(names, c))
        expected = at["dp_replicate"] * dims.dp_shard + at["dp_shard"]
        assert data_parallel_rank_and_size(dims, rank) == (expected, dims.dp)
