#!/usr/bin/env bash
# device call: tile sweep of the fold (gradients after the counter) against main's file; the no-host-sync tests
set -u
R=$OUT
OUT=$R bash tools/h200_run.sh setup > $R/setup_info.out 2>&1
export PYTHONPATH=/tmp/site
F=packages/rlk-triton/src/rlk_triton/policy_loss.py
cp $F tmp_ab/policy_loss_new.py
G="BLOCK_T=1024,2048,4096 NUM_WARPS=4,8 MAX_REGISTERS=0,56"
timeout 120 python3 tools/sweep_policy_loss.py --grid $G > $R/new.log 2>&1
timeout 120 python3 tools/sweep_policy_loss.py --global-tokens --grid $G > $R/new_gtok.log 2>&1
cp tmp_ab/policy_loss_old.py $F
timeout 120 python3 tools/sweep_policy_loss.py --grid $G > $R/old.log 2>&1
timeout 120 python3 tools/sweep_policy_loss.py --global-tokens --grid $G > $R/old_gtok.log 2>&1
RLK_REQUIRE_GPU=1 timeout 100 python3 -m pytest -p no:xdist -q packages/rlk/tests/test_no_host_sync.py > $R/nosync.log 2>&1; tail -1 $R/nosync.log
cp tmp_ab/policy_loss_new.py $F
for f in $R/*.log; do echo "# $(basename $f)"; grep -h "policy_loss_and_grad" $f | sed 's/ (kernels summed.*\[/ [/'; done
cd $R && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz .
