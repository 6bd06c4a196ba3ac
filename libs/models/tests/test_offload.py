"""Activation offload (tessera.models.offload_activations): every tensor a block saves for
backward, parameters aside, is copied out during forward and backward reads the copy, so the loss
and gradients equal the plain model's exactly, eager and with the blocks compiled; a tensor
saved by several ops is copied once; the hooks leave no state behind after forward."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tessera.models import apply_compile, offload_activations
from tessera.models import offload as offload_module
from tessera.models.llama import Transformer, llama3_flavors

DEBUG = replace(llama3_flavors["debugmodel"], dim=32, n_layers=3, n_heads=2, vocab_size=64, max_seq_len=16)


def debug_model():
    torch.manual_seed(0)
    return Transformer(DEBUG)


def _loss_and_grads(model):
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss, {name.replace("._orig_mod", ""): p.grad for name, p in model.named_parameters()}


class _Recorder:
    """Wraps copy_to_host: what was copied, and the packed copies backward read back."""

    def __init__(self, monkeypatch):
        self.copied, self.read = [], 0
        to_host, back = offload_module.copy_to_host, offload_module.copy_back

        def copy_to_host(t):
            self.copied.append(t)
            return to_host(t)

        def copy_back(packed):
            self.read += 1
            return back(packed)

        monkeypatch.setattr(offload_module, "copy_to_host", copy_to_host)
        monkeypatch.setattr(offload_module, "copy_back", copy_back)


@pytest.mark.parametrize("compiled", [False, True])
def test_offloaded_blocks_train_exactly_as_the_plain_model(monkeypatch, compiled):
    reference, model = debug_model(), debug_model()
    if compiled:
        apply_compile(reference)
        apply_compile(model)
    want_loss, want = _loss_and_grads(reference)
    offload_activations(model)
    recorder = _Recorder(monkeypatch)
    loss, grads = _loss_and_grads(model)
    assert loss.item() == want_loss.item()
    for name, grad in want.items():
        assert torch.equal(grads[name], grad), name
    params = {id(p) for p in model.parameters()}
    assert recorder.copied and not any(id(t) in params or id(t._base) in params for t in recorder.copied)
    assert recorder.read >= len(recorder.copied)  # each copy read back at least once (a shared one by each op)
    ids = [id(t) for t in recorder.copied]
    assert len(ids) == len(set(ids)), "a tensor saved twice was copied twice"


def test_a_forward_that_raises_leaves_no_hooks_active(monkeypatch):
    model = debug_model()
    offload_activations(model)
    recorder = _Recorder(monkeypatch)
    block = next(iter(model.layers.values()))
    with pytest.raises(RuntimeError):
        block(torch.zeros(1, 4, DEBUG.dim + 1, requires_grad=True), rope=None)  # a bad shape inside the block
    copied_inside = len(recorder.copied)
    a = torch.ones(3, requires_grad=True)
    (a * a).sum().backward()  # outside any block: saved as it is, not through a left-over hook
    assert len(recorder.copied) == copied_inside
