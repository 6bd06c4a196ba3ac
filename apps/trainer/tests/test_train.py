import os
import subprocess
import sys

import pytest
import torch

import tessera.trainer.main as main_module
import tessera.trainer.train as train_module
from tessera.trainer.config import load_config
from tessera.trainer.errors import ERRORS_ENV
from tessera.trainer.lr_schedule import lr_factor
from tessera.trainer.main import main
from tessera.trainer.step import document_masking
from tessera.trainer.train import train

# A few-second CPU run of the debug model: short windows, small batches, fp32 for exactness.
SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.mixed_precision_param",
         "float32", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1"]


def run(tmp_path, *extra):
    return train(load_config([*SMALL, "--job.dump_folder", str(tmp_path), *extra]))


def losses(history):
    return [h["loss"] for h in history if "loss" in h]


def test_loss_falls_over_30_steps(tmp_path):
    history = losses(run(tmp_path, "--training.steps", "30", "--optimizer.lr", "3e-3"))
    assert len(history) == 30
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    assert last < first - 1.0, (first, last)


def test_same_seed_same_losses_other_seed_differs(tmp_path):
    a = run(tmp_path / "a", "--training.steps", "4")
    b = run(tmp_path / "b", "--training.steps", "4")
    c = run(tmp_path / "c", "--training.steps", "4", "--debug.seed", "1")
    assert [h["loss"] for h in a] == [h["loss"] for h in b]
    assert [h["grad_norm"] for h in a] == [h["grad_norm"] for h in b]
    assert losses(a) != losses(c)


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    big = run(tmp_path / "big", "--training.steps", "3", "--training.local_batch_size", "4")
    accumulated = run(tmp_path / "acc", "--training.steps", "3", "--training.global_batch_size", "4")
    for x, y in zip(big, accumulated):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("mode, option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_activation_checkpointing_keeps_the_numbers(tmp_path, mode, option):
    plain = run(tmp_path / "plain", "--training.steps", "2")
    ac = run(tmp_path / mode, "--training.steps", "2", "--activation_checkpoint.mode", mode,
             "--activation_checkpoint.selective_ac_option", option)
    for x, y in zip(plain, ac):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)


def test_validation_tensorboard_and_profiler_outputs(tmp_path, capsys):
    history = run(
        tmp_path, "--training.steps", "4",
        "--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "2",
        "--metrics.enable_tensorboard", "true", "--profiling.enable_profiling", "true", "--profiling.profile_freq", "2",
        "--profiling.profiler_warmup", "1", "--job.description", "ablation 7",
    )
    assert [h["step"] for h in history if "validation_loss" in h] == [1, 2, 4]  # step 1 too, as torchtitan
    assert list((tmp_path / "tb").glob("*/events.out.tfevents.*"))  # one folder per run
    assert list((tmp_path / "profile_traces").glob("iteration_*/rank0_trace.json"))
    out = capsys.readouterr().out
    assert "step 4/4" in out and "mfu" in out and "validate step 2" in out
    assert "tessera: ablation 7 | llama3/debugmodel |" in out  # the banner names the job


def test_the_logged_lr_and_grad_norm_are_those_of_the_step(tmp_path):
    """Each step logs the lr its update applied (not the next step's) and the gradient norm
    before clipping (a max_norm far below it clips every step)."""
    args = ["--training.steps", "4", "--training.max_norm", "1e-3", "--optimizer.lr", "3e-3"]
    history = run(tmp_path, *args)
    config = load_config([*SMALL, *args])
    schedule = config.lr_scheduler
    want = [3e-3 * lr_factor(step, warmup_steps=schedule.warmup_steps, total_steps=4, decay_ratio=schedule.decay_ratio,
                             decay_type=schedule.decay_type, min_lr_factor=schedule.min_lr_factor) for step in range(1, 5)]
    assert [h["lr"] for h in history] == pytest.approx(want, rel=1e-6)
    assert want[0] < want[1]  # warm-up: an lr read a step late would differ
    assert all(h["grad_norm"] > 100 * 1e-3 for h in history), [h["grad_norm"] for h in history]


def test_validation_loss_is_the_mean_of_its_batches_in_eval_mode(tmp_path, monkeypatch):
    seen = []
    real = train_module.validation_runner

    def recording(model, loss, *args, **kwargs):
        def recorded(inputs, labels):
            value = loss(inputs, labels)
            seen.append((value.item(), {part.training for part in model.parts}))
            return value
        return real(model, recorded, *args, **kwargs)

    monkeypatch.setattr(train_module, "validation_runner", recording)
    history = run(tmp_path, "--training.steps", "2", "--validation.enable", "true", "--validation.freq", "2",
                  "--validation.steps", "3")
    assert [modes for _, modes in seen] == [{False}] * 6  # steps 1 and 2, three batches each
    got = [h["validation_loss"] for h in history if "validation_loss" in h]
    want = [sum(value for value, _ in seen[i:i + 3]) / 3 for i in (0, 3)]
    assert got == pytest.approx(want, rel=1e-6) and want[0] != want[1]


def test_document_ids_count_the_bos_tokens_of_the_inputs():
    """Block-causal masking: a token's document is the number of BOS tokens up to it in the
    inputs (the labels, shifted by one, would open each document a token early)."""
    seen = {}

    def run_step(inputs, labels, **model_kwargs):
        seen.update(model_kwargs)

    inputs = torch.tensor([[1, 5, 6, 1, 7], [9, 1, 2, 3, 1]])
    document_masking(run_step, bos_id=1)(inputs, torch.roll(inputs, -1, dims=1))
    assert seen["document_ids"].tolist() == [[1, 1, 1, 2, 2], [0, 1, 1, 1, 2]]


def test_own_text_dataset_and_tokenizer_errors(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {i}: " + "the quick brown fox " * 20 for i in range(20)))
    history = run(tmp_path, "--training.steps", "2", "--training.dataset_path", str(corpus))
    assert len(history) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model.flavor", "huge"], "model.flavor 'huge' is not a flavor of llama3"),
        (["--model.name", "gpt9"], "unknown model 'gpt9'"),
        (["--training.dataset_path", "/no/such/data.txt"], "/no/such/data.txt"),
        (["--training.dataset", "c4"], "dataset 'c4' is allenai/c4 on the Hugging Face hub"),
        (["--model.tokenizer_path", "/no/such/tokenizer.model"], "/no/such/tokenizer.model"),
        (["--training.global_batch_size", "3"], "global_batch_size 3 is not a multiple"),
        (["--training.enable_cpu_offload", "true"], "enable_cpu_offload needs FSDP"),
        (["--nproc", "0"], "--nproc '0' must be a positive integer"),
        (["--parallelism.enable_async_tensor_parallel", "true"], "enable_async_tensor_parallel needs CUDA and compile"),
        (["--job.dump_folder", "/etc/hostname"], "/etc/hostname"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert main([*SMALL, "--training.steps", "1", "--job.dump_folder", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err


def test_command_line_error_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "tessera.trainer.main", "--training.stepz", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: unknown config key training.stepz; did you mean 'steps'?"


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C is the user's stop, not a bug: no traceback; it says that nothing was saved and which
    signals save first."""
    import signal
    import time

    out = tmp_path / "out"
    with open(out, "w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "tessera.trainer.main", *SMALL, "--training.steps", "10000",
                                 "--job.dump_folder", str(tmp_path)], stdout=stdout, stderr=subprocess.PIPE, text=True,
                                # a runner that ignores SIGINT would pass that on: Python then never raises KeyboardInterrupt
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while "\nstep " not in out.read_text() and proc.poll() is None and time.monotonic() < deadline:  # training
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == main_module.INTERRUPTED and "Traceback" not in err


@pytest.mark.parametrize("rank_of_nproc", [False, True])
def test_ctrl_c_while_torch_loads_exits_130_said_once(tmp_path, rank_of_nproc):
    """Before the imports end, Ctrl-C exits at once: said by a lone run, left to the launcher by
    a rank of --nproc."""
    env = {**os.environ, ERRORS_ENV: str(tmp_path)} if rank_of_nproc else \
        {k: v for k, v in os.environ.items() if k != ERRORS_ENV}
    proc = subprocess.run([sys.executable, "-c", "from tessera.trainer import main; main._interrupted_while_loading(2, None)"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130
    assert proc.stderr == ("" if rank_of_nproc else main_module.INTERRUPTED + "\n")


def test_deterministic_turns_tf32_off():
    """debug.deterministic: fp32 matmuls stay fp32 (TF32 off); otherwise TF32 is on."""
    import torch

    from tessera.trainer.train import _seed_everything

    backends = (torch.backends.cuda.matmul, torch.backends.cudnn)
    before = [b.allow_tf32 for b in backends], torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    try:
        _seed_everything(0, deterministic=True)
        assert [b.allow_tf32 for b in backends] == [False, False] and torch.are_deterministic_algorithms_enabled()
        _seed_everything(0, deterministic=False)  # a later run in the same process
        assert [b.allow_tf32 for b in backends] == [True, True] and not torch.are_deterministic_algorithms_enabled()
    finally:
        for backend, allowed in zip(backends, before[0]):
            backend.allow_tf32 = allowed
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]
        torch.use_deterministic_algorithms(False)
