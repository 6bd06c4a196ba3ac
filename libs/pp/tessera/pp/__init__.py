"""tessera.pp: pipeline parallelism — cut a model into stages by module names, place them on
the pp ranks (looped or V-shaped), and run torch.distributed.pipelining's schedules."""

from tessera.pp.split import keep_only, model_parts_names
from tessera.pp.stages import (
    SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    canonical_schedule,
    check_backend,
    check_microbatches,
    check_schedule_csv,
    check_split,
    check_stage_count,
    even_split,
    is_single_stage,
    is_v_shaped,
    schedule_class,
    splits_backward,
    stage_count,
    stage_ids,
)


def __getattr__(name: str):
    """Pipeline and build_pipeline come from their module at first use: it loads torch's
    pipelining, and dynamo with it, which the planning helpers above and a job without pipeline
    parallelism do without."""
    if name in ("Pipeline", "build_pipeline"):
        from tessera.pp import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'tessera.pp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "Pipeline", "build_pipeline"})


__all__ = [
    "SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES",
    "Pipeline",
    "build_pipeline",
    "canonical_schedule",
    "check_backend",
    "check_microbatches",
    "check_schedule_csv",
    "check_split",
    "check_stage_count",
    "even_split",
    "is_single_stage",
    "is_v_shaped",
    "keep_only",
    "model_parts_names",
    "schedule_class",
    "splits_backward",
    "stage_count",
    "stage_ids",
]
