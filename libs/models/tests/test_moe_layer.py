"""The MoE layer and its experts against a per-token loop over the chosen experts, and the
experts' grouped and batched matmuls against one expert at a time."""

import copy

import torch
import torch.nn.functional as F

from tessera.models.moe import GroupedExperts, MoE, MoEArgs, experts_bmm, experts_grouped_mm

ARGS = MoEArgs(n_experts=8, top_k=3, hidden_dim=16, n_shared_experts=2, score_func="sigmoid", route_norm=True,
               route_scale=2.5, n_groups=4, topk_groups=2)


def make_layer(args=ARGS, dim=24, seed=0):
    torch.manual_seed(seed)
    layer = MoE(dim, args)
    layer.init_weights(0.1)
    with torch.no_grad():
        layer.expert_bias.copy_(0.05 * torch.randn(args.n_experts))
    return layer


def naive_moe(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """y_t = shared(x_t) + sum over the token's chosen experts e of w_e * SwiGLU_e(x_t), one token at
    a time; selection by score + bias, restricted to the best groups (top-2 sums)."""
    a, experts = layer.args, layer.experts
    rows = []
    for token in x.reshape(-1, x.shape[-1]):
        logits = layer.router.gate.weight @ token
        scores = torch.sigmoid(logits) if a.score_func == "sigmoid" else torch.softmax(logits, 0)
        choice = (scores + layer.expert_bias).tolist()
        size = a.n_experts // a.n_groups
        group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:a.group_score_top])
                       for g in range(a.n_groups)]
        groups = sorted(range(a.n_groups), key=lambda g: -group_score[g])[:a.topk_groups]
        chosen = sorted([e for e in range(a.n_experts) if e // size in groups], key=lambda e: -choice[e])[:a.top_k]
        weights = scores[chosen]
        weights = (weights / weights.sum() if a.route_norm else weights) * a.route_scale
        y = layer.shared_experts(token) if layer.shared_experts is not None else torch.zeros_like(token)
        for w, e in zip(weights, chosen):
            y = y + w * (experts.w2[e] @ (F.silu(experts.w1[e] @ token) * (experts.w3[e] @ token)))
        rows.append(y)
    return torch.stack(rows).view_as(x)


def test_forward_and_grads_match_per_token_loop():
    layer = make_layer()
    reference = copy.deepcopy(layer)
    x = torch.randn(2, 7, 24, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, expected = layer(x), naive_moe(reference, x_ref)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for (name, p), p_ref in zip(layer.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_softmax_layer_without_shared_experts_matches_loop():
    args = MoEArgs(n_experts=6, top_k=2, hidden_dim=8, score_func="softmax", route_norm=True)
    layer = make_layer(args, dim=16)
    x = torch.randn(3, 5, 16)
    assert layer.shared_experts is None
    torch.testing.assert_close(layer(x), naive_moe(layer, x), rtol=1e-5, atol=1e-5)


def test_tokens_per_expert_counts_every_forward():
    layer = make_layer()
    x = torch.randn(2, 7, 24)
    _, experts, _ = layer.router(x.reshape(-1, 24), layer.expert_bias)
    layer(x)
    layer(x)
    expected = torch.bincount(experts.flatten(), minlength=ARGS.n_experts)
    assert torch.equal(layer.tokens_per_expert, 2 * expected)
    assert layer.tokens_per_expert.sum() == 2 * 14 * ARGS.top_k


def random_groups(n_experts=4, dim=16, hidden=8, counts=(3, 0, 5, 7), dtype=torch.float32):
    torch.manual_seed(0)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), dim, dtype=dtype)
    weights = [0.3 * torch.randn(shape, dtype=dtype) for shape in
               ((n_experts, hidden, dim), (n_experts, dim, hidden), (n_experts, hidden, dim))]
    return x, counts, weights


def experts_loop(x, counts, w1, w2, w3):
    """The reference: one SwiGLU per expert over its slice of rows."""
    return torch.cat([F.silu(rows @ w1[e].T) * (rows @ w3[e].T) @ w2[e].T
                      for e, rows in enumerate(x.split(counts.tolist()))])


def test_grouped_mm_equals_loop_fp32_forward_and_backward():
    """On CPU torch's grouped matmul runs one matmul per group, as the loop does (sgemm rounds a
    row by the operands' layout, so within rounding, not bit for bit)."""
    x, counts, weights = random_groups()
    inputs = [t.clone().requires_grad_() for t in (x, *weights)]
    reference = [t.clone().requires_grad_() for t in (x, *weights)]
    out = experts_grouped_mm(inputs[0], counts, *inputs[1:])
    expected = experts_loop(reference[0], counts, *reference[1:])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for got, want in zip(inputs, reference):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)


def test_bfloat16_experts_agree_with_the_fp32_loop():
    experts = GroupedExperts(16, 8, 4).to(torch.bfloat16)
    experts.init_weights(0.1)
    x, counts, _ = random_groups(dtype=torch.bfloat16)
    expected = experts_loop(x.float(), counts, experts.w1.float(), experts.w2.float(), experts.w3.float())
    torch.testing.assert_close(experts(x, counts).float(), expected, rtol=2e-2, atol=2e-3)


def test_equal_groups_run_as_batched_matmuls():
    """Counts None: E groups of C rows (capacity-factor dispatch) through bmm, as the loop would."""
    x, _, (w1, w2, w3) = random_groups(counts=(5, 5, 5, 5))
    experts = GroupedExperts(16, 8, 4)
    with torch.no_grad():
        experts.w1.copy_(w1), experts.w2.copy_(w2), experts.w3.copy_(w3)
    torch.testing.assert_close(experts(x, None), experts_loop(x, torch.tensor([5] * 4), w1, w2, w3),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(experts_bmm(x, w1, w2, w3), experts(x, None), rtol=0, atol=0)


def test_compiled_experts_in_fp32_match_eager():
    """torch._grouped_mm's meta function takes bfloat16 only: fp32 reaches it through the custom op,
    whose backward is its own grouped matmuls (eager keeps torch's): equal to fp32 rounding."""
    x, counts, weights = random_groups()
    experts = GroupedExperts(16, 8, 4)
    with torch.no_grad():
        for p, w in zip((experts.w1, experts.w2, experts.w3), weights):
            p.copy_(w)
    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    x = x.requires_grad_()
    compiled(x, counts).sum().backward()
    grads = [x.grad.clone(), *(p.grad.clone() for p in experts.parameters())]
    x.grad = None
    experts.zero_grad()
    experts(x, counts).sum().backward()
    for got, want in zip(grads, [x.grad, *(p.grad for p in experts.parameters())]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_experts_holding_a_shard_serve_their_rows():
    """The expert-parallel seam: a module holding experts 2..3 of 4 (dim-0 shard), given only those
    experts' rows and counts, returns what the whole module returns for them."""
    x, counts, (w1, w2, w3) = random_groups()
    full = GroupedExperts(16, 8, 4)
    local = GroupedExperts(16, 8, 2)
    with torch.no_grad():
        for module, part in ((full, slice(None)), (local, slice(2, 4))):
            module.w1.copy_(w1[part]), module.w2.copy_(w2[part]), module.w3.copy_(w3[part])
    torch.testing.assert_close(local(x[3:], counts[2:]), full(x, counts)[3:])


def test_meta_build_then_init_resets_buffers():
    with torch.device("meta"):
        layer = MoE(24, ARGS)
    layer.to_empty(device="cpu")
    layer.init_weights(0.02)
    assert torch.equal(layer.expert_bias, torch.zeros(8))
    assert torch.equal(layer.tokens_per_expert, torch.zeros(8, dtype=torch.long))
    assert set(layer.state_dict()) == {"expert_bias", "router.gate.weight", "experts.w1", "experts.w2", "experts.w3",
                                       *(f"shared_experts.{w}.weight" for w in ("w1", "w2", "w3"))}
    assert layer.shared_experts.w1.weight.shape == (ARGS.n_shared_experts * ARGS.hidden_dim, 24)
    assert torch.isfinite(layer(torch.randn(1, 4, 24))).all()


def test_bias_stays_float32_under_dtype_casts():
    layer = make_layer().to(torch.bfloat16)
    assert layer.expert_bias.dtype == torch.float32 and layer.router.gate.weight.dtype == torch.bfloat16
    assert layer(torch.randn(1, 4, 24, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_grouped_experts_follow_autocast():
    """Under autocast (the trainer's one-process mixed precision) the experts' grouped matmuls run
    in its dtype, as the model's other matmuls do: torch has no autocast rule for them."""
    x, counts, _ = random_groups()
    experts = GroupedExperts(16, 8, 4)
    experts.init_weights(0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert experts(x, counts).dtype == torch.bfloat16
        assert experts(x[:12], None).dtype == torch.bfloat16  # bmm: autocast's own rule
