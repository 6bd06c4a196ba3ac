#!/usr/bin/env bash
# The wheels a machine without network but with its own torch (the GPU machine: python3 3.12,
# torch 2.11) needs beside the checkout, fetched where a package registry is reachable, into the
# git-ignored .gpu_bundle/ (carry it with the working tree; tools/run_from_source.sh unpacks it).
# Only torchao, at the lock's version: 0.18.0 supports torch 2.11 through 2.13. Never torch.
#   tools/gpu_bundle.sh [--python-version 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=3.12
if [[ ${1:-} == --python-version ]]; then python_version=${2:?--python-version needs a value}; fi
limit_mib=60

torchao=$(grep -i '^torchao==' requirements_lock.txt)
rm -rf .gpu_bundle.partial
mkdir -p .gpu_bundle.partial
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$python_version" --platform manylinux_2_28_x86_64 --dest .gpu_bundle.partial "$torchao"
size_mib=$(du -sm .gpu_bundle.partial | cut -f1)
if ((size_mib > limit_mib)); then
  echo "gpu_bundle: ${size_mib} MiB is over the ${limit_mib} MiB that may travel" >&2
  exit 1
fi
rm -rf .gpu_bundle
mv -T .gpu_bundle.partial .gpu_bundle
echo "gpu_bundle: $(ls .gpu_bundle | tr '\n' ' ')(${size_mib} MiB) in .gpu_bundle/"
