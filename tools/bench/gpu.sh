#!/usr/bin/env bash
# One command on a CUDA machine, from a fresh clone: set up, build, and run the GPU throughput
# check (tools/bench/gpu_bench.py) within about 8 minutes; the result lands in benchmarks/.
set -euo pipefail
cd "$(dirname "$0")/../.."
./tools/setup
bazel build //tools/bench:gpu_bench
timeout 480 bazel-bin/tools/bench/gpu_bench "$@"
