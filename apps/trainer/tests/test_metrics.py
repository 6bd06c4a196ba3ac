"""MFU's denominator and numerator: GPU names matched most-specific first, fp16 at the bf16
peak, a measured peak (with a warning) for an unknown GPU and its bounded cost, and the
causal-attention switch."""

import pytest
import torch

from tessera.trainer import metrics
from tessera.trainer.config import load_config
from tessera.trainer.plan import make_plan


@pytest.fixture
def gpu(monkeypatch):
    """Pretends to be on a GPU named as set through the returned dict, measuring 123 TFLOP/s."""
    state = {"name": ""}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: state["name"])
    monkeypatch.setattr(metrics, "measured_peak_tflops", lambda device, dtype: 123.0)
    return state


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200 NVL", 835.0),
    ("NVIDIA H200", 989.4),
    ("NVIDIA GH200 480GB", 989.4),
    ("NVIDIA GB200", 2500.0),
    ("NVIDIA B200", 2250.0),
    ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 80GB HBM3", 989.4),
    ("NVIDIA A100-SXM4-80GB", 312.0),
])
def test_gpu_names_match_most_specific_entry(gpu, name, peak):
    gpu["name"] = name
    assert metrics.peak_tflops("cuda", torch.bfloat16) == peak
    assert metrics.peak_tflops("cuda", torch.float16) == peak


def test_fp32_uses_the_tf32_rate_only_while_tf32_is_on(gpu):
    gpu["name"] = "NVIDIA H100 80GB HBM3"
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert metrics.peak_tflops("cuda", torch.float32) == 989.4 / 2
        torch.backends.cuda.matmul.allow_tf32 = False
        assert metrics.peak_tflops("cuda", torch.float32) == 123.0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_unknown_gpu_warns_once_and_uses_the_measured_peak(gpu, capsys):
    gpu["name"] = "NVIDIA RTX 9090"
    assert metrics.peak_tflops("cuda", torch.bfloat16) == 123.0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no data-sheet peak for GPU 'NVIDIA RTX 9090'" in err


@pytest.mark.parametrize("flops_per_s, largest", [(1e9, 256), (1e12, 2048)])
def test_measured_peak_stops_growing_once_a_product_takes_long(monkeypatch, flops_per_s, largest):
    """A slow rate (bf16 without native support: ~1 GFLOP/s) is measured on small matrices, in
    well under a second of (simulated) time; a fast one on the largest CPU size."""
    clock, sizes = [0.0], []

    def mm(a, b):
        sizes.append(a.shape[0])
        clock[0] += 2 * a.shape[0] ** 3 / flops_per_s

    monkeypatch.setattr(metrics.torch, "mm", mm)
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    metrics.measured_peak_tflops.cache_clear()
    assert metrics.measured_peak_tflops.__wrapped__("cpu", torch.float32) == pytest.approx(flops_per_s / 1e12)
    assert max(sizes) == largest and clock[0] < 2.0
    metrics.measured_peak_tflops.cache_clear()


def test_causal_attention_flops_halve_only_the_attention_term(tmp_path):
    argv = ["--training.seq_len", "64", "--job.dump_folder", str(tmp_path)]
    full = make_plan(load_config(argv), 1, "cpu")
    causal = make_plan(load_config([*argv, "--metrics.causal_attention_flops", "true"]), 1, "cpu")
    args = full.model_args
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 64  # the spec's seq_len term
    assert full.flops_per_token - causal.flops_per_token == pytest.approx(attention / 2)
