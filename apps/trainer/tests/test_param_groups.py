"""The job plan's parameter groups (tessera.trainer.param_groups): what each role and pattern
selects on real families, first match wins, Muon's split, and every refusal in one line."""

import pytest
import torch

from tessera.models import get_model_spec
from tessera.trainer.config import load_config
from tessera.trainer.errors import ConfigError
from tessera.trainer.optimizer import part_optimizers
from tessera.trainer.plan import make_plan

MOE = ["--model.name", "qwen3", "--model.flavor", "tiny_moe"]


def _groups(*argv):
    plan = make_plan(load_config(list(argv)), 1, "cpu")
    return {(g.label, g.algorithm): g for g in plan.optimizer.groups}, plan


def _names(*argv):
    plan = make_plan(load_config(list(argv)), 1, "cpu")
    with torch.device("meta"):
        model = get_model_spec(plan.spec.name).build(plan.model_args)
    return {name: p for name, p in model.named_parameters()}


def test_without_groups_one_adamw_group_takes_everything():
    groups, plan = _groups()
    assert list(groups) == [("default", "adamw")] and groups["default", "adamw"].names is None
    assert plan.optimizer.muon is None


def test_roles_select_by_module_type_and_family_names():
    names = _names(*MOE)
    groups, _ = _groups(*MOE, "--optimizer.param_groups",
                        "norms,weight_decay=0;embeddings,lr_scale=0.1;output,lr_scale=0.5;experts,lr_scale=2;router,lr_scale=3")
    by_label = {label: set(g.names) for (label, _), g in groups.items()}
    assert by_label["norms,weight_decay=0"] == {n for n in names if n.endswith("norm.weight")}  # incl. q_norm, k_norm
    assert by_label["embeddings,lr_scale=0.1"] == {"tok_embeddings.weight"}
    assert by_label["output,lr_scale=0.5"] == {"output.weight"}
    assert by_label["experts,lr_scale=2"] == {n for n in names if ".experts." in n} and by_label["experts,lr_scale=2"]
    assert by_label["router,lr_scale=3"] == {n for n in names if ".router." in n} and by_label["router,lr_scale=3"]
    assert set().union(*by_label.values()) == set(names)  # every parameter in one group
    assert sum(len(v) for v in by_label.values()) == len(names)
    assert groups["norms,weight_decay=0", "adamw"].weight_decay == 0.0
    assert groups["default", "adamw"].weight_decay == 0.1 and groups["router,lr_scale=3", "adamw"].lr_scale == 3.0


def test_first_match_wins_and_patterns_match_names():
    groups, _ = _groups("--optimizer.param_groups", "layers.0.*,lr_scale=2;norms,weight_decay=0")
    first = set(groups["layers.0.*,lr_scale=2", "adamw"].names)
    assert first and all(n.startswith("layers.0.") for n in first)
    norms = set(groups["norms,weight_decay=0", "adamw"].names)
    assert "layers.0.attention_norm.weight" in first and "layers.0.attention_norm.weight" not in norms
    assert "layers.1.attention_norm.weight" in norms and "norm.weight" in norms


def test_muon_takes_hidden_matrices_and_expert_stacks():
    names = _names(*MOE)
    groups, plan = _groups(*MOE, "--optimizer.name", "Muon")
    muon, adamw = set(groups["default", "muon"].names), set(groups["default", "adamw"].names)
    assert adamw == {n for n, p in names.items() if p.ndim < 2} | {"tok_embeddings.weight", "output.weight"}
    assert muon == set(names) - adamw
    assert any(names[n].ndim == 3 for n in muon)  # expert stacks: one update per expert
    assert plan.optimizer.muon.adjust_lr == "match_rms_adamw" and plan.optimizer.muon.ns_dtype == torch.bfloat16
    groups, _ = _groups(*MOE, "--optimizer.name", "Muon", "--optimizer.muon_exclude", "embeddings,output,router")
    assert not any(".router." in n for n in groups["default", "muon"].names)


def test_each_part_builds_adamw_then_muon_with_group_lrs():
    groups, plan = _groups("--optimizer.name", "Muon", "--optimizer.param_groups", "output,lr_scale=0.5",
                           "--optimizer.lr", "0.01")
    model = get_model_spec("llama3").build(plan.model_args)
    adamw, muon = part_optimizers(model, plan.optimizer)
    assert type(adamw).__name__ == "AdamW" and type(muon).__name__ == "Muon"
    assert [g["lr"] for g in adamw.param_groups] == [0.005, 0.01]
    assert sum(len(g["params"]) for o in (adamw, muon) for g in o.param_groups) == len(list(model.parameters()))


def test_adam_is_torchs_adam_with_weight_decay_in_the_gradient():
    """torchtitan's optimizer.name 'Adam': one step equals torch.optim.Adam's (weight decay added
    to the gradient) over the same groups."""
    groups, plan = _groups("--optimizer.name", "Adam", "--optimizer.param_groups", "norms,weight_decay=0",
                           "--optimizer.lr", "0.01", "--optimizer.weight_decay", "0.5")
    assert {algorithm for _, algorithm in groups} == {"adamw"}
    torch.manual_seed(0)
    model = get_model_spec("llama3").build(plan.model_args)
    reference = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = reference[name].grad = torch.randn_like(p)
    adam, = part_optimizers(model, plan.optimizer)
    assert type(adam) is torch.optim.Adam
    norms = {name for name in reference if "norm" in name}
    torch.optim.Adam([{"params": [reference[n] for n in norms], "weight_decay": 0.0},
                      {"params": [p for n, p in reference.items() if n not in norms]}],
                     lr=0.01, betas=plan.optimizer.betas, eps=plan.optimizer.eps, weight_decay=0.5).step()
    adam.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, reference[name], rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match="it has no Adam"):
        _groups("--optimizer.name", "Adam", *BF16)


BF16 = ["--optimizer.state_dtype", "bfloat16", "--optimizer.implementation", "for-loop"]


@pytest.mark.parametrize("argv, message", [
    (["--optimizer.param_groups", "nroms,weight_decay=0"],
     "optimizer.param_groups ['nroms', 'weight_decay=0']: 'nroms' is neither a role (norms, biases, embeddings, output, "
     "experts, router) nor a name pattern (with '*' or '.')"),
    (["--optimizer.param_groups", "experts,weight_decay=0"],
     "optimizer.param_groups ['experts', 'weight_decay=0'] selects no parameter of llama3/debugmodel that an earlier "
     "entry has not taken"),
    (["--optimizer.param_groups", "norms,weight_decay=0;*.attention_norm.*,lr_scale=2"],
     "optimizer.param_groups ['*.attention_norm.*', 'lr_scale=2'] selects no parameter of llama3/debugmodel that an "
     "earlier entry has not taken"),
    (["--optimizer.param_groups", "norms,wd=0"],
     "optimizer.param_groups ['norms', 'wd=0']: 'wd=0' is not one of weight_decay=<number>, lr_scale=<number>"),
    (["--optimizer.param_groups", "norms,lr_scale=fast"], "optimizer.param_groups ['norms', 'lr_scale=fast']: lr_scale 'fast' is not a number"),
    (["--optimizer.param_groups", "norms,lr_scale=-1"], "optimizer.param_groups ['norms', 'lr_scale=-1']: lr_scale must be >= 0"),
    (["--optimizer.param_groups", "weight_decay=0"], "optimizer.param_groups ['weight_decay=0']: names no selector"),
    (["--optimizer.state_dtype", "bfloat16"],
     "optimizer.state_dtype 'bfloat16' runs Tessera's for-loop AdamW (torch's kernels keep the moments in the parameters' "
     "dtype): set optimizer.implementation = 'for-loop', not 'fused'"),
    (["--optimizer.muon_ns_steps", "3"], "optimizer.muon_ns_steps applies only with optimizer.name = 'Muon' (this run: 'AdamW')"),
    (["--optimizer.name", "Muon", "--optimizer.muon_exclude", "outptu"], "optimizer.muon_exclude: 'outptu' is neither a role"),
])
def test_bad_groups_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError) as e:
        make_plan(load_config(argv), 1, "cpu")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_selectors_that_select_nothing_warn():
    _, plan = _groups("--optimizer.param_groups", "norms,biases,weight_decay=0")
    assert "optimizer.param_groups ['norms', 'biases', 'weight_decay=0']: 'biases' selects no parameter of llama3/debugmodel" in plan.warnings
