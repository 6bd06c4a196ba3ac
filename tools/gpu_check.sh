#!/usr/bin/env bash
# GPU readiness (issue 17), one command on a CUDA machine from a fresh clone: set up, build, run
# tools/gpu_check (PASS/FAIL table, result in benchmarks/gpu-check-<date>-<gpu>.md), then hand
# the rest of an 8-minute budget to the throughput check tools/bench/gpu.sh when present.
# Arguments go to gpu_check (e.g. --dry-run, automatic without CUDA).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
./tools/setup || exit 1
bazel build //tools/gpu_check || exit 1
timeout 300 bazel-bin/tools/gpu_check/gpu_check "$@"
status=$?
left=$((480 - (SECONDS - start)))
if [[ -x tools/bench/gpu.sh && " $* " != *" --dry-run "* ]] && nvidia-smi -L >/dev/null 2>&1; then
    if ((left > 120)); then
        tools/bench/gpu.sh --budget_s $((left - 60)) || status=1
    else
        echo "gpu_check.sh: ${left}s left of 480, tools/bench/gpu.sh not run"
    fi
fi
exit $status
