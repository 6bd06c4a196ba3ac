"""Tessera and torchtitan 0.2.2 on the same job, run the same way: both under torchrun (2 ranks
pinned to one core each), llama3 debugmodel (6,163,712 parameters in both: vocabulary 2048),
seq 256, local batch 8, AC and compile off, seed 42, the same JSON-lines text, a log line per
step. torchtitan runs from the peer set up by ../shared/peer-torchtitan/setup.sh under
$PEER_ROOT (its venv, debug config, test tokenizer and c4_test stand-in) through that folder's
cpu_launch.py (CPU patches, torchtitan's files untouched).

Tessera keeps its default tokenizer (2048 tokens, the size of torchtitan's debugmodel
vocabulary, whatever its tokenizer): the models match parameter for parameter, the token
streams do not, so losses are not comparable.
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


def _job_args(which: str, root: Path, dtype: str, nproc: int, steps: int, dump: Path) -> list[str]:
    args = ["--job.dump_folder", str(dump), "--debug.seed", "42", "--training.seq_len", COMMON["seq_len"],
            "--training.local_batch_size", COMMON["local_batch_size"], "--training.steps", str(steps),
            "--activation_checkpoint.mode", "none", "--training.mixed_precision_param", dtype]
    if nproc > 1:
        args += ["--parallelism.data_parallel_shard_degree", str(nproc)]
    if which == "torchtitan":
        return ["--job.config_file", "train_configs/debug_model.toml", "--metrics.disable_color_printing", *args]
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
           regions: bool = False) -> str:
    """Runs one job under torchrun (root: the peer, needed for torchtitan; Tessera reads its
    text when there is one); returns rank 0's output (raises with its tail on failure)."""
    env = {**os.environ, "PIN": "1" if nproc > 1 else "0", "SPLIT_REGIONS": "1" if regions else "0",
           "PEER_ROOT": str(root or ""), "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    if which == "torchtitan":  # its own venv: none of Tessera's import path
        env.pop("PYTHONPATH", None)
        env.update(TMPDIR=str(root / "tmp"), HF_HOME=str(root / "cache" / "hf"), HF_HUB_OFFLINE="1",
                   HF_DATASETS_CACHE=str(root / "cache" / "hf" / "datasets"))
        (root / "tmp").mkdir(exist_ok=True)
        torchrun, cwd = [str(root / "venv022" / "bin" / "torchrun")], root / "run022"
    else:
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        torchrun, cwd = [sys.executable, "-m", "torch.distributed.run"], None
    command = [*torchrun, "--standalone", f"--nproc_per_node={nproc}", "--role", "rank", "--tee", "3",
               "--log-dir", str(out / "torchrun"), str(HERE / "run_one.py"), which,
               *_job_args(which, root, dtype, nproc, steps, out / "dump"), *extra]
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    text = _ANSI.sub("", proc.stdout + proc.stderr)
    (out / "output.log").write_text(text)
    if proc.returncode != 0:
        raise RuntimeError(f"{which} {dtype} x{nproc} failed (exit {proc.returncode}); {out / 'output.log'}:\n"
                           + "\n".join(text.splitlines()[-15:]))
    lines = [line for line in text.splitlines() if not line.startswith("[rank") or line.startswith("[rank0]")]
    return "\n".join(lines)


def parse(which: str, text: str, first: int) -> dict:
    """Median tokens/s per rank over steps >= first, the last step's loss, the parameter count."""
    steps = {int(m.group(1)): (float(m.group(2)), float(m.group(3).replace(",", "")))
             for m in map(_STEP[which].search, text.splitlines()) if m}
    if not steps:
        raise RuntimeError(f"{which}: no step lines in its output")
    params = _PARAMS[which].search(text)
    rates = [tps for step, (_, tps) in steps.items() if step >= first]
    return {"tps": statistics.median(rates), "loss": steps[max(steps)][0],
            "params": int(params.group(1).replace(",", "")) if params else None}


def latest_trace(dump: Path) -> Path:
    traces = sorted(dump.glob("**/iteration_*/rank0_trace.json"),
                    key=lambda p: int(p.parent.name.split("_")[1]))
    if not traces:
        raise RuntimeError(f"no profiler trace under {dump}")
    return traces[-1]
