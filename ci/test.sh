#!/usr/bin/env bash
# The CPU test suite (what CI runs): lint, unit tests (reference backend, Triton kernels through
# the Triton interpreter), every Triton kernel specialization the tests launched compiled for sm_90 and sm_80,
# the CPU parity matrix and the quick benchmark run.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1          # Triton kernels run on the CPU (slowly)
export RLK_REQUIRE_BACKENDS=reference,triton   # a backend CI installed must be there and available
export RLK_REQUIRE_TRL=1 RLK_REQUIRE_TRANSFORMERS=1 RLK_REQUIRE_MATPLOTLIB=1   # optional test deps CI installs
export PYTHONUNBUFFERED=1
out=${RLK_CI_OUT:-out/ci}
mkdir -p "$out"

echo "== ruff"; ruff check .
echo "== rlk-cuda native build (nvcc, sm_90a)"; bash ci/build_cuda.sh
export RLK_REQUIRE_INSTALLED=cuda   # built and installed above; unavailable without a GPU, with its reason
echo "== rlk info"; python3 -m rlk info
rm -rf "$out/triton_launches"
echo "== pytest"; RLK_RECORD_TRITON_LAUNCHES="$out/triton_launches" python3 -m pytest -n 2 --durations=15
echo "== the Triton kernels the tests launched, compiled for sm_90 and sm_80 (no GPU: Triton's LLVM and ptxas)"
env -u TRITON_INTERPRET python3 tools/triton_aot_check.py "$out"/triton_launches/*.json --arch 90 80
echo "== parity (CPU matrix)"; python3 -m parity --device cpu --out "$out/parity"
echo "== benchmarks (quick CPU mode)"; python3 bench_asv/run.py --quick --out "$out/bench"
echo "== asv (quick CPU mode)"
(cd bench_asv && asv machine --yes > /dev/null && asv check --python=same \
  && asv run --python=same --quick --launch-method forkserver --show-stderr)
