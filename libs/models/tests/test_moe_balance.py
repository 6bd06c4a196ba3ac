"""Auxiliary-loss-free balancing (bias update) and the sequence-wise balance loss."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

from tessera.models.moe import (
    MoE, MoEArgs, expert_load, force_load_balance, load_imbalance, moe_layers, sequence_balance_loss,
    set_aux_loss_scale, update_expert_bias,
)


def skewed_layer_and_tokens(rate=0.01):
    """Tokens share a common direction the gate rows of experts 0 and 1 point along, so plain
    routing sends most tokens to them."""
    torch.manual_seed(0)
    args = MoEArgs(n_experts=8, top_k=2, hidden_dim=8, score_func="sigmoid", route_norm=True, bias_update_rate=rate)
    layer = MoE(16, args)
    layer.init_weights(0.05)
    common = torch.randn(16)
    with torch.no_grad():
        layer.router.gate.weight[:2] += common / common.norm()
    return layer, torch.randn(4, 64, 16) + 2 * common / common.norm()


def test_bias_update_moves_load_toward_balance():
    layer, x = skewed_layer_and_tokens()
    model = nn.ModuleDict({"0": layer})
    with torch.no_grad():
        layer(x)
        before = load_imbalance(expert_load(model)["0"])
        for _ in range(60):
            loads = update_expert_bias(model)  # a post-optimizer hook: counts since the last call
            layer(x)
        after = load_imbalance(expert_load(model)["0"])
    print(f"imbalance (max/mean load) before {before:.2f}, after 60 updates {after:.2f}")
    assert before > 3.0 and after < 1.5, (before, after)
    assert layer.expert_bias[:2].max() < layer.expert_bias[2:].min()  # favoured experts pushed down
    assert torch.equal(loads["0"].sum(), torch.tensor(4 * 64 * 2))


def test_update_step_is_rate_times_sign_and_resets_counts():
    layer, x = skewed_layer_and_tokens(rate=0.25)
    with torch.no_grad():
        layer(x)
    load = layer.tokens_per_expert.clone()
    returned = update_expert_bias(layer)[""]
    assert torch.equal(returned, load) and torch.equal(layer.tokens_per_expert, torch.zeros_like(load))
    torch.testing.assert_close(layer.expert_bias, 0.25 * torch.sign(load.float().mean() - load.float()))


def test_zero_rate_leaves_bias_alone():
    layer, x = skewed_layer_and_tokens(rate=0.0)
    with torch.no_grad():
        layer(x)
    update_expert_bias(layer)
    assert torch.equal(layer.expert_bias, torch.zeros(8))


def test_sequence_balance_loss_by_hand():
    # Sequence 0 (softmax-like rows): top-1 experts 0 then 1 -> f = 3/(1*2) * [1, 1, 0] = [1.5, 1.5, 0],
    # P = [0.3, 0.45, 0.25], loss 1.5*0.3 + 1.5*0.45 = 1.125. Sequence 1 (sigmoid-like rows, normalised
    # to [0.4, 0.2, 0.4] and [0.2, 0.2, 0.6]): experts 2, 2 -> f = [0, 0, 3], P = [0.3, 0.2, 0.5], loss 1.5.
    scores = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]],
                           [[0.8, 0.4, 0.8], [0.2, 0.2, 0.6]]])
    experts = torch.tensor([[[0], [1]], [[2], [2]]])
    assert sequence_balance_loss(scores, experts).item() == pytest.approx((1.125 + 1.5) / 2)


def test_perfect_balance_gives_loss_one_for_uniform_scores():
    scores = torch.full((1, 4, 4), 0.25)
    experts = torch.tensor([[[0, 1], [2, 3], [0, 2], [1, 3]]])
    assert sequence_balance_loss(scores, experts).item() == pytest.approx(1.0)


def test_aux_loss_gradient_equals_adding_it_to_the_scaled_loss():
    """With scale s (the trainer's 1 / micro-batches), backward through the layer's output adds
    s * alpha * balance loss to the gradients, as if it were part of the loss."""
    args = MoEArgs(n_experts=8, top_k=2, hidden_dim=8, n_shared_experts=1, score_func="sigmoid", route_norm=True,
                   aux_loss_alpha=0.3)
    torch.manual_seed(0)
    layer = MoE(16, args)
    layer.init_weights(0.2)
    plain = copy.deepcopy(layer)
    plain.args = dataclasses.replace(args, aux_loss_alpha=0.0)
    set_aux_loss_scale(layer, 0.25)
    x = torch.randn(3, 10, 16)
    (0.25 * layer(x).square().sum()).backward()

    out = plain(x)
    _, experts, scores = plain.router(x.reshape(-1, 16), plain.expert_bias)
    balance = sequence_balance_loss(scores.view(3, 10, -1), experts.view(3, 10, -1))
    aux_grad, = torch.autograd.grad(0.25 * 0.3 * balance, plain.router.gate.weight, retain_graph=True)
    assert aux_grad.abs().max() > 1e-4  # the term matters
    (0.25 * (out.square().sum() + 0.3 * balance)).backward()
    assert layer.aux_loss.item() == pytest.approx(0.3 * balance.item())
    for (name, p), p_plain in zip(layer.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, p_plain.grad, msg=name)


def test_no_aux_loss_without_grad():
    args = MoEArgs(n_experts=4, top_k=1, hidden_dim=8, aux_loss_alpha=0.5)
    layer = MoE(8, args)
    layer.init_weights(0.1)
    with torch.no_grad():
        layer(torch.randn(1, 3, 8))
    assert layer.aux_loss.item() == 0.0


def test_evaluation_forwards_do_not_count_toward_the_load():
    layer, x = skewed_layer_and_tokens()
    with torch.no_grad():
        layer.eval()
        layer(x)  # validation: the bias must follow the training tokens only
        assert not layer.tokens_per_expert.any()
        layer.train()
        layer(x)
    assert layer.tokens_per_expert.sum() == 4 * 64 * 2


def test_forced_load_balance_routes_round_robin():
    layer, x = skewed_layer_and_tokens()
    force_load_balance(nn.ModuleDict({"0": layer}))
    with torch.no_grad():
        layer(x)
    assert torch.equal(layer.tokens_per_expert, torch.full((8,), 4 * 64 * 2 // 8))  # skewed input, even load


def test_layer_names_leave_out_checkpoint_and_compile_wrappers():
    """Expert-load metrics keep their names whatever wraps the blocks."""
    from tessera.models import apply_activation_checkpointing, apply_compile

    layer, _ = skewed_layer_and_tokens()
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Sequential(copy.deepcopy(layer)), "1": nn.Sequential(layer)})
    apply_activation_checkpointing(model, "full")
    apply_compile(model)  # wraps only: nothing runs, nothing compiles
    assert "_orig_mod._checkpoint_wrapped_module" in next(n for n, m in model.named_modules() if isinstance(m, MoE))
    assert list(moe_layers(model)) == ["layers.0.0", "layers.1.0"]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpoint_recomputation_does_not_count_toward_the_load(mode):
    """Each training token counts once, however often backward recomputes its layer (twice
    under split-backward pipeline schedules: input, then weight gradients)."""
    from tessera.models import apply_activation_checkpointing

    layer, x = skewed_layer_and_tokens()
    reference = copy.deepcopy(layer)
    with torch.no_grad():
        reference(x)
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": layer})
    apply_activation_checkpointing(model, mode, "op", split_backward=True)
    out = model.layers["0"](x.requires_grad_()).square().sum()
    torch.autograd.grad(out, [x], retain_graph=True)
    torch.autograd.grad(out, list(layer.parameters()))
    assert reference.tokens_per_expert.sum() == x.shape[0] * x.shape[1] * 2  # top 2
    assert torch.equal(layer.tokens_per_expert, reference.tokens_per_expert)
