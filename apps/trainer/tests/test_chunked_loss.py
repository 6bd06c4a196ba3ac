"""training.loss_chunk_size: the loss that projects the final hidden states chunk by chunk.

Against today's loss of the whole logits (same seed, same batch): fp32 loss within 1e-6 relative
and every gradient within 1e-6 of its largest entry on one process (untied and tied
embeddings, compiled), bf16 compute within 1e-2; no tensor ever holds more than a chunk's rows of logits, forward or backward; and
trained under FSDP (every group resharded after forward), TP (loss parallel, and gathered
logits), PP and CP, losses, grad norms and the validation loss within 1e-5 relative of the
single-process run of the whole logits (the sharded matmuls sum in another order)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.mesh.testing import run_on_ranks
from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.parallelize import build_parallel_model
from tessera.trainer.plan import make_plan
from tessera.trainer.step import build_loss, plain_forward_backward
from tessera.trainer.train import train

SEQ, ROWS, CHUNK = 32, 2, 24  # 64 tokens a micro-batch, in chunks of 24, 24 and 16
# flags, tolerance: fp32 1e-6; bf16 compute (autocast) 1e-2 of the whole logits' bf16 run (which
# is 1.1e-2 from fp32 here); the compiled chunk loss (training.loss_chunk_size with compile's "loss")
CASES = {"llama3": ([], 1e-6), "qwen3_tied": (["--model.name", "qwen3", "--model.flavor", "tiny"], 1e-6),
         "llama3_bf16": (["--training.mixed_precision_param", "bfloat16"], 1e-2),
         "llama3_compiled": (["--compile.enable", "true", "--compile.components", "loss"], 1e-6)}

def _argv(tmp_path, *extra):
    return ["--training.seq_len", str(SEQ), "--training.local_batch_size", str(ROWS), "--job.dump_folder", str(tmp_path),
            *extra]


def _one_step(argv):
    """(loss, {name: gradient}) of one forward and backward of a fixed batch on one process."""
    plan = make_plan(load_config(argv), 1, "cpu")
    torch.manual_seed(0)
    loss_fn = build_loss(plan)
    model = build_parallel_model(plan, None, loss_fn).parts[0]
    tokens = torch.randint(0, plan.model_args.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loss = plain_forward_backward(model, loss_fn, plan)(tokens[:, :-1], tokens[:, 1:])
    return loss, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_loss_equals_the_whole_logits_loss(tmp_path, case):
    flags, tolerance = CASES[case]
    compiled = "--compile.enable" in flags
    want_loss, want = _one_step(_argv(tmp_path, *([] if compiled else flags)))
    got_loss, got = _one_step(_argv(tmp_path, *flags, "--training.loss_chunk_size", str(CHUNK)))
    assert got_loss.item() == pytest.approx(want_loss.item(), rel=tolerance)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        worst, scale = (got[name] - grad).abs().max().item(), grad.abs().max().item()
        assert worst <= tolerance * scale, f"{name}: off by {worst:.3g}, largest entry {scale:.3g}"

class _LargestLogits(TorchDispatchMode):
    """The most token rows any logits-shaped tensor (last dimension `vocab`) had, among every op's
    outputs; the output weight's transpose ([dim, vocab]) is not logits."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.vocab, self.dim, self.rows = vocab, dim, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2 and t.shape[-1] == self.vocab
                    and tuple(t.shape) != (self.dim, self.vocab)):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("chunk, rows", [(0, ROWS * SEQ), (CHUNK, CHUNK)])
def test_no_tensor_holds_more_than_a_chunk_of_logits(tmp_path, chunk, rows):
    """Forward and backward of one micro-batch: the tallest logits-shaped tensor has a chunk's
    rows; 0 (off): all the micro-batch's tokens'."""
    plan = make_plan(load_config(_argv(tmp_path, "--training.loss_chunk_size", str(chunk))), 1, "cpu")
    loss_fn = build_loss(plan)
    model = build_parallel_model(plan, None, loss_fn).parts[0]
    tokens = torch.randint(0, plan.model_args.vocab_size, (ROWS, SEQ + 1))
    with _LargestLogits(plan.model_args.vocab_size, plan.model_args.dim) as largest:
        plain_forward_backward(model, loss_fn, plan)(tokens[:, :-1], tokens[:, 1:])
    assert largest.rows == rows


def _train_rank(rank, world_size, argv):
    return train(load_config(argv))


STEPS = 3
TRAIN = ["--metrics.log_freq", "1", "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "1",
         "--validation.enable", "true", "--validation.freq", str(STEPS), "--validation.steps", "2"]
LAYOUTS = {  # 2 ranks each; data-parallel ranks
    "fsdp2_always": (["--parallelism.fsdp_reshard_after_forward", "always"], 2),
    "tp2": (["--parallelism.tensor_parallel_degree", "2"], 1),
    "tp2_gathered": (["--parallelism.tensor_parallel_degree", "2", "--parallelism.disable_loss_parallel", "true"], 1),
    "pp2": (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"], 1),
    "cp2": (["--parallelism.context_parallel_degree", "2"], 1),
}


@pytest.fixture(scope="module")
def whole_logits_run(tmp_path_factory):
    """The single-process run of the whole logits, per data-parallel degree (its global batch)."""
    runs = {}

    def run(dp):
        if dp not in runs:
            argv = _argv(tmp_path_factory.mktemp("single"), *TRAIN)
            argv[argv.index("--training.local_batch_size") + 1] = str(ROWS * dp)
            runs[dp] = run_on_ranks(_train_rank, 1, argv)[0]
        return runs[dp]

    return run


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_chunked_loss_trains_as_the_whole_logits_under_every_layout(tmp_path, whole_logits_run, layout):
    extra, dp = LAYOUTS[layout]
    reference = whole_logits_run(dp)
    per_rank = run_on_ranks(_train_rank, 2, _argv(tmp_path, *TRAIN, *extra, "--training.loss_chunk_size", str(CHUNK)))
    for history in per_rank:
        assert [entry["step"] for entry in history] == [entry["step"] for entry in reference]
        for entry, ref in zip(history, reference):
            for key in ("loss", "grad_norm", "validation_loss"):
                if key in ref:
                    assert entry[key] == pytest.approx(ref[key], rel=1e-5), f"{layout} step {ref['step']} {key}"


def test_float8_output_is_refused(tmp_path):
    argv = _argv(tmp_path, "--model.converters", "float8", "--float8.filter_fqns", "tok_embeddings",
                 "--training.loss_chunk_size", "32")
    with pytest.raises(ConfigError, match="loss_chunk_size .*would convert 'output'"):
        make_plan(load_config(argv), 1, "cpu")

