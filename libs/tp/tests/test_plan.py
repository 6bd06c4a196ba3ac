"""Plan resolution and argument checks: everything that fails before any collective runs."""

import re

import pytest
import torch
from torch import nn

from tessera.tp import ROLES, apply_tp, check_tp_degree, enable_async_tp, loss_parallel_context, resolve_plan


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wo = nn.Linear(8, 8), nn.Linear(8, 8)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(8), Attention()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(3)})
        self.output = nn.Linear(8, 16)


PLAN = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "norm",
    "layers.*.attention": "block_input",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wo": "rowwise",
    "output": "vocab_output",
}


def test_star_matches_exactly_one_path_component():
    resolved = resolve_plan(Model(), PLAN)
    assert resolved["layers.2.attention.wq"] == "colwise"
    assert resolved["layers.0.attention"] == "block_input"
    assert len(resolved) == 2 + 4 * 3
    assert set(resolved.values()) <= ROLES
    # "layers.*" alone names the blocks, not their children
    assert sorted(resolve_plan(Model(), {"layers.*": "block_input"})) == ["layers.0", "layers.1", "layers.2"]


def test_unmatched_pattern_is_named():
    with pytest.raises(ValueError, match=r"pattern 'layers\.\*\.feed_forward\.w1' matches no module of Model"):
        resolve_plan(Model(), {**PLAN, "layers.*.feed_forward.w1": "colwise"})


def test_a_pipeline_stage_skips_patterns_it_has_no_modules_for():
    stage = Model()
    stage.tok_embeddings = None
    del stage.layers["0"]
    resolved = resolve_plan(stage, PLAN, missing_ok=True)
    assert "tok_embeddings" not in resolved and resolved["output"] == "vocab_output"
    assert sorted(p for p in resolved if p.endswith("wq")) == ["layers.1.attention.wq", "layers.2.attention.wq"]


def test_unknown_role_is_named():
    with pytest.raises(ValueError, match=r"entry 'output': unknown role 'vocab_head'"):
        resolve_plan(Model(), {**PLAN, "output": "vocab_head"})


def test_module_claimed_twice_is_named():
    expected = "'layers.1.attention.wq' is matched by plan patterns 'layers.*.attention.wq' and 'layers.1.attention.wq'"
    with pytest.raises(ValueError, match=re.escape(expected)):
        resolve_plan(Model(), {**PLAN, "layers.1.attention.wq": "rowwise"})


def test_apply_tp_checks_the_plan_before_changing_the_model():
    model = Model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    # The plan is checked before the mesh is first used, so no process group is needed here.
    with pytest.raises(ValueError, match="unknown role 'diagonal'"):
        apply_tp(model, None, {"layers.*.attention.wq": "colwise", "output": "diagonal"})
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and torch.equal(p, before[name]), name


def test_check_tp_degree_names_first_failing_quantity():
    check_tp_degree(4, {"n_heads": 16, "n_kv_heads": 8, "vocab_size": 2048, "ffn_hidden": 768})
    with pytest.raises(ValueError, match=r"^tensor_parallel_degree 3 does not divide n_kv_heads=8$"):
        check_tp_degree(3, {"n_heads": 6, "n_kv_heads": 8, "vocab_size": 7})
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        check_tp_degree(0, {"n_heads": 16})


def test_async_tp_refuses_cpu_and_eager():
    with pytest.raises(ValueError, match=r"^enable_async_tensor_parallel needs CUDA: device is 'cpu'"):
        enable_async_tp(None, "cpu", compile_enabled=True)
    with pytest.raises(ValueError, match=r"^enable_async_tensor_parallel needs torch.compile"):
        enable_async_tp(None, "cuda", compile_enabled=False)


def test_loss_parallel_context_off_is_a_null_context():
    with loss_parallel_context(False):
        loss = nn.functional.cross_entropy(torch.zeros(2, 4), torch.tensor([0, 1]))
    assert torch.isclose(loss, torch.log(torch.tensor(4.0)))
