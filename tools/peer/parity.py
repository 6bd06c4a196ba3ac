#!/usr/bin/env python3
"""Numerical parity of Tessera's training step with torchtitan 0.2.2 on CPU (a manual tool: CI has
no torchtitan). Both trainers read the peer's own debug_model.toml in its run folder, so the same
keys name the same model, tokenizer and data; what makes the runs comparable:

- initial weights: a Tessera seed checkpoint exported to Hugging Face safetensors, which both load
  (`checkpoint.initial_load_in_hf`), so step 1's loss is a forward pass of the same weights;
- tokens: the first windows of both loaders are compared id for id before training (Tessera with
  `training.shuffle false`, its own key, so documents come in file order as torchtitan's);
- metrics: both write TensorBoard events under torchtitan's tags, read back at full precision.

  PEER_ROOT=/tmp/peer python3 tools/peer/parity.py [--steps 10] [--dtype float32] [--float64-norm] ...
Needs the peer (/work/shared/peer-torchtitan/setup.sh) and `safetensors` in its venv (installed
here when missing). Tessera runs from source (tools/run_from_source.sh; $PYTHON picks its
interpreter). Prints the per-step table as Markdown; exits 1 when a relative difference exceeds
--tolerance, 2 on a bad setup.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOML = "train_configs/debug_model.toml"
TAGS = {"loss": "loss_metrics/global_avg_loss", "grad_norm": "grad_norm", "lr": "lr"}

# Run in the peer's venv: torchtitan's own tokenizer and c4_test loader, first windows as JSON.
TORCHTITAN_WINDOWS = """
import json, sys
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset
seq_len, count, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
data = HuggingFaceTextDataset("c4_test", None, HuggingFaceTokenizer("tests/assets/tokenizer"), seq_len)
windows = []
for inputs, labels in data:
    windows.append(inputs["input"].tolist() + labels[-1:].tolist())
    if len(windows) == count:
        break
json.dump(windows, open(out, "w"))
"""

# Run through tools/run_from_source.sh: the trainer's own plan and loader for the same arguments.
TESSERA_WINDOWS = """
import json, sys
import torch
from tessera.data import load_tokenizer
from tessera.trainer.config import load_config
from tessera.trainer.data_wiring import datasets, training_loader
from tessera.trainer.plan import make_plan, tokenizer_source
count, out, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
config = load_config(argv)
plan = make_plan(config, 1, "cpu")
train_sets, weights, _ = datasets(plan, say=False)
loader = training_loader(plan, train_sets, weights, load_tokenizer(tokenizer_source(config)), 0, 1, None)
windows = []
while len(windows) < count:
    inputs, labels = next(loader)
    windows += torch.cat([inputs, labels[:, -1:]], dim=1).tolist()
json.dump(windows[:count], open(out, "w"))
"""

# torchtitan's entry in the peer's venv: the peer's CPU patches, and with --float64-norm the total
# gradient norm accumulated in float64 as Tessera's (torch's float32 CPU norm drifts ~1e-4).
TORCHTITAN_ENTRY = """
import runpy, sys
peer, norm = sys.argv.pop(1), sys.argv.pop(1)  # before torchtitan's import binds sys.argv[1:] as its default
sys.path.insert(0, peer)
import cpu_launch  # noqa: F401
import torch
if norm == "float64":
    def total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        norms = [torch.linalg.vector_norm(t, norm_type, dtype=torch.float64) for t in tensors]
        return torch.linalg.vector_norm(torch.stack(norms), norm_type).float()
    torch.nn.utils.get_total_norm = total_norm
sys.argv[0] = "torchtitan.train"
runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
"""

# Run in the peer's venv: the scalars of the one TensorBoard run under a folder, at full precision.
READ_EVENTS = """
import json, sys
from pathlib import Path
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
folders = {str(p.parent) for p in Path(sys.argv[1]).rglob("events.out.tfevents.*")}
if len(folders) != 1:
    sys.exit(f"expected one TensorBoard run under {sys.argv[1]}, found {sorted(folders)}")
events = EventAccumulator(folders.pop(), size_guidance={"scalars": 0})
events.Reload()
tags = json.loads(sys.argv[2])
print(json.dumps({name: {e.step: e.value for e in events.Scalars(tag)} for name, tag in tags.items()}))
"""


def run(command: list[str], cwd: Path, log: Path | None = None) -> str:
    """`command` in `cwd`; its output to `log` (or returned); a failure ends the tool with its tail."""
    result = subprocess.run(command, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if log is not None:
        log.write_text(result.stdout)
    if result.returncode:
        sys.exit(f"failed ({result.returncode}): {' '.join(command)}\n{result.stdout[-3000:]}")
    return result.stdout


def common_flags(args, dump: Path) -> list[str]:
    """The keys both runs get, each with torchtitan's meaning."""
    return ["--job.config_file", TOML, "--job.dump_folder", str(dump), "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.batch), "--training.global_batch_size", str(args.global_batch),
            "--training.steps", str(args.steps),
            "--training.mixed_precision_param", args.dtype, "--activation_checkpoint.mode", "none",
            "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "--metrics.disable_color_printing",
            "--checkpoint.initial_load_path", str(args.out / "hf0"), "--checkpoint.initial_load_in_hf",
            "--debug.seed", "42"]


def tessera(args, *argv: str, log: Path | None = None) -> str:
    return run([str(REPO / "tools/run_from_source.sh"), *argv], args.run_dir, log)


def peer_python(args) -> str:
    return str(args.peer / "venv022/bin/python")


def seed_weights(args) -> None:
    """Tessera's step-0 weights for this TOML, as a Hugging Face folder (out/hf0)."""
    seed = args.out / "seed"
    tessera(args, "-m", "tessera.trainer.main", "--job.config_file", TOML, "--job.dump_folder", str(seed),
            "--training.seq_len", str(args.seq_len), "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
            "--debug.seed", "42")
    tessera(args, str(REPO / "tools/convert/convert.py"), "dcp-to-hf", str(seed / "checkpoint/step-0"),
            str(args.out / "hf0"))


def compare_windows(args, tessera_flags: list[str]) -> int:
    """How many of the first windows are identical, id for id (all of them, or the tool ends)."""
    theirs, ours = args.out / "windows_torchtitan.json", args.out / "windows_tessera.json"
    run([peer_python(args), "-c", TORCHTITAN_WINDOWS, str(args.seq_len), str(args.windows), str(theirs)], args.run_dir)
    tessera(args, "-c", TESSERA_WINDOWS, str(args.windows), str(ours), *tessera_flags)
    a, b = json.loads(theirs.read_text()), json.loads(ours.read_text())
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            at = next(j for j, (p, q) in enumerate(zip(x, y)) if p != q)
            sys.exit(f"window {i} differs first at token {at}: torchtitan {x[at:at + 8]}, Tessera {y[at:at + 8]}")
    return len(a)


def train_torchtitan(args) -> None:
    entry = args.out / "torchtitan_entry.py"
    entry.write_text(TORCHTITAN_ENTRY)
    norm = "float64" if args.float64_norm else "torch"
    run([str(args.peer / "venv022/bin/torchrun"), "--standalone", "--nproc_per_node=1", "--no-python",
         peer_python(args), str(entry), str(args.peer), norm, *common_flags(args, args.out / "torchtitan"),
         "--checkpoint.enable", "--checkpoint.interval", "100000"], args.run_dir, args.out / "torchtitan.log")


def train_tessera(args, flags: list[str]) -> None:
    tessera(args, "-m", "tessera.trainer.main", *flags, log=args.out / "tessera.log")


def scalars(args, name: str) -> dict[str, dict[int, float]]:
    out = run([peer_python(args), "-c", READ_EVENTS, str(args.out / name), json.dumps(TAGS)], args.run_dir)
    return {metric: {int(step): value for step, value in values.items()} for metric, values in json.loads(out).items()}


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-30)


def table(tt: dict, ts: dict) -> tuple[str, float, float]:
    """The per-step Markdown table and the largest relative differences of loss and grad_norm."""
    rows = ["| step | loss torchtitan | loss Tessera | rel diff | grad_norm torchtitan | grad_norm Tessera | rel diff | lr equal |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    worst_loss = worst_norm = 0.0
    for step in sorted(tt["loss"]):
        la, lb, ga, gb = tt["loss"][step], ts["loss"][step], tt["grad_norm"][step], ts["grad_norm"][step]
        worst_loss, worst_norm = max(worst_loss, relative(la, lb)), max(worst_norm, relative(ga, gb))
        lr = "yes" if relative(tt["lr"][step], ts["lr"][step]) < 1e-6 else f"{tt['lr'][step]:.3g} vs {ts['lr'][step]:.3g}"
        rows.append(f"| {step} | {la:.6f} | {lb:.6f} | {relative(la, lb):.1e} | {ga:.6f} | {gb:.6f} | "
                    f"{relative(ga, gb):.1e} | {lr} |")
    return "\n".join(rows), worst_loss, worst_norm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-root", type=Path, default=os.environ.get("PEER_ROOT"))
    parser.add_argument("--out", type=Path, help="a new folder for this comparison (default: PEER_ROOT/parity-<dtype>)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=-1,
                        help="a multiple of --batch: gradient accumulation over that many sequences (-1: none)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--windows", type=int, default=64, help="token windows compared before training")
    parser.add_argument("--float64-norm", action="store_true",
                        help="torchtitan's total gradient norm accumulated in float64, as Tessera's")
    parser.add_argument("--tolerance", type=float, help="max relative loss difference (default: 1e-5 fp32, 2e-2 bf16)")
    parser.add_argument("--norm-tolerance", type=float,
                        help="max relative grad_norm difference (default: the loss's; 5e-4 in fp32 without --float64-norm)")
    args = parser.parse_args()
    if args.peer_root is None or not (args.peer_root / "venv022/bin/torchrun").exists():
        print("error: --peer-root / PEER_ROOT must be a folder set up by peer-torchtitan/setup.sh", file=sys.stderr)
        return 2
    args.peer, args.run_dir = args.peer_root.resolve(), args.peer_root.resolve() / "run022"
    args.out = (args.out or args.peer / f"parity-{args.dtype}").resolve()
    if args.out.exists():
        print(f"error: --out {args.out} exists; remove it or name another", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True)
    tolerance = args.tolerance or (1e-5 if args.dtype == "float32" else 2e-2)
    norm_tolerance = args.norm_tolerance or (5e-4 if args.dtype == "float32" and not args.float64_norm else tolerance)
    os.environ.update(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                      HF_HOME=str(args.peer / "cache/hf"), PYTHONUNBUFFERED="1")
    run([str(args.peer / "venv022/bin/pip"), "install", "-q", "safetensors"], args.run_dir)  # torchtitan's HF reader

    seed_weights(args)
    flags = [*common_flags(args, args.out / "tessera"), "--training.shuffle", "false"]
    print(f"token windows identical: the first {compare_windows(args, flags)} of seq_len + 1 = {args.seq_len + 1}")
    train_torchtitan(args)
    train_tessera(args, flags)
    rows, worst_loss, worst_norm = table(scalars(args, "torchtitan"), scalars(args, "tessera"))
    print(rows)
    print(f"largest relative difference ({args.dtype}): loss {worst_loss:.2e} (tolerance {tolerance:g}), "
          f"grad_norm {worst_norm:.2e} (tolerance {norm_tolerance:g})")
    return 0 if worst_loss <= tolerance and worst_norm <= norm_tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
