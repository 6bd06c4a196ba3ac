"""Expert parallelism against the same experts on one process (gloo, fp32, 4 ranks).

One spawn of 4 ranks runs every case; the reference is computed on each rank from the data of
all ranks (each rank's data is seeded by its rank), so ranks compare without moving tensors:
- GroupedExperts at EP 2 (ranks {0,1} and {2,3}) and EP 4: output, dx and the experts' weight
  gradients (gathered) equal the single-process module's, with uneven counts, experts that get
  no token, a rank that receives no row, and a rank that routes no token;
- FSDP over the expert_fsdp mesh (2 ranks, and 1 at EP 4) x EP with divide_grads_by_ep: expert
  gradients equal the mean over the 4 data-parallel ranks' losses;
- the full tessera.models MoE layer (router, shared expert, aux loss) at EP 2, forward and backward;
- a DCP checkpoint saved at EP 4 loads at EP 2;
- EP 4 with rows split over pairs (``split_rows_over``): the pair's outputs sum to one process's;
- equal groups (counts None: a capacity per expert, exchanged with equal splits and no counts):
  the experts at EP 4, split over pairs too, and the MoE layer with a capacity factor that drops
  slots (EP 2) or reroutes them (EP 4), each against one process with the same capacity.
"""

import pytest
import torch

from tessera.ep import apply_ep, check_ep_degree, find_experts
from tessera.mesh.testing import run_on_ranks

DIM, HIDDEN, EXPERTS, WORLD = 8, 16, 8, 4
# measured max relative error: <= 2.4e-7 (fp32 rounding: the experts' matmuls see other row counts)
TOL = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


def _routed(rank: int):
    """A rank's routed rows (sorted by expert), counts and output gradient: nobody routes to
    experts 2 and 3 (at EP 4 rank 1 receives nothing), rank 0 nothing to experts 6 and 7, rank 3
    no token at all."""
    g = torch.Generator().manual_seed(100 + rank)
    counts = torch.randint(0, 4, (EXPERTS,), generator=g)
    counts[2:4] = 0
    if rank == 0:
        counts[6:] = 0
    if rank == 3:
        counts.zero_()
    n = int(counts.sum())
    return torch.randn(n, DIM, generator=g), counts, torch.randn(n, DIM, generator=g)


def _experts():
    from tessera.models.moe import GroupedExperts

    torch.manual_seed(0)
    module = GroupedExperts(DIM, HIDDEN, EXPERTS)
    module.init_weights(0.3)
    return module


def _reference(module, ranks):
    """Outputs and dx per rank, and the weight gradients of sum over ``ranks`` of <out, grad>."""
    outs, dxs = {}, {}
    for r in ranks:
        x, counts, grad = _routed(r)
        x.requires_grad_()
        out = module(x, counts)
        (out * grad).sum().backward()
        outs[r], dxs[r] = out.detach(), x.grad
    return outs, dxs, {n: p.grad for n, p in module.named_parameters()}


def _run_ep(module, rank):
    x, counts, grad = _routed(rank)
    x.requires_grad_()
    out = module(x, counts)
    (out * grad).sum().backward()
    return out.detach(), x.grad


def _compare_experts(rank, mesh, group_ranks, fsdp_mesh=None, dp=1):
    from torch.distributed.fsdp import fully_shard

    ref_out, ref_dx, ref_grads = _reference(_experts(), group_ranks if fsdp_mesh is None else range(WORLD))
    module = apply_ep(_experts(), mesh, divide_grads_by_ep=fsdp_mesh is not None)[0]
    if fsdp_mesh is not None:
        fully_shard(module, mesh=fsdp_mesh)
    out, dx = _run_ep(module, rank)
    errors = {"out": _rel(out, ref_out[rank]), "dx": _rel(dx, ref_dx[rank])}
    for name, param in module.named_parameters():
        errors[f"d{name}"] = _rel(param.grad.full_tensor(), ref_grads[name] / dp)
    if fsdp_mesh is None:  # rank r holds experts [r E/ep, (r+1) E/ep)
        ep_rank, local = mesh.get_local_rank(), EXPERTS // mesh.size()
        errors["shard"] = _rel(module.w1.to_local(), _experts().w1[ep_rank * local:(ep_rank + 1) * local].detach())
    return errors


def _compare_split_rows(rank, meshes):
    """EP 4 whose pairs ({0,1}, {2,3}: the tp mesh, as under expert_tensor_parallel_degree 1)
    pass the same rows, each sending half: a pair's outputs and dx sum to one process's."""
    import torch.distributed as dist

    leader = rank - rank % 2
    ref_out, ref_dx, ref_grads = _reference(_experts(), [0, 2])
    module = apply_ep(_experts(), meshes.ep, split_rows_over=meshes.tp)[0]
    out, dx = _run_ep(module, leader)
    summed = torch.cat([out, dx])
    dist.all_reduce(summed, group=meshes.tp.get_group())
    errors = {"out+dx": _rel(summed, torch.cat([ref_out[leader], ref_dx[leader]]))}
    for name, param in module.named_parameters():
        errors[f"d{name}"] = _rel(param.grad.full_tensor(), ref_grads[name])
    return errors


def _compare_equal_groups(rank, mesh, group_ranks, split_over=None):
    """E groups of C rows (counts None) at EP 4, alone or split over pairs (each sends half of
    every group, the pair's outputs sum), against the one-process module on the same rows."""
    import torch.distributed as dist

    def data(r):
        g = torch.Generator().manual_seed(300 + r)
        return torch.randn(EXPERTS * 4, DIM, generator=g), torch.randn(EXPERTS * 4, DIM, generator=g)

    reference, outs, dxs = _experts(), {}, {}
    for r in group_ranks:
        x, grad = data(r)
        x.requires_grad_()
        out = reference(x, None)
        (out * grad).sum().backward()
        outs[r], dxs[r] = out.detach(), x.grad
    module = apply_ep(_experts(), mesh, split_rows_over=split_over)[0]
    source = rank if split_over is None else rank - rank % 2
    x, grad = data(source)
    x.requires_grad_()
    out = module(x, None)
    (out * grad).sum().backward()
    got = torch.cat([out.detach(), x.grad])
    if split_over is not None:
        dist.all_reduce(got, group=split_over.get_group())
    errors = {"out+dx": _rel(got, torch.cat([outs[source], dxs[source]]))}
    ref_grads = dict(reference.named_parameters())
    for name, param in module.named_parameters():
        errors[f"d{name}"] = _rel(param.grad.full_tensor(), ref_grads[name].grad)
    return errors


def _moe_layer(capacity=None):
    from tessera.models.moe import MoE, MoEArgs, set_expert_capacity

    torch.manual_seed(1)
    args = MoEArgs(n_experts=EXPERTS, top_k=2, hidden_dim=HIDDEN, n_shared_experts=1, score_func="sigmoid",
                   route_norm=True, n_groups=2, topk_groups=1, aux_loss_alpha=0.01)
    layer = MoE(DIM, args)
    layer.init_weights(0.3)
    if capacity is not None:
        set_expert_capacity(layer, *capacity)
    return layer


def _moe_data(rank):
    g = torch.Generator().manual_seed(200 + rank)
    return torch.randn(2, 5, DIM, generator=g), torch.randn(2, 5, DIM, generator=g)


def _compare_moe(rank, mesh, group_ranks, capacity=None):
    """The MoE layer at EP 2: each rank its own tokens; non-expert gradients summed over the ep
    group (as data parallelism would) and expert gradients gathered, against one process. With
    ``capacity`` (factor, overflow) both layers dispatch so, and must drop the same slots."""
    import torch.distributed as dist

    ref, outs, dxs = _moe_layer(capacity), {}, {}
    for r in group_ranks:
        x, grad = _moe_data(r)
        x.requires_grad_()
        out = ref(x)
        (out * grad).sum().backward()
        outs[r], dxs[r] = out.detach(), x.grad
    layer = _moe_layer(capacity)
    apply_ep(find_experts(layer), mesh)
    x, grad = _moe_data(rank)
    x.requires_grad_()
    ref.dropped_slots.zero_()
    ref(_moe_data(rank)[0])  # this rank's tokens alone: what one process drops of them
    out = layer(x)
    (out * grad).sum().backward()
    errors = {"out": _rel(out, outs[rank]), "dx": _rel(x.grad, dxs[rank])}
    if capacity is not None:
        assert int(ref.dropped_slots) > 0 and torch.equal(layer.dropped_slots, ref.dropped_slots), rank
    ref_grads = dict(ref.named_parameters())
    for name, param in layer.named_parameters():
        if name.startswith("experts."):
            got = param.grad.full_tensor()
        else:
            got = param.grad.clone()
            dist.all_reduce(got, group=mesh.get_group())
        errors[f"d{name}"] = _rel(got, ref_grads[name].grad)
    return errors


def _reshard_checkpoint(save_mesh, load_mesh, folder):
    """A DCP checkpoint saved at one ep degree loads at another: the whole experts come back."""
    import torch.distributed.checkpoint as dcp

    saved = apply_ep(_experts(), save_mesh)[0]
    dcp.save(saved.state_dict(), checkpoint_id=folder)
    loaded = apply_ep(_experts(), load_mesh)[0]
    with torch.no_grad():
        for param in loaded.parameters():
            param.zero_()
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=folder)
    return {name: _rel(state[name].full_tensor(), ref.detach()) for name, ref in _experts().named_parameters()}


def _all_cases(rank, world_size, folder):
    from tessera.mesh import build_meshes, resolve_parallel_dims

    ep2 = build_meshes(resolve_parallel_dims(world_size, dp_shard=world_size, ep=2), "cpu")
    ep4 = build_meshes(resolve_parallel_dims(world_size, dp_shard=world_size, ep=4), "cpu")
    ep4_tp2 = build_meshes(resolve_parallel_dims(world_size, tp=2, ep=4, ep_spans_tp=True), "cpu")
    pair = [rank - rank % 2, rank - rank % 2 + 1]
    return {
        "ep4_split_rows2": _compare_split_rows(rank, ep4_tp2),
        "ep2": _compare_experts(rank, ep2.ep, pair),
        "ep4": _compare_experts(rank, ep4.ep, range(world_size)),
        "fsdp2_ep2": _compare_experts(rank, ep2.ep, None, ep2.expert_fsdp, dp=world_size),
        "fsdp1_ep4": _compare_experts(rank, ep4.ep, None, ep4.expert_fsdp, dp=world_size),
        "moe_ep2": _compare_moe(rank, ep2.ep, pair),
        "equal_groups_ep4": _compare_equal_groups(rank, ep4.ep, range(world_size)),
        "equal_groups_ep4_split_rows2": _compare_equal_groups(rank, ep4_tp2.ep, [0, 2], ep4_tp2.tp),
        "moe_ep2_capacity_drop": _compare_moe(rank, ep2.ep, pair, (0.5, "drop")),
        "moe_ep4_capacity_reroute": _compare_moe(rank, ep4.ep, range(world_size), (0.5, "reroute")),
        "dcp_ep4_to_ep2": _reshard_checkpoint(ep4.ep, ep2.ep, folder),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_ranks(_all_cases, WORLD, str(tmp_path_factory.mktemp("dcp")))


@pytest.mark.parametrize("case", ["ep2", "ep4", "fsdp2_ep2", "fsdp1_ep4", "moe_ep2", "dcp_ep4_to_ep2", "ep4_split_rows2",
                                  "equal_groups_ep4", "equal_groups_ep4_split_rows2", "moe_ep2_capacity_drop",
                                  "moe_ep4_capacity_reroute"])
def test_matches_one_process(results, case):
    for rank, per_case in enumerate(results):
        errors = per_case[case]
        assert max(errors.values()) <= TOL, (rank, errors)
        assert len(errors) >= 3, errors


def test_degree_errors():
    check_ep_degree(8, 4)
    with pytest.raises(ValueError, match="^8 experts do not divide over expert parallel degree 3$"):
        check_ep_degree(8, 3)
    with pytest.raises(ValueError, match="degree 0 must be >= 1"):
        check_ep_degree(8, 0)


def test_without_mesh_nothing_changes():
    module = _experts()
    assert apply_ep(module, None) == [module]
    assert type(module).__name__ == "GroupedExperts"


def test_find_experts_by_name():
    layer = _moe_layer()
    assert find_experts(layer) == [layer.experts]
    with pytest.raises(ValueError, match="no submodule called 'routed'"):
        find_experts(layer, "routed")
    assert find_experts(layer, "routed", required=False) == []  # a pipeline stage of dense blocks
