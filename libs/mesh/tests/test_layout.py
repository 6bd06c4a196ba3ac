import pytest

from tessera.mesh import Meshes, mesh_dim_names, mesh_layout, mesh_shape, resolve_parallel_dims


@pytest.mark.parametrize(
    "world, kwargs, text",
    [
        (8, dict(dp_shard=4, tp=2),
         "world (dp_shard=4, tp=2); batch=dp_shard[4] loss=dp_shard[4] fsdp=dp_shard[4] tp=tp[2]"),
        (8, dict(dp_replicate=2, dp_shard=2, cp=2),
         "world (dp_replicate=2, dp_shard=2, cp=2); batch=dp_replicate*dp_shard[4] loss=dp_replicate*dp_shard*cp[8] "
         "fsdp=(dp_replicate[2],dp_shard*cp[4]) dp_replicate=dp_replicate[2] cp=cp[2]"),
        (4, dict(dp_replicate=2, tp=2),
         "world (dp_replicate=2, tp=2); batch=dp_replicate[2] loss=dp_replicate[2] dp_replicate=dp_replicate[2] tp=tp[2]"),
        (512, dict(tp=8, pp=8),
         "world (pp=8, dp_shard=8, tp=8); batch=dp_shard[8] loss=dp_shard[8] fsdp=dp_shard[8] tp=tp[8] pp=pp[8]"),
        (1, dict(), "world (dp_shard=1)"),
    ],
)
def test_describe_without_process_group(world, kwargs, text):
    assert mesh_layout(resolve_parallel_dims(world, **kwargs)).describe() == text


def test_accessor_sizes_at_512_ranks():
    layout = mesh_layout(resolve_parallel_dims(512, tp=8, pp=8))
    assert (layout.dim_names, layout.shape) == (("pp", "dp_shard", "tp"), (8, 8, 8))
    sizes = {name: layout.size(name) for name in ("world", "batch", "loss", "fsdp", "tp", "pp", "cp", "ep")}
    assert sizes == {"world": 512, "batch": 8, "loss": 8, "fsdp": 8, "tp": 8, "pp": 8, "cp": 1, "ep": 1}
    for off in ("dp_replicate", "cp", "ep", "expert_fsdp"):
        assert layout.spans(off) is None and layout.shape_of(off) is None


def test_expert_parallel_splits_dp_shard():
    # 16 ranks: dp_replicate 2 x dp_shard 4 x cp 2; ep 4 takes both cp ranks and 2 of dp_shard
    dims = resolve_parallel_dims(16, dp_replicate=2, cp=2, ep=4)
    layout = mesh_layout(dims)
    assert mesh_dim_names(dims) == ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp")
    assert mesh_shape(dims) == (2, 2, 2, 2)
    assert layout.spans("ep") == (("dp_shard_in_ep", "cp"),)
    assert layout.spans("expert_fsdp") == (("dp_replicate",), ("dp_shard_mod_ep",))
    assert layout.shape_of("expert_fsdp") == (2, 2)
    assert layout.shape_of("fsdp") == (2, 8)
    assert layout.size("batch") == 8 and layout.size("loss") == 16
    # the mapping keeps the keys it had before ep split dp_shard
    assert layout.mapping_keys == mesh_layout(resolve_parallel_dims(16, dp_replicate=2, cp=2)).mapping_keys


def test_expert_parallel_takes_the_tp_ranks_when_asked():
    # torchtitan's expert_tensor_parallel_degree 1: ep 4 = 2 of dp_shard 4 x tp 2; without tp, the flag is dropped
    dims = resolve_parallel_dims(8, tp=2, ep=4, ep_spans_tp=True)
    layout = mesh_layout(dims)
    assert (dims.dp_shard_mod_ep, dims.dp_shard_in_ep) == (2, 2)
    assert layout.spans("ep") == (("dp_shard_in_ep", "tp"),) and layout.spans("expert_fsdp") == (("dp_shard_mod_ep",),)
    assert layout.spans("tp") == (("tp",),) and layout.shape_of("fsdp") == (4,)
    assert not resolve_parallel_dims(4, ep=4, ep_spans_tp=True).ep_spans_tp


def test_experts_keep_an_fsdp_mesh_when_ep_takes_all_of_dp_shard():
    layout = mesh_layout(resolve_parallel_dims(8, dp_shard=4, cp=2, ep=8))
    assert layout.world == (("dp_shard_mod_ep", 1), ("dp_shard_in_ep", 4), ("cp", 2))
    assert layout.shape_of("expert_fsdp") == (1,)
    assert layout.size("ep") == 8


def test_one_rank_keeps_its_mapping_keys_and_no_accessors():
    layout = mesh_layout(resolve_parallel_dims(1))
    assert layout.mapping_keys == ("world", "dp_shard", "dp", "dp_shard_cp", "dp_cp")
    assert layout.accessors == ()


def test_single_process_meshes_are_all_off():
    meshes = Meshes.single()
    assert meshes.layout.describe() == "world (dp_shard=1)"
    assert all(getattr(meshes, name) is None for name in ("world", "batch", "loss", "fsdp", "tp", "pp", "cp", "ep"))
    assert dict(meshes) == {}
