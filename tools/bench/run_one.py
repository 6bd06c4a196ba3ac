"""One rank of a side-by-side run, Tessera's or torchtitan's, started by torchrun:

  torchrun ... run_one.py tessera|torchtitan <trainer arguments>

PIN=1 pins the rank to the CPU of its local rank (2 single-thread ranks on 2 cores: neither
rank's work lands on the other's core). SPLIT_REGIONS=1 opens profiler regions around the
model's RoPE, attention, feed-forward and block functions, the MoE layer, its router and its
routed experts, the loss and the clipping, so `profile_split` can tell their element-wise ops
apart; MODEL (a registered model: llama3, qwen3, ...) says which model's functions. Every log step
also prints the process's CPU seconds so far (``cpu_s <step> <seconds>``): tokens per CPU-second
hold up better than tokens per second while other jobs share the machine. torchtitan runs through
$PEER_ROOT/cpu_launch.py (its CPU patches), in its own venv: this file needs only torch.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys

from profile_split import annotate

# what the families' attention calls its rotary embedding (Llama's own, or tessera.models.rotary's)
ROPE_FUNCTIONS = ("apply_rotary_emb", "apply_rope_interleaved", "apply_rope_half")


def _tessera_regions(model: str) -> dict:
    import importlib

    import tessera.fsdp as fsdp
    import tessera.models.decoder as decoder
    import tessera.models.feed_forward as feed_forward
    import tessera.models.moe.experts as experts
    import tessera.models.moe.layer as layer
    import tessera.models.moe.router as router
    import tessera.models.rms_norm as rms_norm
    import tessera.trainer.step as step
    from tessera.models import get_model_spec

    # the family's model module (where its Attention and the RoPE function it calls live)
    family = importlib.import_module(get_model_spec(model).build.__module__)
    rope = next(name for name in ROPE_FUNCTIONS if hasattr(family, name))
    return {"norms": (rms_norm.RMSNorm, "forward"), "rope": (family, rope), "swiglu": (feed_forward.FeedForward, "forward"),
            "residual": (decoder.TransformerBlock, "forward"), "attention": (family.Attention, "forward"),
            "routing": (router.TopKRouter, "forward"), "permutation": (layer.MoE, "forward"),
            "experts": (experts.GroupedExperts, "forward"), "loss": (step, "cross_entropy"),
            "grad clip": (fsdp, "clip_grad_norm_")}


def _torchtitan_regions(model: str) -> dict:
    import importlib

    import torchtitan.components.loss as loss
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.moe.moe as moe

    family = importlib.import_module(f"torchtitan.models.{model}.model.model")
    regions = {"rope": (family, "apply_rotary_emb"), "residual": (family.TransformerBlock, "forward"),
               "attention": (family.Attention, "forward"), "loss": (loss, "cross_entropy_loss"),
               "grad clip": (dist_utils, "clip_grad_norm_")}
    if model == "llama3":
        return {**regions, "swiglu": (family.FeedForward, "forward")}
    return {**regions, "swiglu": (moe.FeedForward, "forward"), "routing": (moe.TokenChoiceTopKRouter, "forward"),
            "permutation": (moe.MoE, "forward"), "experts": (moe.GroupedExperts, "forward")}


def _profile_cpu_only() -> None:
    """torchtitan 0.2.2 passes [CPU, None] as the profiler's activities when there is no GPU,
    which torch.profiler rejects: drop the None (its profiling code is otherwise unchanged)."""
    import torch.profiler

    class CpuProfile(torch.profiler.profile):
        def __init__(self, *args, activities=None, **kwargs):
            super().__init__(*args, activities=[a for a in activities or () if a is not None] or None, **kwargs)

    torch.profiler.profile = CpuProfile


def _print_cpu_seconds(owner: type, step_of) -> None:
    """Wrap the trainer's per-step log method: ``cpu_s <step> <process CPU seconds>`` first."""
    import functools
    import time

    original = owner.log

    @functools.wraps(original)
    def log(self, *args, **kwargs):
        print(f"cpu_s {step_of(args, kwargs)} {time.process_time():.4f}", flush=True)
        return original(self, *args, **kwargs)

    owner.log = log


def _permute_indices_on_cpu() -> None:
    """torchtitan 0.2.2's expert-parallel dispatch builds its permutation with a Triton kernel
    (``generate_permute_indices``), which needs a GPU; its own CPU implementation is the same
    function with ``use_cpu=True``: call that (its expert parallelism is otherwise unchanged)."""
    import functools

    import torchtitan.models.moe.kernels as kernels
    import torchtitan.models.moe.utils as utils

    utils.generate_permute_indices = functools.partial(kernels.generate_permute_indices, use_cpu=True)


def main() -> None:
    which, args = sys.argv[1], sys.argv[2:]
    if os.environ.get("PIN") == "1":
        os.sched_setaffinity(0, {int(os.environ.get("LOCAL_RANK", "0")) % os.cpu_count()})
    module = "tessera.trainer.main" if which == "tessera" else "torchtitan.train"
    sys.argv = [module, *args]
    regions = _tessera_regions
    if which != "tessera":  # cpu_launch's patches (device, FSDP over gloo) first, as its own __main__ does
        runpy.run_path(os.path.join(os.environ["PEER_ROOT"], "cpu_launch.py"), run_name="cpu_launch")
        regions = _torchtitan_regions
        _profile_cpu_only()
        _permute_indices_on_cpu()
        import torchtitan.components.metrics as titan_metrics

        _print_cpu_seconds(titan_metrics.MetricsProcessor, lambda args, kwargs: kwargs.get("step", args[0] if args else 0))
    else:
        import tessera.trainer.metrics as tessera_metrics

        _print_cpu_seconds(tessera_metrics.MetricLogger, lambda args, kwargs: kwargs.get("step", args[0] if args else 0))
    model = os.environ.get("MODEL", "llama3")
    with annotate(regions(model)) if os.environ.get("SPLIT_REGIONS") == "1" else contextlib.nullcontext():
        runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
