#!/usr/bin/env bash
# One full GPU session on the H200 (or any CUDA machine without internet): set up rlk from this
# checkout, then run the requested steps, each logged under $OUT (default out/gpu).
#   bash tools/h200_run.sh [setup] [info] [tests] [parity] [bench] [sweep]
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
  "$@" > "$OUT/$name.log" 2>&1
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

for step in "${steps[@]}"; do
  case $step in
    setup)  run_step setup setup || { echo "setup failed"; break; } ;;
    info)   run_step info bash -c 'nvidia-smi; python3 -m rlk info; python3 -c "import triton, torch; print(triton.__version__, torch.__version__)"' ;;
    tests)  run_step tests env RLK_REQUIRE_GPU=1 RLK_REQUIRE_BACKENDS=reference,triton \
              python3 -m pytest -q -p no:xdist --durations=20 ;;
    parity) run_step parity python3 -m parity --device cuda --out "$OUT/parity" ;;
    bench)  run_step bench python3 bench_asv/run.py --out "$OUT/bench" ;;
    sweep)  run_step sweep python3 tools/sweep_linear.py ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "== summary"
for k in "${!status[@]}"; do echo "$k: ${status[$k]}"; done
