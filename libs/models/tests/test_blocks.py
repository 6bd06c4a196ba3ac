"""Activation checkpointing and per-block compile over ``model.layers``."""

import gc
import weakref
from collections import Counter
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.models import (AC_MODES, FORCE_RECOMPUTE_DEFAULT, apply_activation_checkpointing, apply_compile,
                            force_recompute_shapes)
from tessera.models.llama import Transformer, llama3_flavors

DEBUG = replace(llama3_flavors["debugmodel"], dim=64, n_layers=4, n_heads=4, vocab_size=128, max_seq_len=16)
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def debug_model():
    torch.manual_seed(0)
    return Transformer(DEBUG)


class MatmulCounter(TorchDispatchMode):
    def __init__(self, ops=MATMULS):
        super().__init__()
        self.ops, self.count = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.ops
        return func(*args, **(kwargs or {}))


def loss_grads_and_backward_matmuls(model):
    """Loss, gradients by parameter name (wrapper prefixes dropped) and matmuls run in backward."""
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    with MatmulCounter() as counter:
        loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    return loss, grads, counter.count


@pytest.fixture(scope="module")
def reference():
    return loss_grads_and_backward_matmuls(debug_model())


@pytest.mark.parametrize(
    "mode, option, wrapped, recomputed_matmuls",
    [
        # a recomputation stops once it has what backward needs (early_stop): before w2, the last matmul
        ("full", "op", ["0", "1", "2", "3"], 4 * 6),
        ("selective", "op", ["0", "1", "2", "3"], 4 * 3),  # wk, wo, w3: every second of a block's seven
        ("selective", "2", ["1", "3"], 2 * 6),  # the 2nd and 4th block, as torchtitan
        ("selective", 3, ["2"], 6),
    ],
)
def test_checkpointing_keeps_loss_and_grads_and_wraps_the_expected_blocks(
    reference, mode, option, wrapped, recomputed_matmuls
):
    model = debug_model()
    apply_activation_checkpointing(model, mode, option)
    assert [name for name, block in model.layers.items() if isinstance(block, CheckpointWrapper)] == wrapped
    loss, grads, matmuls = loss_grads_and_backward_matmuls(model)
    ref_loss, ref_grads, ref_matmuls = reference
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], msg=name)
    assert matmuls - ref_matmuls == recomputed_matmuls, (matmuls, ref_matmuls)


class MatmulShapes(TorchDispatchMode):
    """The weight operand's shape of each aten.mm run under it, in order."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.shapes.append(tuple(args[1].shape))
        return func(*args, **(kwargs or {}))


def _tiny_moe():
    from tessera.models.deepseek_v3 import DeepSeekV3, deepseek_v3_flavors

    torch.manual_seed(0)
    return DeepSeekV3(replace(deepseek_v3_flavors["tiny"], vocab_size=64, n_layers=2))


def _recomputed(shapes: list, router: set) -> list:
    """The matmuls of one block's forward (their weights' shapes) that torchtitan's policy
    recomputes: the router's, and every second of the others."""
    others = [shape for shape in shapes if shape not in router]
    return [shape for shape in shapes if shape in router] + others[1::2]


@pytest.mark.parametrize("make", [debug_model, _tiny_moe], ids=["llama", "deepseek_v3"])
def test_selective_op_recomputes_every_second_matmul_of_a_block_and_the_router(make):
    """torchtitan's op-level policy, read from the forward's matmuls: backward under "op" runs,
    beyond what it runs without checkpointing, the 2nd, 4th, ... matmul of each block (counted
    without the router's) and every router matmul (its weight's shape, as torchtitan matches)."""
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    model = make()
    router = {(m.in_features, m.out_features) for n, m in model.named_modules() if n.endswith("moe.router.gate")}
    forward, expected = MatmulShapes(), Counter()
    for block in model.layers.values():
        block.register_forward_pre_hook(lambda *_: forward.shapes.clear())
        block.register_forward_hook(lambda *_: expected.update(_recomputed(forward.shapes, router)))
    with forward:
        model(tokens[:, :-1])
    backward = {}
    for mode in ("none", "selective"):
        model = make()
        apply_activation_checkpointing(model, mode, "op")
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        with MatmulShapes() as counter:
            loss.backward()
        backward[mode] = Counter(counter.shapes)
    assert (make is debug_model) == (not router)
    assert backward["selective"] - backward["none"] == expected and not backward["none"] - backward["selective"]


def test_force_recompute_shapes_take_linears_by_name():
    model = _tiny_moe()
    assert force_recompute_shapes(model, FORCE_RECOMPUTE_DEFAULT) == {(model.args.dim, model.args.moe.n_experts)}
    assert force_recompute_shapes(debug_model(), FORCE_RECOMPUTE_DEFAULT) == set()  # a dense model: none
    with pytest.raises(ValueError, match="layers.0.attention_norm is a RMSNorm, not a Linear"):
        force_recompute_shapes(debug_model(), ("attention_norm",))


def split_backward(model, tokens, *, between_passes=None):
    """Loss and gradients by name taken in two backward passes over one graph, as split-backward
    pipeline schedules take them: the embedding's first (graph kept), then all the others.
    Matmuls run in each pass; between_passes(model) runs between them."""
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    named = {name.replace("_checkpoint_wrapped_module.", ""): p for name, p in model.named_parameters()}
    first = ["tok_embeddings.weight"]
    with MatmulCounter() as input_pass:
        grads = torch.autograd.grad(loss, [named[n] for n in first], retain_graph=True)
    if between_passes:
        between_passes(model)
    rest = [n for n in named if n not in first]
    with MatmulCounter() as weight_pass:
        grads += torch.autograd.grad(loss, [named[n] for n in rest])
    return loss, dict(zip(first + rest, grads)), (input_pass.count, weight_pass.count)


# without early stop each pass recomputes a block's seven matmuls through: the policy's count
# must start afresh in each (torch 2.11 asks it again; tests/test_torch_2_11 runs this file)
@pytest.mark.parametrize("early_stop", [True, False])
def test_selective_op_under_split_backward_reads_its_cache_in_both_passes(early_stop):
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads, ref_matmuls = split_backward(debug_model(), tokens)
    model = debug_model()
    apply_activation_checkpointing(model, "selective", "op", split_backward=True, early_stop=early_stop)
    loss, grads, matmuls = split_backward(model, tokens)
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], msg=name)
    # both passes read the kept matmul outputs; each reruns only the others (wk, wo, w3 of four blocks)
    assert matmuls == (ref_matmuls[0] + 4 * 3, ref_matmuls[1] + 4 * 3)


def test_selective_op_cache_is_freed_with_the_graph():
    """The kept outputs stay for the weight pass and go when its backward frees the graph."""
    model = debug_model()
    apply_activation_checkpointing(model, "selective", "op", split_backward=True)
    checkpoint_fn = model.layers["0"].checkpoint_fn
    make_contexts, caches, kept = checkpoint_fn.keywords["context_fn"], [], []

    def recording():
        modes = make_contexts()
        caches.append(modes[0].storage)
        return modes

    def weakly_after_input_pass(model):  # only weak references across the weight pass
        kept.extend(weakref.ref(row) for row in caches.pop().values() if row)

    checkpoint_fn.keywords["context_fn"] = recording
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    split_backward(model, tokens, between_passes=weakly_after_input_pass)
    assert kept  # block 0 cached matmul outputs, still there after the input pass
    gc.collect()
    assert all(row() is None for row in kept)


def test_torch_still_refuses_a_second_backward_through_its_selective_cache():
    """Guards _rereadable_contexts: when torch lets both passes read its own cache, drop ours."""
    model = debug_model()
    apply_activation_checkpointing(model, "selective", "op")
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="backward an extra time"):
        split_backward(model, tokens)


def test_none_leaves_the_model_alone():
    model = debug_model()
    blocks = list(model.layers.values())
    apply_activation_checkpointing(model, "none", "op")
    assert list(model.layers.values()) == blocks
    apply_activation_checkpointing(model, "memory_budget")  # compile's partitioner chooses (apply_compile)
    apply_activation_checkpointing(model, "offload")  # hooks, not wrappers (offload_activations)
    assert list(model.layers.values()) == blocks
    assert AC_MODES == ("none", "full", "selective", "memory_budget", "offload")


@pytest.mark.parametrize(
    "mode, option, culprit",
    [("partial", "op", "'partial'"), ("selective", "ops", "'ops'"), ("selective", "0", "'0'"), ("selective", -2, "-2")],
)
def test_bad_mode_or_option_is_a_value_error_naming_it(mode, option, culprit):
    model = debug_model()
    with pytest.raises(ValueError, match=culprit):
        apply_activation_checkpointing(model, mode, option)
    assert not any(isinstance(block, CheckpointWrapper) for block in model.layers.values())


def test_compile_wraps_each_block_on_its_own():
    # Structure only: compiling even this model takes over 20 s on a cold CPU cache; the
    # trainer's tests run compiled training.
    model = debug_model()
    blocks = list(model.layers.values())
    apply_compile(model)
    assert [block._orig_mod for block in model.layers.values()] == blocks
    assert all(isinstance(block, torch._dynamo.eval_frame.OptimizedModule) for block in model.layers.values())


def saved_activation_bytes(model) -> int:
    """Bytes autograd keeps from forward for backward, parameters left out: the activation memory
    that checkpointing trades for recompute (what peak memory grows with, counted exactly). What
    a checkpointed block keeps inside (selective "op": attention's and every second matmul's
    outputs) is not visible here."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        if tensor.data_ptr() not in params:
            seen[tensor.data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    tokens = torch.randint(0, DEBUG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens[:, :-1]).sum().backward()
    return sum(seen.values())


def test_checkpointing_keeps_fewer_activations():
    saved = {}
    for mode, option in (("none", "op"), ("selective", "2"), ("full", "op")):
        model = debug_model()
        apply_activation_checkpointing(model, mode, option)
        saved[f"{mode} {option}"] = saved_activation_bytes(model)
    print("activation bytes kept for backward:", {k: f"{v / 1024:.0f} KiB ({v / saved['none op']:.2f}x)" for k, v in saved.items()})
    # every block checkpointed keeps only block inputs; every second one, about half
    assert saved["full op"] < saved["selective 2"] < saved["none op"]
    assert saved["full op"] < saved["none op"] / 4
