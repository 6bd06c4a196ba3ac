#!/usr/bin/env bash
# The GPU throughput check (tools/bench/gpu_bench.py) within about 8 minutes on a bare CUDA
# machine: the machine's python3 ($PYTHON) and torch, torchao from .gpu_bundle/
# (tools/gpu_bundle.sh); no network, no Bazel. The result lands in $OUT when set, else benchmarks/.
set -euo pipefail
out=$(realpath -m "${OUT:-$(dirname "$0")/../../benchmarks}")  # a relative $OUT: from where it was given
cd "$(dirname "$0")/../.."
timeout 480 tools/run_from_source.sh tools/bench/gpu_bench.py --out "$out" "$@"
