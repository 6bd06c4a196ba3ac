#!/usr/bin/env bash
# Tessera from a source checkout, without Bazel or an install, for a site image with its own
# torch (a cluster's Python, the GPU machine's): runs the interpreter in $PYTHON (else python3)
# with every library, the trainer and the tools on PYTHONPATH, ahead of the wheels that
# tools/gpu_bundle.sh put in .gpu_bundle/ (torchao), each unpacked once into a folder of its own.
#   tools/run_from_source.sh -m tessera.trainer.main [--nproc N] [--job.config_file F] [--section.key value ...]
#   tools/run_from_source.sh tools/gpu_check/gpu_check.py [--dry-run] [--out DIR]
#   tools/run_from_source.sh -m torch.distributed.run --nproc_per_node 8 -m tessera.trainer.main ...
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
bundle="$root/.gpu_bundle"

paths=("$root"/libs/*/ "$root/apps/trainer")
for tool in "$root"/tools/*/; do
  case "$tool" in */bazel/ | */ci/) continue ;; esac
  if compgen -G "$tool*.py" >/dev/null; then paths+=("$tool"); fi
done
for wheel in "$bundle"/*.whl; do
  [[ -e $wheel ]] || continue
  site="$bundle/site/$(basename "$wheel" .whl)"
  if [[ ! -d $site ]]; then  # unpacked beside its final name, renamed when whole
    rm -rf "$site.partial"
    "$python" -m zipfile -e "$wheel" "$site.partial"
    mv -T "$site.partial" "$site"
  fi
  paths+=("$site")
done
PYTHONPATH="$(IFS=:; echo "${paths[*]}")${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH
exec "$python" "$@"
