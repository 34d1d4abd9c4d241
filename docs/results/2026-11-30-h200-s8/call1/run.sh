#!/usr/bin/env bash
# device call: PART=a: bit equality and A/B sweeps (new vs previous commit's policy_loss.py), tests;
#              PART=b: parity, benchmark, profile
set -u
R=$OUT
OUT=$R bash tools/h200_run.sh setup info > $R/setup_info.out 2>&1
export PYTHONPATH=/tmp/site
F=packages/rlk-triton/src/rlk_triton/policy_loss.py
cp $F tmp_ab/policy_loss_new.py
if [ "$PART" = a ]; then
  timeout 100 python3 tmp_ab/bits.py > $R/bits.log 2>&1; tail -3 $R/bits.log
  for r in 1 2; do
    cp tmp_ab/policy_loss_new.py $F
    timeout 60 python3 tools/sweep_policy_loss.py --grid PROGRAMMATIC_LAUNCH=0,1 > $R/r${r}_new.log 2>&1
    timeout 60 python3 tools/sweep_policy_loss.py --global-tokens --grid PROGRAMMATIC_LAUNCH=0,1 > $R/r${r}_new_gtok.log 2>&1
    cp tmp_ab/policy_loss_old.py $F
    timeout 60 python3 tools/sweep_policy_loss.py --grid PROGRAMMATIC_LAUNCH=0,1 > $R/r${r}_old.log 2>&1
    timeout 60 python3 tools/sweep_policy_loss.py --global-tokens --grid PROGRAMMATIC_LAUNCH=0,1 > $R/r${r}_old_gtok.log 2>&1
    date
  done
  cp tmp_ab/policy_loss_new.py $F
  grep -h "policy_loss_and_grad" $R/r*.log
  RLK_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q -n 8 packages/rlk-triton/tests/test_policy_loss_kernels.py packages/rlk/tests/test_policy_loss.py packages/rlk/tests/test_linear_policy_loss.py packages/rlk/tests/test_bench_baselines.py > $R/tests.log 2>&1; tail -3 $R/tests.log
else
  OUT=$R PARITY_OPS=policy_loss,kl_penalty BENCH_ONLY=policy_loss STEP_TIMEOUT=200 bash tools/h200_run.sh parity bench profile_policy_loss
fi
cd $R && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz .
