"""GPT-OSS's released experts are MXFP4 (`*_blocks` + `*_scales`): they import as transformers'
own dequantisation gives them, bit for bit (logits against transformers: test_transformers_logits)."""

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tessera.models import get_model_spec

SPEC = get_model_spec("gpt_oss")


def test_mxfp4_experts_are_dequantised_on_import():
    """A layer's experts given as MXFP4 blocks + scales import as transformers dequantises them."""
    args = SPEC.flavors["tiny"]  # dequantisation reads the shapes from the tensors
    generator = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (4, 48, 1, 16), dtype=torch.uint8, generator=generator)  # [E, 2 hidden, dim / 32, 16]
    scales = torch.randint(120, 130, (4, 48, 1), dtype=torch.uint8, generator=generator)
    out = SPEC.hf_adapter.from_hf({"model.layers.0.mlp.experts.gate_up_proj_blocks": blocks,
                                   "model.layers.0.mlp.experts.gate_up_proj_scales": scales}, args)
    assert list(out) == ["layers.0.moe.experts.gate_up_proj"]
    assert torch.equal(out["layers.0.moe.experts.gate_up_proj"], convert_moe_packed_tensors(blocks, scales))
    with pytest.raises(ValueError, match="needs .*_blocks.* and .*_scales.* in one call"):
        SPEC.hf_adapter.from_hf({"model.layers.0.mlp.experts.gate_up_proj_blocks": blocks}, args)
