"""clip_grad_norm_ on plain, DTensor (several meshes and placements) and pipeline-split grads
equals torch's clip on the same full gradients in one process (1e-6 relative)."""

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from tessera.fsdp import clip_grad_norm_
from tessera.mesh.testing import run_on_ranks

NORM_TYPES = (2.0, 1.0, math.inf)
MAX_NORM = 1.0


def _full_grads():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for shape in [(6, 4), (5, 3), (4,), (3, 2), (7,), (4,)]]


def _param(grad):
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    return p


def _torch_clip(grads, norm_type):
    params = [_param(g) for g in grads]
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type)
    return norm.item(), [p.grad for p in params]


def _as_params(rank, world_size, grads):
    """The same gradients as a mix: Shard(0) and Replicate DTensors on a 1-D mesh, an uneven
    Shard(0) on a second 2-D mesh, plain tensors (as TP leaves norm weights) and unreduced sums
    (Partial, as sequence parallel leaves norm weights: this rank's share of the gradient)."""
    mesh_1d = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    mesh_2d = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    placed = [
        distribute_tensor(grads[0], mesh_1d, [Shard(0)]),
        distribute_tensor(grads[1], mesh_2d, [Shard(0), Replicate()]),  # 5 rows over 2 ranks
        distribute_tensor(grads[2], mesh_1d, [Replicate()]),
        grads[3].clone(),
        grads[4].clone(),
        DTensor.from_local(grads[5] * (rank + 1) / (world_size * (world_size + 1) / 2), mesh_1d, [Partial()]),
    ]
    params = []
    for g in placed:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g
        params.append(p)
    return params


def _mixed(rank, world_size):
    out = {}
    for norm_type in NORM_TYPES:
        params = _as_params(rank, world_size, _full_grads())
        norm = clip_grad_norm_(params, MAX_NORM, norm_type)
        assert type(norm) is torch.Tensor  # a plain tensor, not a DTensor
        grads = [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for p in params]
        out[norm_type] = (norm.item(), grads)
    return out


def _pipeline(rank, world_size):
    """Each 'stage' (rank) holds a different part of the gradients."""
    pp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    grads = _full_grads()
    mine = grads[:2] if rank == 0 else grads[2:]
    out = {}
    for norm_type in NORM_TYPES:
        params = [_param(g) for g in mine]
        norm = clip_grad_norm_(params, MAX_NORM, norm_type, pp_mesh=pp)
        out[norm_type] = (norm.item(), [p.grad for p in params])
    return out


def _sharded(rank, world_size):
    """FSDP's case alone: every gradient a Shard(0) DTensor on one mesh, 2-norm. Returns the
    clip's norm and this rank's shard-only norm (what an unreduced norm would give)."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    params = [_param(distribute_tensor(g, mesh, [Shard(0)])) for g in _full_grads()[:2]]
    local = torch.linalg.vector_norm(torch.cat([p.grad.to_local().flatten() for p in params]))
    return clip_grad_norm_(params, MAX_NORM, 2.0).item(), local.item()


def _nan_on_one_rank(rank, world_size):
    """A nan in the rows rank 1 holds, the others finite: the inf-norm each rank returns, sharded
    (FSDP's Shard(0) over a 1-D mesh) and pipeline-split (each stage its own parameter)."""
    grad = _full_grads()[0]
    grad[-1, 0] = float("nan")
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    sharded = clip_grad_norm_([_param(distribute_tensor(grad, mesh, [Shard(0)]))], MAX_NORM, math.inf,
                              error_if_nonfinite=False)
    pp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    staged = clip_grad_norm_([_param(grad if rank == 1 else _full_grads()[1])], MAX_NORM, math.inf, pp_mesh=pp,
                             error_if_nonfinite=False)
    return sharded.item(), staged.item()


def _both(rank, world_size):
    return {"mixed": _mixed(rank, world_size), "pipeline": _pipeline(rank, world_size),
            "sharded": _sharded(rank, world_size), "nan": _nan_on_one_rank(rank, world_size)}


@pytest.fixture(scope="module")
def two_rank_results():
    return run_on_ranks(_both, 2)  # one spawn for both cases: starting ranks dominates the cost


@pytest.mark.parametrize("case", ["mixed", "pipeline"])
def test_distributed_norm_equals_single_process(two_rank_results, case):
    for norm_type in NORM_TYPES:
        ref_norm, ref_grads = _torch_clip(_full_grads(), norm_type)
        assert ref_norm > MAX_NORM  # clipping really happens
        for rank, result in enumerate(two_rank_results):
            norm, grads = result[case][norm_type]
            assert norm == pytest.approx(ref_norm, rel=1e-6), (rank, norm_type)
            if case == "pipeline":  # rank 0 holds the first two gradients, rank 1 the rest
                ref_grads_here = ref_grads[:2] if rank == 0 else ref_grads[2:]
            else:
                ref_grads_here = ref_grads
            for got, want in zip(grads, ref_grads_here):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_sharded_2_norm_is_reduced_across_ranks(two_rank_results):
    ref_norm, _ = _torch_clip(_full_grads()[:2], 2.0)
    for norm, local in (result["sharded"] for result in two_rank_results):
        assert abs(local - ref_norm) > 0.1 * ref_norm  # a shard's own norm is far off: the case bites
        assert norm == pytest.approx(ref_norm, rel=1e-6)


def test_a_nan_on_one_rank_makes_every_rank_s_inf_norm_non_finite(two_rank_results):
    """A max over ranks could keep a finite operand over a nan; the caller then stepped on nans."""
    for sharded, staged in (result["nan"] for result in two_rank_results):
        assert not math.isfinite(sharded) and not math.isfinite(staged)


def test_plain_grads_match_torch():
    for norm_type in NORM_TYPES:
        params = [_param(g) for g in _full_grads()]
        norm = clip_grad_norm_(params, MAX_NORM, norm_type)
        ref_norm, ref_grads = _torch_clip(_full_grads(), norm_type)
        assert norm.item() == pytest.approx(ref_norm, rel=1e-6)
        for p, want in zip(params, ref_grads):
            torch.testing.assert_close(p.grad, want)


def test_a_norm_below_max_norm_leaves_the_grads_as_they_are():
    """Clipping only scales down: torch's coefficient is capped at 1, so exactly 1.0 here."""
    for norm_type in NORM_TYPES:
        params = [_param(g) for g in _full_grads()]
        ref_norm, _ = _torch_clip(_full_grads(), norm_type)
        norm = clip_grad_norm_(params, 10 * ref_norm, norm_type)
        assert norm.item() == pytest.approx(ref_norm, rel=1e-6)
        for p, want in zip(params, _full_grads()):
            torch.testing.assert_close(p.grad, want, rtol=0, atol=0)


def test_non_finite_norm_raises_and_leaves_grads():
    grads = _full_grads()
    grads[1][0, 0] = float("nan")
    params = [_param(g) for g in grads]
    with pytest.raises(RuntimeError, match="gradient norm is nan"):
        clip_grad_norm_(params, MAX_NORM)
    torch.testing.assert_close(params[0].grad, grads[0])
    # opting out scales exactly as torch does (with a nan coefficient)
    norm = clip_grad_norm_(params, MAX_NORM, error_if_nonfinite=False)
    assert math.isnan(norm.item()) and torch.isnan(params[0].grad).all()


def test_no_grads_gives_zero_and_bad_arguments():
    assert clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], MAX_NORM).item() == 0.0
    p = _param(torch.ones(2))
    with pytest.raises(ValueError, match="norm_type=0.0"):
        clip_grad_norm_([p], MAX_NORM, norm_type=0)
    with pytest.raises(ValueError, match="max_norm=-1"):
        clip_grad_norm_([p], -1)
