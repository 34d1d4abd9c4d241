#!/usr/bin/env bash
# Build, install and check rlk-cuda (shared by .ci/run and .github/workflows/wheels.yml).
#
#   bash ci/build_cuda.sh                     build with this machine's nvcc, install, check (CI, CPU machine)
#   bash ci/build_cuda.sh manylinux-toolkit   install the CUDA toolkit $RLK_CUDA_TOOLKIT (12.8, 13.0...) in a
#                                             manylinux_2_28 container (cibuildwheel's before-all)
#
# Default mode: the distribution name follows nvcc's major version (packages/rlk-cuda/tools/set_flavor.py
# auto), RLK_CUDA_ARCHS defaults to 90a (one architecture keeps the build near 30 s on 2 cores), the
# package is built from its sdist and installed without build isolation (scikit-build-core, nanobind and
# build are pip-installed first),
# then `python -m rlk info` must list backend cuda, and without a GPU as unavailable with a reason,
# and the CPU tests of packages/rlk-cuda/tests run.
set -euo pipefail
cd "$(dirname "$0")/.."

manylinux_toolkit() {
  local version=${RLK_CUDA_TOOLKIT:?set RLK_CUDA_TOOLKIT, e.g. 12.8 or 13.0}
  local pkg=${version/./-}
  dnf install -y -q dnf-plugins-core
  dnf config-manager --add-repo https://developer.download.nvidia.com/compute/cuda/repos/rhel8/x86_64/cuda-rhel8.repo
  # the compiler, the runtime headers and static library, and CCCL (headers cuda_bf16.h includes on 13.x)
  # and cuda.h (the CUtensorMap type of the Hopper forward; the driver itself is looked up at run time)
  dnf install -y -q "cuda-nvcc-$pkg" "cuda-cudart-devel-$pkg" "cuda-cccl-$pkg" "cuda-driver-devel-$pkg"
  dnf install -y -q "cuda-crt-$pkg" 2>/dev/null || true  # a separate package from CUDA 12.8 on
  ln -sfn "/usr/local/cuda-$version" /usr/local/cuda
  /usr/local/cuda/bin/nvcc --version
}

if [ "${1:-}" = manylinux-toolkit ]; then
  manylinux_toolkit
  exit 0
fi
[ $# -eq 0 ] || { echo "usage: bash ci/build_cuda.sh [manylinux-toolkit]" >&2; exit 2; }

export RLK_CUDA_ARCHS=${RLK_CUDA_ARCHS:-90a}
start=$(date +%s)
echo "== toolchain"
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
nvcc --version | tail -n 2
cmake --version | head -n 1
python3 -m pip install -q --disable-pip-version-check "scikit-build-core>=0.10" "nanobind>=2.0" "build>=1.2"
echo "== flavour: $(python3 packages/rlk-cuda/tools/set_flavor.py auto), RLK_CUDA_ARCHS=$RLK_CUDA_ARCHS"
echo "== sdist, then build + install from it (the sdist must be self-contained)"
sdist_dir=$(mktemp -d)
python3 -m build -q --sdist --no-isolation packages/rlk-cuda -o "$sdist_dir"
python3 -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps "$sdist_dir"/*.tar.gz
rm -rf "$sdist_dir"
echo "build + install took $(( $(date +%s) - start )) s"

echo "== rlk info"
info=$(python3 -m rlk info)
echo "$info" | sed -n '/^backends:/,/^ops/p'
line=$(echo "$info" | grep -E '^  cuda ' || true)
[ -n "$line" ] || { echo "FAIL: rlk info lists no backend 'cuda'" >&2; exit 1; }
if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "$line" | grep -q 'unavailable: .\+' \
    || { echo "FAIL: without a GPU, backend cuda must be unavailable with a reason" >&2; exit 1; }
fi

echo "== rlk-cuda CPU tests"
python3 -m pytest -q -p no:xdist packages/rlk-cuda/tests
