set -u
export PYTHONUNBUFFERED=1
O=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $O/setup.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e packages/rlk -e packages/rlk-triton >> $O/setup.log 2>&1
(nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -m rlk info) > $O/info.log 2>&1
t0=$(date +%s)
timeout 40 python3 tools/profile_policy_loss.py > $O/profile_policy_loss.log 2>&1; echo "profile rc=$? $(( $(date +%s)-t0 ))s"
timeout 50 python3 bench_asv/run.py --only policy_loss --out $O/bench_policy_loss > $O/bench_policy_loss.log 2>&1; echo "bench pl rc=$? $(( $(date +%s)-t0 ))s"
timeout 80 python3 -m parity --device cuda --backends triton --ops policy_loss,kl_penalty,value_loss,dpo_loss,group_advantages,masked_whiten,discounted_returns,gae --dtypes fp32 --out $O/parity_rl > $O/parity_rl.log 2>&1; echo "parity rl rc=$? $(( $(date +%s)-t0 ))s"
timeout 80 python3 -m parity --device cuda --backends triton --ops rms_norm,matmul,attention,softmax,rope,embedding --quick --out $O/parity_chain > $O/parity_chain.log 2>&1; echo "parity chain rc=$? $(( $(date +%s)-t0 ))s"
timeout 40 python3 bench_asv/run.py --only rms_norm --out $O/bench_rms_norm > $O/bench_rms_norm.log 2>&1; echo "bench norm rc=$? $(( $(date +%s)-t0 ))s"
tail -5 $O/profile_policy_loss.log; grep "^| policy_loss" $O/bench_policy_loss/bench.md; grep -A12 "^## Matrix" $O/parity_rl/parity.md; grep -A22 "^## Matrix" $O/parity_chain/parity.md; grep "^| rms_norm" $O/bench_rms_norm/bench.md
