#!/usr/bin/env bash
# Several GPU check stages in one device call, from the repository root on the CUDA machine:
#
#   scripts/gpu_calls.sh OUTDIR SECONDS STAGE:STEP[,STEP...]:BUDGET [...] [-- GPU_CHECK_ARGS]
#
# Runs `scripts/gpu_check.sh WORK --stage STAGE --steps STEPS --budget-s BUDGET` for each
# argument in order, in one work folder (WORK=${GPU_CALLS_WORK:-/tmp/gpu-calls}: kept on a
# warm machine, so a later call's report merges with this one's), all of them stopped at
# SECONDS; then ends what is left on the GPU and copies into OUTDIR (the device tool's $OUT)
# the merged gpu_report.json, each stage's log and a tarball of the rest (traces), so that
# what ran comes back even when time ran out. Arguments after `--` go to every gpu_check
# call (e.g. --dry-run). Exit status: 0 when every stage passed or was partial, else 1.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 3 ]; then
  echo "usage: scripts/gpu_calls.sh OUTDIR SECONDS STAGE:STEPS:BUDGET [...] [-- ARGS]" >&2
  exit 2
fi
out=$1 seconds=$2
shift 2
calls=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do calls+=("$1"); shift; done
[ $# -gt 0 ] && shift  # the "--"
extra=("$@")
work=${GPU_CALLS_WORK:-/tmp/gpu-calls}
mkdir -p "$out" "$work"
run_all() {
  local status=0 call stage steps budget
  for call in "${calls[@]}"; do
    IFS=: read -r stage steps budget <<<"$call"
    if [ -z "$stage" ] || [ -z "$steps" ] || [ -z "$budget" ]; then
      echo "gpu_calls: $call: expected STAGE:STEP[,STEP...]:BUDGET" >&2
      return 2
    fi
    "${PYTHON:-python3}" scripts/gpu_check.py "$work" --stage "$stage" --steps "$steps" \
      --budget-s "$budget" "${extra[@]}" || status=1
  done
  return $status
}
timeout --signal=TERM --kill-after=10 "$seconds" bash -c "$(declare -p calls extra work); \
  $(declare -f run_all); run_all"
status=$?
if command -v nvidia-smi >/dev/null 2>&1; then  # what the stages left running
  nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9 2>/dev/null
fi
cp "$work"/gpu_report.json "$work"/*.log "$out"/ 2>/dev/null
tar czf "$out/rest.tgz" -C "$work" --exclude=site --exclude='*.log' \
  --exclude=gpu_report.json . 2>/dev/null
echo "gpu_calls: status $status; in $out: $(ls "$out" | tr '\n' ' ')"
[ $status -eq 0 ]
