"""Top-k routing against a per-token Python reference written from the papers' definitions."""

import pytest
import torch

from tessera.models.moe import MoEArgs, TopKRouter, select_experts


def naive_route(scores: list[float], bias: list[float], a: MoEArgs) -> tuple[list[int], list[float]]:
    """One token: choose among the allowed experts by score + bias; weights from the scores."""
    choice = [s + b for s, b in zip(scores, bias)]
    allowed = list(range(a.n_experts))
    if a.n_groups > 1:
        size = a.n_experts // a.n_groups
        group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:a.group_score_top])
                       for g in range(a.n_groups)]
        best = sorted(range(a.n_groups), key=lambda g: -group_score[g])[:a.topk_groups]
        allowed = [e for e in allowed if e // size in best]
    chosen = sorted(allowed, key=lambda e: -choice[e])[:a.top_k]
    weights = [scores[e] for e in chosen]
    if a.route_norm:
        weights = [w / sum(weights) for w in weights]
    return chosen, [w * a.route_scale for w in weights]


CASES = {
    "softmax": MoEArgs(n_experts=8, top_k=2, score_func="softmax"),
    "softmax_norm_scaled": MoEArgs(n_experts=8, top_k=3, score_func="softmax", route_norm=True, route_scale=1.7),
    "v3_sigmoid_groups": MoEArgs(n_experts=16, top_k=4, score_func="sigmoid", route_norm=True, route_scale=2.5,
                                 n_groups=4, topk_groups=2, group_score_top=2),
    "v2_group_max": MoEArgs(n_experts=12, top_k=3, score_func="softmax", route_scale=16.0, n_groups=4,
                            topk_groups=2, group_score_top=1),
}


@pytest.mark.parametrize("name", CASES)
def test_router_matches_per_token_reference(name):
    args = CASES[name]
    torch.manual_seed(0)
    router = TopKRouter(16, args)
    router.init_weights(0.5)
    x = torch.randn(40, 16)
    bias = 0.05 * torch.randn(args.n_experts)
    weights, experts, scores = router(x, bias)
    assert weights.dtype == scores.dtype == torch.float32 and experts.shape == (40, args.top_k)
    for t in range(x.shape[0]):
        chosen, expected = naive_route(scores[t].tolist(), bias.tolist(), args)
        order = experts[t].tolist()
        assert sorted(order) == sorted(chosen), t
        got = dict(zip(order, weights[t].tolist()))
        assert [got[e] for e in chosen] == pytest.approx(expected, rel=1e-5), t


def test_scores_are_softmax_or_sigmoid_of_the_gate():
    torch.manual_seed(0)
    x = torch.randn(5, 16)
    for func in ("softmax", "sigmoid"):
        router = TopKRouter(16, MoEArgs(n_experts=8, top_k=2, score_func=func))
        logits = x @ router.gate.weight.T
        expected = logits.softmax(-1) if func == "softmax" else torch.sigmoid(logits)
        torch.testing.assert_close(router(x)[2], expected)


def test_group_limit_changes_the_choice():
    """An expert that wins overall but sits in a group whose top-2 sum loses is not chosen."""
    scores = torch.tensor([[0.9, 0.0, 0.6, 0.5, 0.4, 0.35, 0.1, 0.05]])
    assert select_experts(scores, 2).tolist() == [[0, 2]]  # no groups: best two overall
    limited = select_experts(scores, 2, n_groups=4, topk_groups=1, group_score_top=2)
    assert sorted(limited[0].tolist()) == [2, 3]  # group 1 (0.6 + 0.5) beats group 0 (0.9 + 0.0)
    assert select_experts(scores, 2, n_groups=4, topk_groups=1, group_score_top=1)[0].tolist()[0] == 0  # by max


def test_bias_steers_choice_but_not_weights():
    router = TopKRouter(4, MoEArgs(n_experts=4, top_k=1, score_func="sigmoid"))
    x = torch.randn(6, 4)
    _, _, scores = router(x)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    weights, experts, _ = router(x, bias)
    assert experts.flatten().tolist() == [3] * 6
    torch.testing.assert_close(weights.flatten(), scores[:, 3])


@pytest.mark.parametrize("changes, culprit", [
    (dict(score_func="relu"), "score_func"),
    (dict(n_experts=8, n_groups=3), "n_groups=3"),
    (dict(n_experts=8, n_groups=4, topk_groups=5), "topk_groups=5"),
    (dict(n_experts=8, n_groups=4, topk_groups=1, top_k=3), "top_k=3"),
    (dict(n_experts=8, n_groups=4, group_score_top=3), "group_score_top=3"),
])
def test_bad_args_name_the_culprit(changes, culprit):
    with pytest.raises(ValueError, match=culprit):
        MoEArgs(**changes)
