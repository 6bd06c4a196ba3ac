"""The trainer trains Llama 4's debug flavor in one process: its chunked RoPE layers and its
global NoPE layer get the blocked and SDPA kernels on CPU, its sequences are long enough for
both the chunks and the attention temperature to act, and the loss is finite and falls."""

import math

from tessera.trainer.config import load_config
from tessera.trainer.plan import make_plan
from tessera.trainer.train import train

ARGV = ["--model.name", "llama4", "--model.flavor", "tiny", "--training.seq_len", "64", "--training.steps", "6",
        "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "3e-3"]


def test_debug_flavor_learns_in_one_process(tmp_path):
    argv = [*ARGV, "--job.dump_folder", str(tmp_path)]
    assert make_plan(load_config(argv), 1, "cpu").attention.describe() == "causal + chunk 32 -> blocked; causal -> sdpa"
    losses = [step["loss"] for step in train(load_config(argv))]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] - 0.5, losses
