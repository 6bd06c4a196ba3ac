"""The start-up banner: what the run is, in a few lines, enough to tell two runs' logs apart."""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from tessera.trainer.parallelize import ParallelModel
from tessera.trainer.plan import JobPlan


def banner(plan: JobPlan, model: ParallelModel, peak: float, tokenizer, data_source: str) -> str:
    """What the run is, in a few lines: enough to tell two runs' logs apart."""
    from tessera.trainer.cli_info import version_text

    config, batch, opt = plan.config, plan.batch, plan.optimizer
    layout = {k: v for k, v in plan.dims.degrees().items() if v > 1} or "single"
    # this rank's share: a sharded parameter (DTensor) counts its local shard
    local_params = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for part in model.parts for p in part.parameters())
    ac = plan.checkpointing
    decay = "every step after warm-up" if opt.decay_ratio is None else f"the last {opt.decay_ratio:.0%} of the steps"
    return "\n".join([
        f"tessera: {config.job.description} | {plan.spec.name}/{config.model.flavor} | {local_params:,} parameters on this rank | "
        f"{plan.device} x{plan.world_size} {layout} | {config.training.steps} steps",
        f"  data: {data_source} | tokenizer {tokenizer.name} ({tokenizer.vocab_size:,} ids) | global batch "
        f"{batch.global_size} x {batch.seq_len} tokens ({batch.accumulation} micro-batches)",
        f"  dtype: {plan.precision.describe()} | AC {ac.mode}{f' ({ac.selective_option})' if ac.mode == 'selective' else ''} | "
        f"compile {'on' if plan.compile.blocks or plan.loss.compiled else 'off'}",
        f"  attention: {plan.attention.describe()}",
        *([f"  fault tolerance: {plan.fault_tolerance.describe()}"] if plan.fault_tolerance.enabled else []),
        f"  lr: {opt.name} {opt.lr:g}, {opt.warmup_steps} warm-up steps, {opt.decay_type} decay "
        f"over {decay} to {opt.min_lr_factor:g}x | groups {opt.describe_groups()}",
        f"  MFU against {peak:,.1f} TFLOP/s, attention FLOPs "
        f"{'halved (causal)' if config.metrics.causal_attention_flops else 'full (mask ignored)'} | output {config.job.dump_folder}",
        f"  {version_text()}",
        *(f"  warning: {what}" for what in plan.warnings),
    ])
