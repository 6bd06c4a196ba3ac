"""Float8 training (emulated scales and casts on CPU) tracks fp32 and learns; under FSDP 2 (with
and without float8 all-gather and the scale precompute) and TP 2 (with the float8 styles, also
when filters leave some linears plain) it matches the single-process float8 run."""

import collections
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_tensor_parallel import (
    Float8ColwiseParallel,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
)

from tessera.float8 import (
    Float8Options,
    MXOptions,
    check_mx_options,
    check_options,
    convert,
    convert_mx,
    post_optimizer_hooks,
    tp_styles,
)
from tessera.fsdp import apply_fsdp
from tessera.mesh.testing import run_on_ranks
from tessera.models import get_model_spec
from tessera.models.llama import Transformer, llama3_flavors
from tessera.tp import apply_tp, loss_parallel_context

# tessera.models' Llama, tiny: every linear a multiple of 16 (float8 matmul rule; the FFN width
# rounds up to 96), so the size thresholds are off here.
ARGS = dataclasses.replace(llama3_flavors["debugmodel"], dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                           multiple_of=16, max_seq_len=8)
VOCAB, PLAN = ARGS.vocab_size, get_model_spec("llama3").tp_plan
BATCH, SEQ, STEPS, SEED, LR = 4, 8, 3, 0, 1e-2


def options(recipe, **changes):
    return check_options(Float8Options(recipe_name=recipe, auto_filter_small_kn=False, **changes))


def build(opts=None):
    torch.manual_seed(SEED)
    model = Transformer(ARGS)
    if opts is not None:
        convert(model, opts)
    return model


def train(model, hooks=(), rows=slice(None), loss_parallel=False):
    """STEPS AdamW steps on one fixed batch (the loss must fall); `rows` is this rank's share."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(SEED))[rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        with loss_parallel_context(loss_parallel):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for hook in hooks:
            hook(model)
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        losses.append(loss.item())
    return losses


# name -> (recipe, option changes, layout, float8 TP styles applied (colwise, rowwise, block input))
CASES = {
    "fsdp2-tensorwise": ("tensorwise", {}, "fsdp", None),
    "fsdp2-tensorwise-float8-all-gather-precompute": (
        "tensorwise", dict(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True),
        "fsdp", None),
    "fsdp2-rowwise": ("rowwise", {}, "fsdp", None),
    # without sequence parallel: torchao's float8 styles on every converted linear and block
    "tp2-tensorwise": ("tensorwise", {}, "tp", (10, 4, 4)),
    # wk, wv stay nn.Linear: plain styles for them and for the attention input, float8 elsewhere
    "tp2-tensorwise-wk-wv-plain": ("tensorwise", dict(filter_fqns=("output", "wk", "wv")), "tp", (6, 4, 2)),
    # sequence parallel on gloo: plain styles (float8 collectives need NCCL), float8 linears
    "tp2-sp-tensorwise": ("tensorwise", {}, "tp-sp", (0, 0, 0)),
    "tp2-sp-rowwise": ("rowwise", {}, "tp-sp", (0, 0, 0)),
}
FLOAT8_STYLES = (Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput)


def _count_float8_styles():
    """Counts, in this worker, how often each torchao float8 TP style is applied."""
    counts = collections.Counter()
    for cls in FLOAT8_STYLES:
        def counted(self, module, mesh, _apply=cls._apply, cls=cls):
            counts[cls] += 1
            return _apply(self, module, mesh)
        cls._apply = counted
    return counts


def _distributed_runs(rank, world_size):
    """Every case in one spawn (a spawn costs seconds): FSDP gives each rank half the batch, TP
    gives both ranks all of it."""
    mesh = init_device_mesh("cpu", (world_size,))
    counts = _count_float8_styles()
    out = {}
    for name, (recipe, changes, layout, _) in CASES.items():
        opts = options(recipe, **changes)
        model = build(opts)
        if layout == "fsdp":
            apply_fsdp(model, mesh)
            rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
            local = train(model, post_optimizer_hooks(opts), rows)
            # each rank's mean loss over its equal share: their average is the batch's loss
            total = torch.tensor(local)
            dist.all_reduce(total)
            out[name] = (total / world_size).tolist()
        else:
            counts.clear()
            apply_tp(model, mesh, PLAN, sequence_parallel=layout == "tp-sp", styles=tp_styles(opts))
            out[name] = train(model, loss_parallel=True)
            out[name + ":float8-styles"] = tuple(counts[cls] for cls in FLOAT8_STYLES)
            out[name + ":float8-linears"] = sum(isinstance(m, Float8Linear) for m in model.modules())
    return out


@pytest.fixture(scope="module")
def distributed():
    return run_on_ranks(_distributed_runs, 2)[0]


@pytest.fixture(scope="module")
def fp32():
    return train(build())


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("recipe, emulate", [
    ("tensorwise", False), ("tensorwise", True), ("rowwise", False), ("rowwise_with_gw_hp", False),
])
def test_single_process_tracks_fp32_and_learns(fp32, recipe, emulate):
    losses = train(build(options(recipe, emulate=emulate)))
    print(f"{recipe} emulate={emulate}: losses {losses} vs fp32 {fp32}, max rel {_rel(losses, fp32):.1e}")
    assert _rel(losses, fp32) <= 1e-2  # float8 e4m3 (3 mantissa bits) matmuls on a 32-wide model
    assert losses[-1] < losses[0] - 0.1


def test_mxfp8_emulated_tracks_fp32_and_learns(fp32):
    # BATCH * SEQ = 32 tokens: one MX block; wk, wv (N = 16) are skipped as narrower than a block
    model = build()
    converted = convert_mx(model, check_mx_options(MXOptions(recipe_name="mxfp8_emulated_rceil")))
    assert len(converted) == 2 * 5
    losses = train(model)
    print(f"mxfp8_emulated_rceil: losses {losses} vs fp32 {fp32}, max rel {_rel(losses, fp32):.1e}")
    assert _rel(losses, fp32) <= 1e-2
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.parametrize("case", sorted(CASES))
def test_distributed_matches_single_process_float8(distributed, case):
    recipe, changes, layout, _ = CASES[case]
    single = train(build(options(recipe, **changes)))
    got = distributed[case]
    print(f"{case}: losses {got} vs single process {single}, max rel {_rel(got, single):.1e}")
    assert _rel(got, single) <= 1e-3
    assert got[-1] < got[0]


@pytest.mark.parametrize("case", [name for name, case in CASES.items() if case[3] is not None])
def test_float8_styles_only_where_they_can_run(distributed, case):
    assert distributed[case + ":float8-styles"] == CASES[case][3]
    # parallelize_module keeps the module types: 2 layers x 7 linears, less the filtered ones
    assert distributed[case + ":float8-linears"] == (10 if "wk-wv-plain" in case else 14)
