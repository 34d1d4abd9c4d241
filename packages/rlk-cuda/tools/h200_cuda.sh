#!/usr/bin/env bash
# One GPU session for rlk-cuda on the H200 (no internet there; nvcc, cmake, ninja, nanobind and
# scikit-build-core are installed): build and install rlk-cuda from this checkout, then run its GPU
# tests, compute-sanitizer on every kernel and the bandwidth benchmark. Each step logs to $OUT/<step>.log.
#   OUT=... bash packages/rlk-cuda/tools/h200_cuda.sh [build] [tests] [sanitize] [bench]
# Default: all four. RLK_CUDA_ARCHS (default 90a) selects what is compiled. Files under $OUT: build.log,
# tests.log, sanitize.log, sanitize_{memcheck,racecheck,synccheck,initcheck}.log, bench.log (8).
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RLK_CUDA_ARCHS=${RLK_CUDA_ARCHS:-90a}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build tests sanitize bench)
declare -A status

run_step() {  # name, command...
  local name=$1; shift
  local t0
  t0=$(date +%s)
  echo "== $name: $*"
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  status[$name]="rc=$rc $(( $(date +%s) - t0 ))s"
  tail -n 30 "$OUT/$name.log"
  return $rc
}

build() {
  nvidia-smi --query-gpu=name,driver_version --format=csv
  nvcc --version | tail -n 2
  python3 -c "import torch, nanobind, scikit_build_core as s; print('torch', torch.__version__, 'nanobind', \
nanobind.__version__, 'scikit-build-core', s.__version__)"
  if ls .whl/*.whl >/dev/null 2>&1; then  # pure-Python wheels the machine lacks, carried in .whl/
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e packages/rlk -e packages/rlk-triton \
    || return 1
  python3 packages/rlk-cuda/tools/set_flavor.py auto || return 1
  python3 -m pip install -v --no-index --no-deps --no-build-isolation packages/rlk-cuda || return 1
  python3 -m rlk info
}

[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
for step in "${steps[@]}"; do
  case $step in
    build)    run_step build build || { echo "build failed"; break; }
              export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;;
    tests)    run_step tests env RLK_REQUIRE_GPU=1 python3 -m pytest -q -s -p no:xdist --durations=15 \
                packages/rlk-cuda/tests ;;
    sanitize) run_step sanitize env OUT="$OUT" bash tools/cuda_sanitize.sh ;;
    bench)    run_step bench python3 packages/rlk-cuda/tools/bench_cuda.py ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "== summary"
for k in "${!status[@]}"; do echo "$k: ${status[$k]}"; done
if [ -f "$OUT/tests.log" ]; then
  echo "== worst contract ratios (worst / allowed; lines 'RATIO test output dtype ratio' in tests.log)"
  grep -oh "RATIO .*" "$OUT/tests.log" | sort -k5 -g -r | head -n 20
fi
