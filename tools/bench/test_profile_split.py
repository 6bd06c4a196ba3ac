"""profile_split on a real trace of a tiny training step: the categories add up to the step,
backward time follows its forward op, and a region names what no op name can."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import profile_split
from profile_split import CATEGORIES, annotate, split

torch.set_num_threads(1)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.proj = nn.Embedding(64, 32), nn.RMSNorm(32), nn.Linear(32, 64)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.proj(rotate(self.norm(h)))


def rotate(h):  # element-wise ops only: no op name says what they are
    return h * 0.5 + h.flip(-1) * 0.25


def _trace(tmp_path, regions: bool):
    torch.manual_seed(0)
    model, tokens = Tiny(), torch.randint(0, 64, (4, 16))
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    path = tmp_path / f"trace_{regions}.json"
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1)
    targets = {"rope": (sys.modules[__name__], "rotate")} if regions else {}
    with annotate(targets), torch.profiler.profile(schedule=schedule, on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(2):
            loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    return path


def test_categories_add_up_and_follow_forward_ops(tmp_path):
    path = _trace(tmp_path, regions=True)
    parts = split(path)
    assert list(parts) == list(CATEGORIES)
    events, step = profile_split._step_events(__import__("json").loads(path.read_text()))
    assert abs(sum(parts.values()) - step["dur"] / 1e3) < 1e-6
    for kind in ("matmul", "norms", "loss", "embedding", "optimizer", "rope"):
        assert parts[kind] > 0, (kind, parts)
    assert parts["other ops"] < 0.05 * sum(parts.values()), parts  # backward nodes found their forward op


def test_without_a_region_elementwise_ops_are_other(tmp_path):
    parts = split(_trace(tmp_path, regions=False))
    assert parts["rope"] == 0 and parts["other ops"] > 0, parts


def test_annotate_restores_what_it_wrapped():
    before = rotate
    with annotate({"rope": (sys.modules[__name__], "rotate")}):
        assert rotate is not before
    assert rotate is before


def experts(h, weight):  # a whole MoE part: its matmul counts as the part's, not as matmul
    return h @ weight


def test_an_inclusive_region_takes_its_matmuls(tmp_path):
    torch.manual_seed(0)
    weight = torch.randn(32, 32, requires_grad=True)
    h = torch.randn(64, 32, requires_grad=True)
    path = tmp_path / "trace.json"
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1)
    targets = {"experts": (sys.modules[__name__], "experts")}
    with annotate(targets), torch.profiler.profile(schedule=schedule, on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(2):
            (experts(h, weight) @ weight).sum().backward()  # the second matmul is outside the region
            prof.step()
    parts = split(path)
    assert parts["experts"] > 0 and parts["matmul"] > 0, parts  # a named op, only a region can claim it
    assert parts["routing"] == parts["permutation"] == 0, parts


def test_every_registered_model_has_its_regions():
    """SPLIT_REGIONS' targets are found for every family from its spec, none named in run_one."""
    import run_one
    from tessera.models import list_model_specs

    for model in list_model_specs():
        regions = run_one._tessera_regions(model)
        for owner, attribute in regions.values():
            assert callable(getattr(owner, attribute)), (model, owner, attribute)
        assert regions["attention"][0].__module__.startswith("tessera.models."), model
