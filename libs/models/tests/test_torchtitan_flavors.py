"""A flavor name Tessera shares with torchtitan builds torchtitan's model: for every flavor of
torchtitan 0.2.2 (data/torchtitan_flavor_shapes.json, written from torchtitan's own source by the
script beside it) Tessera's flavor of that name has the same parameter count and as many
parameters of each shape (sizes sorted: a family may store a weight transposed). Tessera's test
sizes have names torchtitan does not use."""

import collections
import json
from pathlib import Path

import pytest
import torch

from tessera.models import get_model_spec

TORCHTITAN = json.loads((Path(__file__).parent / "data" / "torchtitan_flavor_shapes.json").read_text())
FAMILIES = ("llama3", "deepseek_v3", "qwen3", "gpt_oss", "llama4")
# torchtitan's names for its attention kernels (FlexAttention, varlen) over the same weights: in
# Tessera the job plan picks the kernel and model.attn_mask_type the mask, so they are not flavors.
KERNEL_VARIANTS = ("_flex_attn", "_flex", "_varlen_attn", "_varlen")
TESSERA_ONLY = {"llama3": {"1B", "3B"}, "deepseek_v3": {"tiny", "tiny_mtp", "debugmodel_mtp"}, "qwen3": {"tiny", "tiny_moe"},
                "gpt_oss": {"tiny"}, "llama4": {"tiny"}}
CASES = [(family, flavor) for family in FAMILIES for flavor in TORCHTITAN[family]
         if not flavor.endswith(KERNEL_VARIANTS)]


def _shapes(model: torch.nn.Module) -> dict:
    return dict(collections.Counter("x".join(map(str, sorted(p.shape))) for p in model.parameters()))


@pytest.mark.parametrize("family, flavor", CASES, ids=[f"{family}-{flavor}" for family, flavor in CASES])
def test_shared_flavor_builds_torchtitans_model(family, flavor):
    spec = get_model_spec(family)
    assert flavor in spec.flavors, f"torchtitan's {family}/{flavor} has no Tessera flavor"
    with torch.device("meta"):
        model = spec.build(spec.flavors[flavor])
    want = TORCHTITAN[family][flavor]
    assert sum(p.numel() for p in model.parameters()) == want["parameters"]
    assert _shapes(model) == want["shapes"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tessera_flavors_are_torchtitans_or_its_own(family):
    """Every Tessera flavor is one of torchtitan's names or one torchtitan does not use at all."""
    assert TORCHTITAN["torchtitan"] == "0.2.2"
    ours = set(get_model_spec(family).flavors)
    assert ours - set(TORCHTITAN[family]) == TESSERA_ONLY[family]
