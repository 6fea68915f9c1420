#!/usr/bin/env bash
# The GPU check (issue 15), run from the repository root on the CUDA machine with .whl/
# (make gpu-wheels) beside it:  scripts/gpu_check.sh OUTDIR [--stage NAME] [--dry-run] ...
# The logic (installs, stages, report) is in scripts/gpu_check.py; --help lists the options.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: scripts/gpu_check.sh OUTDIR [--stage kernels|executor|cluster|throughput]" >&2
  exit 2
fi
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
