"""Grouped-GEMM options are checked up front with one-line errors; `convert_grouped_mm` wraps
exactly the routed experts' stacked weights of the named modules and sets their group alignment;
on CPU the emulated MXFP8 experts stay within MXFP8's error of the bf16 ones, gradients included."""

import pytest
import torch
from torch import nn
from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor, MXFP8TrainingWeightWrapperTensor

from tessera.float8 import GroupedMMOptions, check_grouped_mm_options, convert_grouped_mm
from tessera.models.moe import GroupedExperts, MoE, MoEArgs

EMULATED = "mxfp8_emulated_rceil"


@pytest.mark.parametrize(
    "options, message",
    [
        (GroupedMMOptions("fp8_blockwise"), r"grouped_mm recipe_name 'fp8_blockwise' is not one of \['fp8_rowwise', 'mxfp8', "),
        (GroupedMMOptions(EMULATED, fqns=()), r"grouped_mm fqns is empty"),
        (GroupedMMOptions("fp8_rowwise"), r"float8 grouped GEMMs .* need a CUDA GPU of compute capability >= 9.0 and have "
                                          r"no emulated mode; on cpu the MXFP8 recipe 'mxfp8_emulated_rceil' runs"),
        (GroupedMMOptions("mxfp8"), r"mx recipe_name 'mxfp8_rceil' needs torchao's triton kernels on a CUDA GPU"),
    ],
)
def test_what_cannot_run_on_cpu_is_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message) as error:
        check_grouped_mm_options(options, "cpu")
    assert "\n" not in str(error.value)
    check_grouped_mm_options(GroupedMMOptions(EMULATED), "cpu")


def test_gpus_before_sm90_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    for recipe in ("fp8_rowwise", EMULATED):
        with pytest.raises(ValueError, match=rf"'{recipe}' needs a GPU of compute capability >= 9.0 .*this one is 8.9"):
            check_grouped_mm_options(GroupedMMOptions(recipe), "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_grouped_mm_options(GroupedMMOptions("fp8_rowwise"), "cuda")
    with pytest.raises(ValueError, match=r"'mxfp8_rceil' needs a GPU of compute capability >= 10.0"):
        check_grouped_mm_options(GroupedMMOptions("mxfp8"), "cuda")


@pytest.mark.parametrize("recipe, wrapper, block", [("fp8_rowwise", Float8TrainingWeightWrapperTensor, 16),
                                                     (EMULATED, MXFP8TrainingWeightWrapperTensor, 32)])
def test_converts_the_routed_experts_only(recipe, wrapper, block):
    model = nn.ModuleDict({"moe": MoE(64, MoEArgs(n_experts=4, hidden_dim=32, n_shared_experts=1))})
    assert convert_grouped_mm(model, GroupedMMOptions(recipe, fqns=("experts",))) == ["moe.experts"]
    wrapped = sorted(name for name, p in model.named_parameters() if type(p) is wrapper)
    assert wrapped == ["moe.experts.w1", "moe.experts.w2", "moe.experts.w3"]  # not the shared expert's or router's linears
    assert model.moe.experts.token_group_alignment == block
    assert all(type(p) is nn.Parameter for name, p in model.named_parameters() if name not in wrapped)
    assert convert_grouped_mm(model, GroupedMMOptions(recipe, fqns=("router", "shared"))) == []


def test_a_meta_built_model_converts_then_materialises():
    # the trainer's GPU order: build on meta, convert, to_empty, init_weights
    with torch.device("meta"):
        model = nn.ModuleDict({"experts": GroupedExperts(64, 64, 4).to(torch.bfloat16)})
    assert convert_grouped_mm(model, GroupedMMOptions(EMULATED)) == ["experts"]
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.experts.init_weights(0.02)
    assert type(model.experts.w1) is MXFP8TrainingWeightWrapperTensor and model.experts.w1.std() > 0.01
    model.experts(torch.randn(40, 64, dtype=torch.bfloat16), torch.tensor([10, 0, 20, 10])).float().sum().backward()
    assert model.experts.w1.grad.abs().sum() > 0


def test_expert_dims_off_the_block_are_refused():
    with pytest.raises(ValueError, match=r"grouped_mm mxfp8_emulated_rceil: w.w1 \(4, 48, 64\) needs its last two dims in multiples of 32"):
        convert_grouped_mm(nn.ModuleDict({"w": GroupedExperts(64, 48, 4)}), GroupedMMOptions(EMULATED, fqns=("w",)))


def _experts(converted: bool):
    torch.manual_seed(0)
    experts = GroupedExperts(256, 128, 8).to(torch.bfloat16)
    experts.init_weights(0.02)
    if converted:
        convert_grouped_mm(nn.ModuleDict({"experts": experts}), GroupedMMOptions(EMULATED))
    return experts


def test_emulated_mxfp8_experts_match_bf16_within_mxfp8_error():
    # 93 rows (not a multiple of the 32-row block), one expert without tokens
    counts = torch.tensor([0, 20, 3, 13, 27, 10, 12, 8])
    x = torch.randn(int(counts.sum()), 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    results = []
    for converted in (False, True):
        experts, inputs = _experts(converted), x.clone().requires_grad_()
        out = experts(inputs, counts)
        out.float().square().sum().backward()
        results.append([t.float() for t in (out, inputs.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad)])
    errors = [((got - want).norm() / want.norm()).item() for got, want in zip(*reversed(results))]
    print(f"MXFP8 emulated vs bf16, relative: out, dx, dw1, dw2, dw3 {[f'{e:.1e}' for e in errors]}")
    # e4m3 keeps 3 mantissa bits (rounding ~3.6% rms per operand); measured 6.5e-2 to 8.6e-2. Above
    # 1e-2: an experts module that bypassed the wrapper would be exact.
    assert all(1e-2 < e < 0.15 for e in errors)
