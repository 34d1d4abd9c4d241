#!/usr/bin/env bash
# One full GPU session on the H200 (or any CUDA machine without internet): set up rlk from this
# checkout, then run the requested steps, each logged under $OUT (default out/gpu).
#   bash tools/h200_run.sh [setup] [info] [tests] [gputests] [parity] [bench] [sweep] [sweep_matmul]
#                          [sweep_attention] [sweep_policy_loss] [profile_policy_loss] [cuda] [consistency] [chain_bench] [demo] [launch] [bundle]
# PARITY_OPS / BENCH_ONLY narrow the parity and bench steps (comma-separated ops; one --only key);
# PARITY_ARGS adds arguments (e.g. --quick); PYTEST_ARGS replaces gputests' '-p no:xdist' (e.g. '-n 8'); STEP_TIMEOUT (seconds, default 590) bounds each step but setup.
# `consistency` runs `rlk consistency` (CONSISTENCY_MODEL, default qwen3-8b-shape in bf16; CONSISTENCY_PROMPTS,
# default 8); `chain_bench` times the forward with rlk's chain off vs on (tools/bench_chain_forward.py, default
# qwen3-8b-shape bf16; CHAIN_BENCH_ARGS adds arguments, e.g. '--num-layers 8 --reps 3'); `demo` runs `rlk demo`. `cuda` builds and checks rlk-cuda (packages/rlk-cuda/tools/h200_cuda.sh). `bundle` packs everything under
# $OUT into $OUT/bundle.tgz and removes the rest (the device tool returns only a few files per call).
# Pure-Python wheels the machine lacks (pytest, setuptools) may be put in .whl/ beforehand.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(setup info tests parity bench)
declare -A status

run_step() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  echo "== $name: $*"
  if [ "$(type -t "$1")" = function ]; then
    "$@" > "$OUT/$name.log" 2>&1
  else
    timeout "${STEP_TIMEOUT:-590}" "$@" > "$OUT/$name.log" 2>&1
  fi
  local rc=$?
  status[$name]="rc=$rc $(( $(date +%s) - t0 ))s"
  tail -n 25 "$OUT/$name.log"
  return $rc
}

setup() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e packages/rlk -e packages/rlk-triton
}

[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # a previous call's setup
for step in "${steps[@]}"; do
  case $step in
    setup)  run_step setup setup || { echo "setup failed"; break; } ;;
    info)   run_step info bash -c 'nvidia-smi; python3 -m rlk info; python3 -c "import triton, torch; print(triton.__version__, torch.__version__)"' ;;
    tests)  run_step tests env RLK_REQUIRE_GPU=1 RLK_REQUIRE_BACKENDS=reference,triton \
              python3 -m pytest -q -p no:xdist --durations=20 ;;
    gputests) run_step gputests env RLK_REQUIRE_GPU=1 RLK_REQUIRE_BACKENDS=reference,triton RLK_REQUIRE_TRANSFORMERS=1 \
              python3 -m pytest -v ${PYTEST_ARGS:--p no:xdist} -m gpu --durations=20 ;;
    parity) run_step parity python3 -m parity --device cuda --out "$OUT/parity" ${PARITY_OPS:+--ops $PARITY_OPS} \
              ${PARITY_ARGS:-} ;;
    bench)  run_step "bench${BENCH_ONLY:+_$BENCH_ONLY}" python3 bench_asv/run.py \
              --out "$OUT/bench${BENCH_ONLY:+_$BENCH_ONLY}" ${BENCH_ONLY:+--only $BENCH_ONLY} ;;
    sweep)  run_step sweep python3 tools/sweep_linear.py ;;
    sweep_matmul) run_step sweep_matmul python3 tools/sweep_matmul.py ;;
    sweep_attention) run_step sweep_attention python3 tools/sweep_attention.py ;;
    sweep_policy_loss) run_step sweep_policy_loss python3 tools/sweep_policy_loss.py ;;
    consistency) run_step consistency python3 -m rlk consistency --model "${CONSISTENCY_MODEL:-qwen3-8b-shape}" \
              --device cuda --prompts "${CONSISTENCY_PROMPTS:-8}" --out "$OUT/consistency" ;;
    chain_bench) run_step chain_bench python3 tools/bench_chain_forward.py --out "$OUT/chain_bench" ${CHAIN_BENCH_ARGS:-} ;;
    demo)   run_step demo python3 -m rlk demo --out "$OUT/demo" ;;
    launch) run_step launch python3 tools/profile_launch.py ;;
    profile_policy_loss) run_step profile_policy_loss python3 tools/profile_policy_loss.py ;;
    cuda)   run_step cuda env OUT="$OUT/cuda" bash packages/rlk-cuda/tools/h200_cuda.sh ;;
    bundle) tar czf /tmp/bundle.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/bundle.tgz "$OUT/" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "== summary"
for k in "${!status[@]}"; do echo "$k: ${status[$k]}"; done
