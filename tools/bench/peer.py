"""Tessera and torchtitan 0.2.2 on the same job, run the same way: both under torchrun (2 ranks
pinned to one core each), llama3 debugmodel (6,163,712 parameters in both: vocabulary 2048),
seq 256, local batch 8, AC and compile off, seed 42, the same JSON-lines text, a log line per
step. torchtitan runs from the peer set up by ../shared/peer-torchtitan/setup.sh under
$PEER_ROOT (its venv, debug config, test tokenizer and c4_test stand-in) through that folder's
cpu_launch.py (CPU patches, torchtitan's files untouched).

Tessera keeps its default tokenizer (2048 tokens, the size of torchtitan's debugmodel
vocabulary, whatever its tokenizer): the models match parameter for parameter, the token
streams do not, so losses are not comparable.

MoE models (``model``): deepseek_v3 runs torchtitan's own deepseek_v3 debug TOML in both stacks
(Tessera reads it as it is, from the peer's run folder: the same c4_test text; only the
tokenizer is Tessera's default, so the vocabulary is the flavor's 2048 as in torchtitan, whose
model keeps the flavor's vocabulary), its activation checkpointing (selective, per op)
included; qwen3 its debugmodel_moe flavor on torchtitan's llama3 debug TOML. Both stacks get
the same overrides: seq_len, steps, dtype, and at 2 processes FSDP 2 with EP 2.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETUP_HINT = ("torchtitan 0.2.2 peer not found: set it up with `PEER_ROOT=/some/folder "
              "../shared/peer-torchtitan/setup.sh` (from the repository root, ~2 min), then pass "
              "--peer_root /some/folder or export PEER_ROOT")
COMMON = {"seq_len": "256", "local_batch_size": "8"}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = {"tessera": re.compile(r"step\s+(\d+)/\d+\s+loss\s+([0-9.]+).*?tps\s+([0-9,]+)"),
         "torchtitan": re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+).*?tps:\s*([0-9,]+)")}
_PARAMS = {"tessera": re.compile(r"tessera: .*?([0-9,]+) (?:local params|parameters on this rank)"),
           "torchtitan": re.compile(r"size: ([0-9,]+) total parameters")}


def peer_root(path: str | None) -> Path | None:
    """The peer folder when its venv and launcher are there, else None."""
    root = Path(path or os.environ.get("PEER_ROOT", "") or "/nonexistent")
    ready = (root / "venv022" / "bin" / "torchrun").is_file() and (root / "cpu_launch.py").is_file()
    return root if ready else None


# model -> (torchtitan's TOML under run022/train_configs, flags both stacks get, whether it is MoE)
MODELS = {
    "llama3": ("debug_model.toml", ["--activation_checkpoint.mode", "none"], False),
    "deepseek_v3": ("deepseek_v3_debug_model.toml", [], True),
    "qwen3": ("debug_model.toml", ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe",
                                   "--activation_checkpoint.mode", "none"], True),
}
# models whose Tessera run reads torchtitan's TOML and data from the peer's run folder: the peer is needed for them
PEER_TOML = ("deepseek_v3",)


def _job_args(which: str, root: Path, dtype: str, nproc: int, steps: int, dump: Path, model: str = "llama3",
              seq_len: int = int(COMMON["seq_len"]), local_batch: int = int(COMMON["local_batch_size"])) -> list[str]:
    toml, flags, moe = MODELS[model]
    args = ["--job.dump_folder", str(dump), "--debug.seed", "42", "--training.seq_len", str(seq_len),
            "--training.local_batch_size", str(local_batch), "--training.steps", str(steps),
            "--training.mixed_precision_param", dtype, *flags]
    if nproc > 1:
        args += ["--parallelism.data_parallel_shard_degree", str(nproc)]
        if moe:
            args += ["--parallelism.expert_parallel_degree", str(nproc)]
    if which == "torchtitan":
        return ["--job.config_file", f"train_configs/{toml}", "--metrics.disable_color_printing", *args]
    if model in PEER_TOML:  # its TOML, from the run folder (c4_test there); Tessera's own tokenizer
        return ["--job.config_file", str(root / "run022" / "train_configs" / toml), "--model.hf_assets_path", "", *args,
                "--metrics.disable_color_printing", "true"]
    data = ["--training.dataset_path", str(_jsonl(root))] if root else []  # else Tessera's own corpus
    return [*args, "--metrics.log_freq", "1", "--metrics.disable_color_printing", "true", *data]


def _jsonl(root: Path) -> Path:
    """torchtitan's c4_test stand-in, under the name Tessera reads as JSON lines."""
    target = root / "data.jsonl"
    if not target.exists():
        shutil.copyfile(root / "run022" / "tests" / "assets" / "c4_test" / "data.json", target)
    return target


def profiling_args(which: str, step: int) -> list[str]:
    """Trace step `step` (the last) with the trainer's own profiler."""
    if which == "torchtitan":
        return ["--profiling.enable_profiling", "--profiling.profile_freq", str(step),
                "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1"]
    return ["--profiling.enable_profiling", "true", "--profiling.profile_freq", str(step)]


def launch(which: str, root: Path | None, dtype: str, nproc: int, steps: int, out: Path, extra: list[str] = (),
           regions: bool = False, model: str = "llama3", seq_len: int = int(COMMON["seq_len"]),
           local_batch: int = int(COMMON["local_batch_size"])) -> str:
    """Runs one job under torchrun (root: the peer, needed for torchtitan; Tessera reads its
    text when there is one); returns rank 0's output (raises with its tail on failure)."""
    env = {**os.environ, "PIN": "1" if nproc > 1 else "0", "SPLIT_REGIONS": "1" if regions else "0",
           "PEER_ROOT": str(root or ""), "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", "MODEL": model}
    if which == "torchtitan":  # its own venv: none of Tessera's import path
        env.pop("PYTHONPATH", None)
        env.update(TMPDIR=str(root / "tmp"), HF_HOME=str(root / "cache" / "hf"), HF_HUB_OFFLINE="1",
                   HF_DATASETS_CACHE=str(root / "cache" / "hf" / "datasets"))
        (root / "tmp").mkdir(exist_ok=True)
        torchrun, cwd = [str(root / "venv022" / "bin" / "torchrun")], root / "run022"
    else:
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        torchrun, cwd = [sys.executable, "-m", "torch.distributed.run"], None
        if model in PEER_TOML:  # c4_test resolves in the user's folder: the peer's run folder, as torchtitan's
            env["BUILD_WORKING_DIRECTORY"] = str(root / "run022")
    command = [*torchrun, "--standalone", f"--nproc_per_node={nproc}", "--role", "rank", "--tee", "3",
               "--log-dir", str(out / "torchrun"), str(HERE / "run_one.py"), which,
               *_job_args(which, root, dtype, nproc, steps, out / "dump", model, seq_len, local_batch), *extra]
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    text = _ANSI.sub("", proc.stdout + proc.stderr)
    (out / "output.log").write_text(text)
    if proc.returncode != 0 and _all_steps_logged(which, text, steps):
        # torchtitan 0.2.2's expert parallel on CPU aborts at exit ("terminate called without an
        # active exception") after its last step: the steps count
        print(f"note: {which} {dtype} x{nproc} exited {proc.returncode} after logging all {steps} steps", flush=True)
    elif proc.returncode != 0:
        raise RuntimeError(f"{which} {dtype} x{nproc} failed (exit {proc.returncode}); {out / 'output.log'}:\n"
                           + "\n".join(text.splitlines()[-15:]))
    lines = [line for line in text.splitlines() if not line.startswith("[rank") or line.startswith("[rank0]")]
    return "\n".join(lines)


def failure_reason(text: str) -> str:
    """The exception a failed run's ranks raised: the last such line of its output that is not
    torchrun's own summary."""
    lines = [re.sub(r"^\s*(?:\[rank\d+\]:)*\s*", "", line) for line in text.splitlines()]
    raised = [line for line in lines if re.match(r"[\w.]+(?:Error|Exception):", line) and "ChildFailedError" not in line]
    return raised[-1] if raised else "no exception in its output"


_PEAK = {"tessera": re.compile(r"\(peak ([0-9.]+)\)"), "torchtitan": re.compile(r"memory:\s*([0-9.]+)GiB")}


def peak_memory_gib(which: str, text: str) -> float | None:
    """The last step line's peak memory (host RSS high-water mark on CPU, in both stacks)."""
    peaks = [float(m.group(1)) for m in map(_PEAK[which].search, text.splitlines()) if m]
    return peaks[-1] if peaks else None


def _all_steps_logged(which: str, text: str, steps: int) -> bool:
    return any(int(m.group(1)) == steps for m in map(_STEP[which].search, text.splitlines()) if m)


_CPU = re.compile(r"^(?:\[rank0\]:)?cpu_s (\d+) ([0-9.]+)")


def parse(which: str, text: str, first: int, tokens_per_step: int = 0) -> dict:
    """Median tokens/s per rank over steps >= first, the last step's loss and peak memory, the parameter count;
    with ``tokens_per_step`` (a rank's) also the median tokens per CPU-second of the rank's process
    over those steps (from run_one's ``cpu_s`` lines; each step's CPU time is that between its log
    line and the one before)."""
    steps = {int(m.group(1)): (float(m.group(2)), float(m.group(3).replace(",", "")))
             for m in map(_STEP[which].search, text.splitlines()) if m}
    if not steps:
        raise RuntimeError(f"{which}: no step lines in its output")
    params = _PARAMS[which].search(text)
    rates = [tps for step, (_, tps) in steps.items() if step >= first]
    cpu = {int(m.group(1)): float(m.group(2)) for m in map(_CPU.search, text.splitlines()) if m}
    per_cpu_s = [tokens_per_step / (cpu[s] - cpu[s - 1]) for s in sorted(cpu) if s >= first and s - 1 in cpu]
    return {"tps": statistics.median(rates), "loss": steps[max(steps)][0], "peak": peak_memory_gib(which, text),
            "params": int(params.group(1).replace(",", "")) if params else None,
            "tpcs": statistics.median(per_cpu_s) if per_cpu_s and tokens_per_step else None}


def latest_trace(dump: Path) -> Path:
    traces = sorted(dump.glob("**/iteration_*/rank0_trace.json"),
                    key=lambda p: int(p.parent.name.split("_")[1]))
    if not traces:
        raise RuntimeError(f"no profiler trace under {dump}")
    return traces[-1]
