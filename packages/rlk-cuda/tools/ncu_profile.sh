#!/usr/bin/env bash
# Nsight Compute profiles of the rlk-cuda kernels at the benchmark shapes (tools/ncu_cases.py), to say what limits
# the kernels that miss their targets: speed of light (compute / memory throughput), memory workload, occupancy,
# warp stall reasons. Each case's report goes to $OUT/ncu_<case>.txt (ncu --print-details all, text).
#   OUT=out/gpu bash packages/rlk-cuda/tools/ncu_profile.sh [selected norm linear_fwd linear_bwd]
# Needs rlk-cuda installed, ncu on PATH (or under /usr/local/cuda/bin) and GPU performance counters allowed.
# linear_bwd profiles only the first 3 kernels of the backward (one vocab chunk's G, grad_hidden, grad_weight).
set -uo pipefail
OUT=$(realpath -m "${OUT:-out/gpu}")
mkdir -p "$OUT"
cd "$(dirname "$0")"
cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=(selected norm linear_fwd linear_bwd)
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
          --section WarpStateStats --section ComputeWorkloadAnalysis)
failed=0
for case in "${cases[@]}"; do
  limit=()
  [ "$case" = linear_bwd ] && limit=(--launch-count 3)
  "$ncu" --profile-from-start off "${sections[@]}" "${limit[@]}" --print-details all \
    python3 ncu_cases.py "$case" > "$OUT/ncu_$case.txt" 2>&1
  rc=$?
  echo "$case: rc=$rc, $(grep -c '^  [a-zA-Z_].*(.*)x(.*)' "$OUT/ncu_$case.txt") kernels profiled"
  [ $rc -ne 0 ] && failed=1
done
exit $failed
