"""Async tensor parallelism: torch.compile splits each TP all-gather/reduce-scatter and its
matmul into chunks that overlap, moving data through symmetric (peer-mapped) CUDA memory."""

from __future__ import annotations

import warnings

from torch.distributed.device_mesh import DeviceMesh


def enable_async_tp(tp_mesh: DeviceMesh, device_type: str, *, compile_enabled: bool) -> None:
    """Turns on inductor's micro-pipeline TP pass and symmetric memory on the TP group.

    Needs CUDA (symmetric memory has no CPU implementation) and torch.compile (the overlap is a
    compiler pass): either missing is a ValueError rather than a silent no-op. Call before the
    model is first compiled.
    """
    if device_type != "cuda":
        raise ValueError(
            f"enable_async_tensor_parallel needs CUDA: device is {device_type!r} and symmetric memory is CUDA-only"
        )
    if not compile_enabled:
        raise ValueError("enable_async_tensor_parallel needs torch.compile: it is an inductor pass; turn compile on")
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    # Read by the post-grad passes of every graph compiled from now on.
    inductor_config._micro_pipeline_tp = True

    # Deprecated in torch 2.13 ("no need to call"), yet the micro-pipeline pass still skips
    # groups it has not registered (is_symm_mem_enabled_for_group), as torch's own passes know.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
