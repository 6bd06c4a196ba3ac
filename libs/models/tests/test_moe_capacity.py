"""Capacity-factor dispatch (tessera.models.moe.capacity) against dropless and against a
slot-by-slot reference of GShard's drop-and-pad (and the one-round reroute)."""

import copy
import math

import pytest
import torch

from tessera.models.gpt_oss.experts import GptOssExperts
from tessera.models.moe import MoE, MoEArgs, expert_capacity, set_expert_capacity, update_expert_bias

DEEPSEEK = MoEArgs(n_experts=8, top_k=3, hidden_dim=16, n_shared_experts=2, score_func="sigmoid", route_norm=True,
                   route_scale=2.5, n_groups=4, topk_groups=2)
LLAMA4 = MoEArgs(n_experts=4, top_k=1, hidden_dim=16, n_shared_experts=1, score_func="sigmoid",
                 score_before_experts=True)
GPT_OSS = MoEArgs(n_experts=4, top_k=2, hidden_dim=16, score_func="softmax", route_norm=True, gate_bias=True)
DIM = 24


def make_layer(args, seed=0):
    torch.manual_seed(seed)
    experts = GptOssExperts(DIM, args.hidden_dim, args.n_experts, 7.0, 1.702) if args.gate_bias else None
    layer = MoE(DIM, args, experts)
    layer.init_weights(0.1)
    with torch.no_grad():
        layer.expert_bias.copy_(0.05 * torch.randn(args.n_experts))
        for p in layer.parameters():
            p.add_(0.01 * torch.randn_like(p))  # GPT-OSS's zero-initialised biases too
    return layer


def run(layer, x, grad):
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return [out, x.grad, *(p.grad for p in layer.parameters())]


def routed_counts(layer, x):
    _, experts, _ = layer.router(x.reshape(-1, DIM), layer.expert_bias)
    return torch.bincount(experts.flatten(), minlength=layer.args.n_experts)


@pytest.mark.parametrize("args", [DEEPSEEK, LLAMA4, GPT_OSS], ids=["deepseek", "llama4", "gpt_oss"])
@pytest.mark.parametrize("overflow", ["drop", "reroute"])
def test_capacity_equals_dropless_when_no_expert_is_over_capacity(args, overflow):
    """C exactly the busiest expert's load: every slot kept, the same rows through the same
    experts, in [E, C] instead of sorted by expert. fp32 within 1e-6: sgemm rounds a row by the
    number of rows it is multiplied with, so bit for bit is not on offer."""
    dropless = make_layer(args)
    x, grad = torch.randn(2, 10, DIM), torch.randn(2, 10, DIM)
    slots = 20 * args.top_k
    busiest = int(routed_counts(dropless, x).max())
    capped = copy.deepcopy(dropless)
    set_expert_capacity(capped, busiest * args.n_experts / slots, overflow)
    assert expert_capacity(slots, args.n_experts, capped.capacity_factor) == busiest
    for got, want in zip(run(capped, x, grad), run(dropless, x, grad)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert int(capped.dropped_slots) == 0
    assert torch.equal(capped.tokens_per_expert, dropless.tokens_per_expert)


@torch.no_grad()
def reference(layer, x, capacity, overflow):
    """Slot by slot: each expert keeps its `capacity` highest-weight slots; with "reroute" each
    token's j-th dropped slot tries its j-th best unchosen expert (by score + bias), which takes
    rerouted slots, best new weights first, into the room left. Returns (output, dropped)."""
    a, tokens = layer.args, x.reshape(-1, DIM)
    weights, experts, scores = layer.router(tokens, layer.expert_bias)
    slots = [(n, k, int(experts[n, k]), float(weights[n, k])) for n in range(len(tokens)) for k in range(a.top_k)]
    kept, load = {}, [0] * a.n_experts
    for n, k, e, w in sorted(slots, key=lambda s: -s[3]):  # stable: ties keep slot order
        if load[e] < capacity:
            kept[n, k], load[e] = (e, w), load[e] + 1
    if overflow == "reroute":
        candidates = []
        for n in range(len(tokens)):
            choice = (scores[n] + layer.expert_bias).tolist()
            unchosen = sorted((e for e in range(a.n_experts) if e not in experts[n].tolist()), key=lambda e: -choice[e])
            dropped = [k for k in range(a.top_k) if (n, k) not in kept]
            for j, k in enumerate(dropped[:len(unchosen)]):
                e_old, e_new = int(experts[n, k]), unchosen[j]
                new_w = float(scores[n, e_new] * weights[n, k] / scores[n, e_old])
                candidates.append((n, k, e_new, new_w))
        for n, k, e, w in sorted(candidates, key=lambda s: -s[3]):
            if load[e] < capacity:
                kept[n, k], load[e] = (e, w), load[e] + 1
    out = []
    for n, token in enumerate(tokens):
        y = layer.shared_experts(token) if layer.shared_experts is not None else torch.zeros_like(token)
        for k in range(a.top_k):
            if (n, k) in kept:
                e, w = kept[n, k]
                one = torch.zeros(a.n_experts, dtype=torch.long)
                one[e] = 1
                row = token * w if a.score_before_experts else token
                result = layer.experts(row[None], one)[0]
                y = y + (result if a.score_before_experts else w * result)
        out.append(y)
    return torch.stack(out).view_as(x), len(slots) - len(kept)


@pytest.mark.parametrize("args", [DEEPSEEK, LLAMA4], ids=["deepseek", "llama4"])
@pytest.mark.parametrize("overflow", ["drop", "reroute"])
def test_a_skewed_router_drops_the_lowest_weights_and_counts_them(args, overflow):
    """A router bias sends most slots to expert 0: it keeps its C best, the rest drop (or are
    rerouted where there is room), the output is the slot-by-slot reference's and the count of
    dropped slots is exact."""
    layer = make_layer(args)
    with torch.no_grad():
        layer.expert_bias[0] += 10.0
    x = torch.randn(2, 10, DIM)
    slots = 20 * args.top_k
    counts = routed_counts(layer, x)
    assert counts[0] == 20  # every token chose expert 0
    set_expert_capacity(layer, 0.5, overflow)
    capacity = expert_capacity(slots, args.n_experts, 0.5)
    want, dropped = reference(layer, x, capacity, overflow)
    if overflow == "drop":
        assert dropped == sum(max(int(c) - capacity, 0) for c in counts)
    assert dropped > 0
    layer.train()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    assert int(layer.dropped_slots) == dropped
    readings = update_expert_bias(layer)
    assert int(readings["/dropped"]) == dropped and int(layer.dropped_slots) == 0  # read once, then restarted


def test_rounds_to_the_multiple_the_experts_ask_for():
    assert expert_capacity(60, 8, 1.0) == 8 and expert_capacity(60, 8, 1.0, multiple=16) == 16
    assert expert_capacity(3, 8, 0.1) == 1  # at least one row per expert
    assert expert_capacity(64, 8, 1.25) == math.ceil(1.25 * 8)


def test_compiled_capacity_layer_matches_eager():
    """Static shapes end to end: the whole layer in one graph (aot_eager: what dynamo and
    AOTAutograd see), forward and gradients as eager."""
    layer = make_layer(DEEPSEEK)
    set_expert_capacity(layer, 1.0, "reroute")
    compiled = copy.deepcopy(layer)
    x, grad = torch.randn(2, 10, DIM), torch.randn(2, 10, DIM)
    got = run(torch.compile(compiled, fullgraph=True, backend="aot_eager"), x, grad)
    for a, b in zip(got, run(layer, x, grad)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
