"""Options are checked up front with one-line errors; `convert` swaps exactly the linears the
filters keep; the role names and style factories fit tessera.tp."""

import pytest
import torch
from torch import nn
from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
from torchao.float8.float8_linear import Float8Linear

from tessera import tp
from tessera.float8 import (
    Float8Options,
    GroupedMMOptions,
    MXOptions,
    check_grouped_mm_options,
    check_mx_options,
    check_options,
    convert,
    convert_mx,
    post_optimizer_hooks,
    tp_styles,
)


@pytest.mark.parametrize(
    "options, message",
    [
        (Float8Options(recipe_name="blockwise"), r"float8 recipe_name 'blockwise' is not one of \['tensorwise', 'rowwise', 'rowwise_with_gw_hp'\]"),
        (Float8Options(recipe_name="rowwise", enable_fsdp_float8_all_gather=True),
         r"float8 enable_fsdp_float8_all_gather needs recipe_name 'tensorwise', not 'rowwise'"),
        (Float8Options(precompute_float8_dynamic_scale_for_fsdp=True),
         r"float8 precompute_float8_dynamic_scale_for_fsdp needs enable_fsdp_float8_all_gather"),
    ],
)
def test_bad_options_one_line(options, message):
    with pytest.raises(ValueError, match=message) as error:
        check_options(options)
    assert "\n" not in str(error.value)


def test_gpu_before_sm89_refused_unless_emulated(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability >= 8.9, this one is 8.0: set emulate = true") as error:
        check_options(Float8Options(), "cuda")
    assert "\n" not in str(error.value)
    assert check_options(Float8Options(emulate=True), "cuda").emulate
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_options(Float8Options(), "cuda")


def test_a_host_without_cuda_checks_all_but_the_gpu_s_capability(monkeypatch):
    """Options for a cluster's GPUs checked on a login node: what only the GPU can tell passes,
    the rest is still checked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: pytest.fail("asked a missing GPU"))
    check_options(Float8Options(), "cuda")
    check_mx_options(MXOptions(), "cuda")
    check_grouped_mm_options(GroupedMMOptions("fp8_rowwise", fqns=("experts",)), "cuda")
    with pytest.raises(ValueError, match="needs recipe_name 'tensorwise'"):
        check_options(Float8Options(recipe_name="rowwise", enable_fsdp_float8_all_gather=True), "cuda")


class Attention(nn.Module):
    """Llama 3 8B's attention shapes: wk/wv are 4096 -> 1024."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(4096, n, bias=False) for n in (4096, 1024, 1024, 4096))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(4096, 14336, bias=False), nn.Linear(4096, 14336, bias=False)
        self.w2 = nn.Linear(14336, 4096, bias=False)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.feed_forward = Attention(), FeedForward()
        self.router = nn.Linear(4096, 8, bias=False)  # N = 8: not a multiple of 16
        self.marked = type("MarkedLinear", (nn.Linear,), {})(4096, 4096)  # a subclass keeps its own forward


def llama8b_like():
    with torch.device("meta"):  # real shapes, no memory
        model = nn.Module()
        model.layers = nn.ModuleDict({"0": Block(), "1": Block()})
        model.output = nn.Linear(4096, 128256, bias=False)
    return model


def _names(*suffixes):
    return sorted(f"layers.{i}.{s}" for i in (0, 1) for s in suffixes)


ATTENTION = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
FFN = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


@pytest.mark.parametrize(
    "options, expected",
    [
        # tensorwise skips K <= 4096 and N <= 1024: wk, wv (4096 -> 1024)
        (Float8Options(), _names("attention.wq", "attention.wo", *FFN)),
        # rowwise skips N <= 2048, K <= 1024, or N <= 4096 and K <= 2048: wk, wv again
        (Float8Options(recipe_name="rowwise"), _names("attention.wq", "attention.wo", *FFN)),
        (Float8Options(auto_filter_small_kn=False), _names(*ATTENTION, *FFN)),
        (Float8Options(auto_filter_small_kn=False, filter_fqns=("attention", "layers.1.")),
         sorted([f"layers.0.{name}" for name in FFN] + ["output"])),
        (Float8Options(auto_filter_small_kn=False, filter_fqns=()), [*_names(*ATTENTION, *FFN), "output"]),
    ],
)
def test_converts_exactly_what_the_filters_keep(options, expected):
    model = llama8b_like()
    converted = convert(model, options)
    assert sorted(converted) == expected
    assert sorted(name for name, m in model.named_modules() if isinstance(m, Float8Linear)) == expected
    assert all(m.weight.is_meta for m in model.modules() if isinstance(m, nn.Linear))


def test_convert_twice_converts_nothing_new():
    model = llama8b_like()
    convert(model, Float8Options())
    assert convert(model, Float8Options()) == []


def test_roles_are_tessera_tp_roles_and_factories_take_its_layouts():
    styles = tp_styles(Float8Options())
    assert set(styles) <= tp.ROLES and set(styles) == {"colwise", "rowwise", "block_input"}
    for sp in (True, False):
        for factory in styles.values():
            assert factory(tp.Layouts(sequence_parallel=sp, loss_parallel=True)) is not None
    assert tp.styles_with(styles)["norm"] is tp.DEFAULT_STYLES["norm"]
    assert tp_styles(Float8Options(recipe_name="rowwise")) == {}  # torch's plain styles serve rowwise


def test_scale_precompute_hook_only_when_asked():
    assert post_optimizer_hooks(Float8Options()) == ()
    options = Float8Options(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
    assert post_optimizer_hooks(options) == (precompute_float8_dynamic_scale_for_fsdp,)


def test_mx_runs_emulated_on_cpu_and_is_refused_where_torchao_cannot(monkeypatch):
    check_mx_options(MXOptions(recipe_name="mxfp8_emulated_rceil"))
    cases = [
        (MXOptions(recipe_name="mxfp8"), "cpu", r"mx recipe_name 'mxfp8' is not one of"),
        (MXOptions(), "cpu", r"mx recipe_name 'mxfp8_rceil' needs torchao's triton kernels on a CUDA GPU; on cpu use"),
        (MXOptions(recipe_name="mxfp8_rceil_wgrad_with_hp"), "cuda", r"compute capability >= 10.0 \(Blackwell\), this one is 9.0"),
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for options, device, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            check_mx_options(options, device)
        assert "\n" not in str(error.value)


def test_mx_converts_bias_free_linears_in_whole_blocks():
    model = nn.Sequential()
    model.add_module("a", nn.Linear(64, 64, bias=False))
    model.add_module("narrow", nn.Linear(64, 16, bias=False))  # N = 16: not a whole 32-value block
    model.add_module("biased", nn.Linear(64, 64))
    model.add_module("output", nn.Linear(64, 64, bias=False))
    assert convert_mx(model, MXOptions(recipe_name="mxfp8_emulated_rceil")) == ["a"]
    assert type(model.a.weight.data).__name__ == "MXFP8TrainingWeightWrapperTensor"
