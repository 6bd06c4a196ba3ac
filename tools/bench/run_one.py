"""One rank of a side-by-side run, Tessera's or torchtitan's, started by torchrun:

  torchrun ... run_one.py tessera|torchtitan <trainer arguments>

PIN=1 pins the rank to the CPU of its local rank (2 single-thread ranks on 2 cores: neither
rank's work lands on the other's core). SPLIT_REGIONS=1 opens profiler regions around the
model's RoPE, attention, feed-forward and block functions, the loss and the clipping, so
`profile_split` can tell their element-wise ops apart. torchtitan runs through
$PEER_ROOT/cpu_launch.py (its CPU patches), in its own venv: this file needs only torch.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys

from profile_split import annotate


def _tessera_regions() -> dict:
    import tessera.fsdp as fsdp
    import tessera.models.llama.model as llama
    import tessera.models.rms_norm as rms_norm
    import tessera.trainer.step as step

    return {"norms": (rms_norm.RMSNorm, "forward"), "rope": (llama, "apply_rotary_emb"), "swiglu": (llama.FeedForward, "forward"),
            "residual": (llama.TransformerBlock, "forward"), "attention": (llama.Attention, "forward"),
            "loss": (step, "cross_entropy"), "grad clip": (fsdp, "clip_grad_norm_")}


def _torchtitan_regions() -> dict:
    import torchtitan.components.loss as loss
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.llama3.model.model as llama

    return {"rope": (llama, "apply_rotary_emb"), "swiglu": (llama.FeedForward, "forward"),
            "residual": (llama.TransformerBlock, "forward"), "attention": (llama.Attention, "forward"),
            "loss": (loss, "cross_entropy_loss"), "grad clip": (dist_utils, "clip_grad_norm_")}


def _profile_cpu_only() -> None:
    """torchtitan 0.2.2 passes [CPU, None] as the profiler's activities when there is no GPU,
    which torch.profiler rejects: drop the None (its profiling code is otherwise unchanged)."""
    import torch.profiler

    class CpuProfile(torch.profiler.profile):
        def __init__(self, *args, activities=None, **kwargs):
            super().__init__(*args, activities=[a for a in activities or () if a is not None] or None, **kwargs)

    torch.profiler.profile = CpuProfile


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
    with annotate(regions()) if os.environ.get("SPLIT_REGIONS") == "1" else contextlib.nullcontext():
        runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
