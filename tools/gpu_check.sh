#!/usr/bin/env bash
# GPU readiness (issue 17) on a bare CUDA machine: no network, no Bazel, the machine's python3
# ($PYTHON) and torch, torchao from .gpu_bundle/ (tools/gpu_bundle.sh, run beforehand where a
# registry is reachable). Runs tools/gpu_check (PASS/FAIL table), then hands the rest of an
# 8-minute budget to the throughput check tools/bench/gpu.sh. Results land in $OUT when set,
# else benchmarks/. Arguments go to gpu_check; --dry-run (automatic without CUDA, in both) goes
# to the bench too.
set -uo pipefail
out=$(realpath -m "${OUT:-$(dirname "$0")/../benchmarks}")  # a relative $OUT: from where it was given
export OUT=$out  # for tools/bench/gpu.sh
cd "$(dirname "$0")/.."
start=$SECONDS
timeout 300 tools/run_from_source.sh tools/gpu_check/gpu_check.py --out "$out" "$@"
status=$?
left=$((480 - (SECONDS - start)))
dry=()
if [[ " $* " == *" --dry-run "* ]]; then dry=(--dry-run); fi
if ((left > 120)); then
    tools/bench/gpu.sh "${dry[@]}" --budget_s $((left - 60)) || status=1
else
    echo "gpu_check.sh: ${left}s left of 480, tools/bench/gpu.sh not run"
    status=1
fi
exit $status
