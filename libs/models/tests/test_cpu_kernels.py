"""The CPU fast paths (issue 15) compute what torch's own ops compute: RMSNorm's hand-written
backward against nn.RMSNorm's autograd, and attention of short low-precision sequences run in
fp32 against the kernel called directly."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.attention import CPU_FP32_MAX_SEQ_TIMES_HEAD_DIM, InnerAttention
from tessera.models.rms_norm import RMSNorm


def _norm_pair(dim: int, eps: float | None):
    torch.manual_seed(0)
    fast = RMSNorm(dim, eps=eps)
    with torch.no_grad():
        fast.weight.uniform_(0.5, 1.5)
    reference = nn.RMSNorm(dim, eps=eps)
    reference.load_state_dict(fast.state_dict())
    return fast, reference


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False), (torch.float64, False)])
@pytest.mark.parametrize("eps", [1e-5, None])
def test_rms_norm_matches_torch_forward_and_backward(dtype, autocast, eps):
    fast, reference = _norm_pair(64, eps)
    x = torch.randn(3, 16, 64, dtype=dtype) * 3
    grad = torch.randn(3, 16, 64, dtype=dtype)
    outputs, grads = [], []
    for module in (fast, reference):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = module(xi)
        y.backward(grad)
        outputs.append(y)
        grads.append((xi.grad, module.weight.grad))
    assert outputs[0].dtype == outputs[1].dtype == dtype
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)  # the same ops in the same order
    # the closed-form backward rounds differently from autograd's node-by-node one: within an ulp or two
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-6, atol=1e-5)


def test_rms_norm_is_nn_rms_norm_for_state_dicts_and_checks():
    fast, reference = _norm_pair(8, 1e-6)
    assert isinstance(fast, nn.RMSNorm) and fast.state_dict().keys() == reference.state_dict().keys()


def _qkv(batch, heads, seq, head_dim, dtype):
    torch.manual_seed(0)
    return [torch.randn(batch, heads, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("autocast", [False, True])
def test_short_low_precision_attention_runs_in_fp32(autocast):
    q, k, v = _qkv(2, 4, 64, 16, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = InnerAttention()(q, k, v)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    direct = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.equal(out, direct)  # so the check above tells the two paths apart
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16


def test_long_low_precision_attention_keeps_its_dtype():
    seq = 2 * CPU_FP32_MAX_SEQ_TIMES_HEAD_DIM // 16
    q, k, v = _qkv(1, 1, seq, 16, torch.bfloat16)
    out = InnerAttention()(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=0, atol=0)
