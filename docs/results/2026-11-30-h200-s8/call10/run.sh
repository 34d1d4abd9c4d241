#!/usr/bin/env bash
# device call 10: the fold with a release-only counter (acquire load in the elected branch) vs acq_rel vs main
set -u
R=$OUT
OUT=$R bash tools/h200_run.sh setup > $R/setup_info.out 2>&1
export PYTHONPATH=/tmp/site
F=packages/rlk-triton/src/rlk_triton/policy_loss.py
cp $F tmp_ab/policy_loss_new.py
timeout 100 python3 tmp_ab/bits.py > $R/bits.log 2>&1; tail -1 $R/bits.log
for r in 1 2; do
  cp tmp_ab/policy_loss_new.py $F
  timeout 60 python3 tools/sweep_policy_loss.py --grid COUNTER_SEM=release,acq_rel > $R/r${r}_new.log 2>&1
  timeout 60 python3 tools/sweep_policy_loss.py --global-tokens --grid COUNTER_SEM=release,acq_rel > $R/r${r}_new_gtok.log 2>&1
  cp tmp_ab/policy_loss_old.py $F
  timeout 60 python3 tools/sweep_policy_loss.py --grid PROGRAMMATIC_LAUNCH=1 > $R/r${r}_old.log 2>&1
  timeout 60 python3 tools/sweep_policy_loss.py --global-tokens --grid PROGRAMMATIC_LAUNCH=1 > $R/r${r}_old_gtok.log 2>&1
done
cp tmp_ab/policy_loss_new.py $F
for f in $R/r*.log; do echo "# $(basename $f)"; grep -h "policy_loss_and_grad" $f | sed 's/ (kernels summed.*queued/ queued/'; done
cd $R && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz .
