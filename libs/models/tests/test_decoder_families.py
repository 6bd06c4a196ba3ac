"""DeepSeek-V3 and Qwen3 (dense and MoE) keep the decoder conventions, train, and count FLOPs."""

import copy
import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from tessera.models import (
    ARGS_FILE, apply_activation_checkpointing, args_record, get_model_spec, num_params, read_args_record,
)
from tessera.models.deepseek_v3 import DeepSeekV3Args, YarnScaling
from tessera.models.moe import MoEArgs, set_aux_loss_scale, update_expert_bias
from tessera.models.qwen3 import Qwen3Args

TINY = {
    "deepseek_v3": DeepSeekV3Args(
        vocab_size=64, dim=32, n_layers=3, n_dense_layers=1, n_heads=4, inter_dim=64,
        moe=MoEArgs(n_experts=8, top_k=3, hidden_dim=16, n_shared_experts=1, score_func="sigmoid", route_norm=True,
                    route_scale=2.5, n_groups=4, topk_groups=2, bias_update_rate=1e-3, aux_loss_alpha=0.01),
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        yarn=YarnScaling(factor=4.0, original_max_position_embeddings=8, mscale=0.707), max_seq_len=32),
    "qwen3": Qwen3Args(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=64,
                       max_seq_len=32, tie_embeddings=True),
    "qwen3_moe": Qwen3Args(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=64,
                           moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=16, route_norm=True), max_seq_len=32),
}


def spec_of(family):
    return get_model_spec(family.removesuffix("_moe"))


def build(family, seed=0):
    torch.manual_seed(seed)
    return spec_of(family).build(TINY[family])


def meta_then_init(family, seed):
    with torch.device("meta"):
        model = spec_of(family).build(TINY[family])
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


@pytest.mark.parametrize("family", TINY)
def test_meta_build_then_init(family):
    a, b, c = meta_then_init(family, 0), meta_then_init(family, 0), meta_then_init(family, 1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.isfinite(pa).all() and torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    torch.testing.assert_close(a.rope, build(family).rope)
    assert "rope" not in a.state_dict() and list(a.layers) == [str(i) for i in range(TINY[family].n_layers)]
    for name, buffer in a.named_buffers():
        if name.endswith(("expert_bias", "tokens_per_expert")):
            assert not buffer.any(), name
    assert torch.isfinite(a(torch.randint(0, 64, (2, 8)))).all()


def test_module_names():
    names = {name for name, _ in build("deepseek_v3").named_parameters()}
    assert {"tok_embeddings.weight", "layers.0.feed_forward.w1.weight", "layers.1.attention.wq_a.weight",
            "layers.1.attention.q_norm.weight", "layers.1.attention.wq_b.weight", "layers.1.attention.wkv_a.weight",
            "layers.1.attention.kv_norm.weight", "layers.1.attention.wkv_b.weight", "layers.1.attention.wo.weight",
            "layers.1.moe.router.gate.weight", "layers.1.moe.experts.w1", "layers.1.moe.shared_experts.w2.weight",
            "norm.weight", "output.weight"} <= names
    assert "layers.0.moe.router.gate.weight" not in names and "layers.1.feed_forward.w1.weight" not in names
    names = {name for name, _ in build("qwen3_moe").named_parameters()}
    assert {"layers.0.attention.q_norm.weight", "layers.0.attention.k_norm.weight", "layers.1.moe.experts.w3"} <= names
    assert not any("shared_experts" in name or "feed_forward" in name for name in names)


@pytest.mark.parametrize("family", TINY)
def test_causal_and_positions(family):
    model = build(family)
    tokens = torch.randint(0, 64, (2, 12))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 64
    before = model(tokens)
    torch.testing.assert_close(before[:, :7], model(changed)[:, :7])
    torch.testing.assert_close(model(tokens, positions=torch.arange(12).expand(2, 12)), before)
    # RoPE sees relative positions: a shift changes nothing, a gap does.
    torch.testing.assert_close(model(tokens, positions=torch.arange(12) + 5), before, rtol=1e-4, atol=1e-4)
    assert (model(tokens, positions=2 * torch.arange(12)) - before).abs().max() > 1e-5


@pytest.mark.parametrize("family", TINY)
def test_packed_documents_match_separate_runs(family):
    """document_ids reach the inner attention: a packed window [A | B] with B's positions restarted
    gives B the logits it gets alone."""
    model = build(family)
    a, b = torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 7))
    packed = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    documents = torch.tensor([[0] * 5 + [1] * 7])
    out = model(packed, positions=positions, document_ids=documents)
    torch.testing.assert_close(out[:, 5:], model(b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, :5], model(a), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", TINY)
def test_pipeline_stages_compose_to_full_model(family):
    model = build(family)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    for i in range(1, TINY[family].n_layers):
        del first.layers[str(i)]
    first.norm = first.output = None
    del last.layers["0"]
    last.tok_embeddings = None
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(last(first(tokens)), model(tokens))
    last.init_weights()  # what a stage holds initialises alone
    assert torch.isfinite(last(first(tokens))).all()


@pytest.mark.parametrize("family", TINY)
def test_trains_a_few_steps(family):
    """AdamW on one batch, the trainer's way: loss scaled by 1/2 micro-batches, aux-loss scale set
    to match, the router-bias update as a post-optimizer hook."""
    model = build(family)
    set_aux_loss_scale(model, 0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    batches = [torch.randint(0, 64, (2, 17)) for _ in range(2)]
    losses = []
    for _ in range(12):
        total = 0.0
        for batch in batches:
            loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()) / 2
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        update_expert_bias(model)
        losses.append(total)
    print(family, [round(x, 3) for x in losses])
    assert losses[-1] < 0.6 * losses[0], losses
    biases = [b for name, b in model.named_buffers() if name.endswith("expert_bias")]
    assert all(b.abs().max() > 0 for b in biases) and len(biases) == (2 if family != "qwen3" else 0)


@pytest.mark.parametrize("family", TINY)
def test_flops_count_only_active_experts(family):
    args = dataclasses.replace(TINY[family], **({"tie_embeddings": False} if family.startswith("qwen3") else {}))
    spec = spec_of(family)
    model = spec.build(args)
    moe, n_moe = args.moe, sum(block.moe is not None for block in model.layers.values())
    idle = n_moe * (moe.n_experts - moe.top_k) * 3 * args.dim * moe.hidden_dim if moe else 0
    assert spec.flops_per_token(args, 0) == 6 * (num_params(model, exclude_embedding=True) - idle)
    if family == "deepseek_v3":
        per_position = 6 * args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim)
    else:
        per_position = 12 * args.n_layers * args.n_heads * args.head_dim
    assert spec.flops_per_token(args, 100) - spec.flops_per_token(args, 0) == 100 * per_position


@pytest.mark.parametrize("family", TINY)
def test_bfloat16_cast_keeps_float32_tables(family):
    model = build(family).to(torch.bfloat16)
    assert model.rope.dtype == torch.float32
    torch.testing.assert_close(model.rope, build(family).rope)
    assert model(torch.randint(0, 64, (1, 8))).dtype == torch.bfloat16


def test_tied_embeddings_survive_to_empty():
    model = meta_then_init("qwen3", 0)
    assert model.output.weight is model.tok_embeddings.weight


def test_tp_plan_patterns_name_real_modules():
    """Each pattern matches in a flavor of the family; a flavor lacks the variants it does not use."""
    variants = {
        "deepseek_v3": [TINY["deepseek_v3"], dataclasses.replace(TINY["deepseek_v3"], q_lora_rank=0, num_mtp_layers=1)],
        "qwen3": [TINY["qwen3"], TINY["qwen3_moe"]],
    }
    for family, args_list in variants.items():
        spec = get_model_spec(family)
        names = set().union(*({name for name, _ in spec.build(a).named_modules()} for a in args_list))
        for pattern in spec.tp_plan:
            assert any(re.fullmatch(pattern.replace(".", r"\.").replace("*", r"\d+"), name) for name in names), pattern
    assert get_model_spec("qwen3").tp_divisible(TINY["qwen3"]) == {"n_heads": 4, "n_kv_heads": 2, "vocab_size": 64,
                                                                   "hidden_dim": 64}


@pytest.mark.parametrize("family, flavor, total, active, with_embedding", [
    ("deepseek_v3", "16B", 15.7e9, 2.4e9, False),  # DeepSeek-V2-Lite's 2.4B leaves the embedding out
    ("deepseek_v3", "236B", 235.7e9, 21e9, True),
    ("deepseek_v3", "671B", 671.0e9, 37e9, True),
    ("qwen3", "0.6B", 0.6e9, 0.6e9, True),
    ("qwen3", "8B", 8.2e9, 8.2e9, True),
    ("qwen3", "32B", 32.8e9, 32.8e9, True),
    ("qwen3", "30B-A3B", 30.5e9, 3.3e9, True),
])
def test_published_flavor_sizes(family, flavor, total, active, with_embedding):
    """Parameter counts of the flavors (built on meta) against the published totals and activated
    parameters, within 3% (the published figures are rounded)."""
    spec = get_model_spec(family)
    args = spec.flavors[flavor]
    with torch.device("meta"):
        model = spec.build(args)
    assert num_params(model) == pytest.approx(total, rel=0.03)
    # flops_per_token / 6 counts the output projection, tied or not, and never the embedding.
    tied = getattr(args, "tie_embeddings", False)
    embedding = args.vocab_size * args.dim if with_embedding and not tied else 0
    assert spec.flops_per_token(args, 0) / 6 + embedding == pytest.approx(active, rel=0.03)


@pytest.mark.parametrize("family, flavor", [("deepseek_v3", "671B"), ("deepseek_v3", "16B"), ("qwen3", "30B-A3B"),
                                            ("qwen3", "0.6B")])
def test_args_record_round_trip(tmp_path, family, flavor):
    """Checkpoints record the args as JSON (nested MoE and YaRN dataclasses, None included)."""
    spec = get_model_spec(family)
    (tmp_path / ARGS_FILE).write_bytes(args_record(spec, spec.flavors[flavor], flavor=flavor))
    read_spec, args, _ = read_args_record(tmp_path)
    assert read_spec is spec and args == spec.flavors[flavor]


@pytest.mark.parametrize("mode, option", [("full", "op"), ("selective", "op")])
def test_activation_checkpointing_keeps_gradients(mode, option):
    """Recomputation in backward runs routing and the aux-loss attachment again: same gradients."""
    model = build("deepseek_v3")
    wrapped = copy.deepcopy(model)
    apply_activation_checkpointing(wrapped, mode, option)
    tokens = torch.randint(0, 64, (2, 12))
    for m in (model, wrapped):
        F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for (name, p), q in zip(model.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
