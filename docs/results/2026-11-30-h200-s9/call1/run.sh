#!/usr/bin/env bash
# experiment call 1: in-pass token count (work units claimed by waiting programs) and a one-program finish
set -uo pipefail
OUT=${OUT:-out}
OUT=$OUT bash tools/h200_run.sh setup > $OUT/setup_outer.log 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
timeout 240 env RLK_EXP_CIP=1 RLK_EXP_FB=1 RLK_REQUIRE_GPU=1 python3 -m pytest -q -x -n 8 -m gpu \
  packages/rlk-triton/tests/test_policy_loss_kernels.py packages/rlk/tests/test_policy_loss.py \
  packages/rlk/tests/test_no_host_sync.py -k "policy" > $OUT/tests_exp.log 2>&1; echo "tests rc=$?" >> $OUT/tests_exp.log
tail -3 $OUT/tests_exp.log
for r in 1 2; do
  timeout 120 python3 tools/sweep_policy_loss.py --grid COUNT_IN_PASS=0,1 FINISH_BLOCKS=0,1 > $OUT/sweep_self_$r.log 2>&1
  timeout 90 python3 tools/sweep_policy_loss.py --global-tokens --grid FINISH_BLOCKS=0,1 > $OUT/sweep_gtok_$r.log 2>&1
done
timeout 120 python3 tools/sweep_policy_loss.py --grid COUNT_IN_PASS=1 FINISH_BLOCKS=1 COUNT_UNIT=1024,4096,8192 FINISH_BLOCK_WARPS=8,32 > $OUT/sweep_knobs.log 2>&1
grep -h "policy_loss_and_grad\|gradients\|copy" $OUT/sweep_*.log | cut -c1-260
