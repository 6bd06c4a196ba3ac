"""The MoE layer under tensor parallel (the family's own plan, tessera.models.moe.moe_tp_plan, applied
by tessera.tp: 2 ranks, gloo, fp32) against the same layer on one process: output, input
gradient and every parameter gradient, with sequence parallel on and off, shared experts,
group-limited sigmoid routing and the sequence-wise balance loss (its scale divided by the TP
degree, as the family's set_aux_loss_scale does)."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from tessera.mesh.testing import run_on_ranks

DIM, BATCH, SEQ, TP = 16, 2, 8, 2
# measured max relative error 2.2e-7 (fp32: the hidden features are summed in two halves)
TOL = 2e-6


def _layer():
    from tessera.models.moe import MoE, MoEArgs

    args = MoEArgs(n_experts=8, top_k=3, hidden_dim=8, n_shared_experts=1, score_func="sigmoid", route_norm=True,
                   route_scale=2.5, n_groups=4, topk_groups=2, aux_loss_alpha=0.1)
    torch.manual_seed(0)
    layer = MoE(DIM, args)
    layer.init_weights(0.3)
    layer.expert_bias.copy_(torch.linspace(-0.1, 0.1, 8))
    return layer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _compare(rank, world_size, sequence_parallel):
    from torch.distributed.device_mesh import init_device_mesh

    from tessera import tp
    from tessera.models.moe import moe_tp_plan, set_aux_loss_scale

    g = torch.Generator().manual_seed(1)
    x, grad = torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)
    reference = _layer()
    ref_x = x.clone().requires_grad_()
    ref_out = reference(ref_x)
    (ref_out * grad).sum().backward()

    layer = _layer()
    set_aux_loss_scale(layer, 1.0, TP)
    tp.apply_tp(torch.nn.ModuleDict({"moe": layer}), init_device_mesh("cpu", (TP,)), moe_tp_plan("moe"),
                sequence_parallel=sequence_parallel, loss_parallel=False)
    rows = slice(rank * SEQ // TP, (rank + 1) * SEQ // TP) if sequence_parallel else slice(None)
    local_x = x[:, rows].clone().requires_grad_()
    out = layer(local_x)
    (out * grad[:, rows]).sum().backward()

    errors = {"out": _rel(out.detach(), ref_out[:, rows].detach()), "dx": _rel(local_x.grad, ref_x.grad[:, rows])}
    for name, param in reference.named_parameters():
        got = layer.get_parameter(name).grad
        errors[name] = _rel(got.full_tensor() if isinstance(got, DTensor) else got, param.grad)
    assert torch.equal(layer.tokens_per_expert, reference.tokens_per_expert)  # every rank routes every token
    return errors


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_moe_layer_under_tensor_parallel_matches_one_process(sequence_parallel):
    for errors in run_on_ranks(_compare, TP, sequence_parallel):
        assert max(errors.values()) <= TOL, errors
