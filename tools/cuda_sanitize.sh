#!/usr/bin/env bash
# compute-sanitizer on every rlk-cuda kernel at small shapes (packages/rlk-cuda/tools/sanitize_cases.py):
# memcheck (out-of-bounds and misaligned accesses, leaks are torch's business: off), racecheck (shared
# memory hazards of the block reductions), synccheck and initcheck (reads of uninitialized device memory).
# Each tool's log goes to $OUT/sanitize_<tool>.log; the exit code is non-zero if any tool reports an error.
#   OUT=out/gpu bash tools/cuda_sanitize.sh [memcheck racecheck synccheck initcheck]
# Needs rlk-cuda installed and a GPU on which compute-sanitizer works (not under gVisor).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck synccheck initcheck)
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# Every tensor its own cudaMalloc: an out-of-bounds access then leaves the allocation.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1
failed=0
for tool in "${tools[@]}"; do
  log="$OUT/sanitize_$tool.log"
  extra=()
  [ "$tool" = memcheck ] && extra=(--leak-check no --check-device-heap yes)
  [ "$tool" = racecheck ] && extra=(--racecheck-report all)
  # only our kernels: torch's own (randn, copies) are not under test. Not for initcheck: it tracks
  # which bytes were written only inside instrumented kernels, so with the filter every input torch
  # wrote (randn, randint) reads as uninitialized (seen on the H200: 100 false reports in
  # selected_logprob_fwd reading targets).
  filter=(--kernel-name kns=rlk_cuda)
  [ "$tool" = initcheck ] && filter=()
  "$sanitizer" --tool "$tool" "${extra[@]}" "${filter[@]}" --error-exitcode 9 \
    python3 packages/rlk-cuda/tools/sanitize_cases.py > "$log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize_cases" "$log" | tr '\n' ' ')
  echo "$tool: rc=$rc $summary"
  [ $rc -ne 0 ] && failed=1
done
exit $failed
