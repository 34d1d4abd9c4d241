#!/usr/bin/env bash
# Build, install and check rlk-rocm (the counterpart of ci/build_cuda.sh; shared by .ci/run and
# .github/workflows/wheels.yml).
#
#   bash ci/build_rocm.sh                 build with this machine's ROCm (Debian's hipcc / clang++-15 and ROCm 5.2
#                                         on the CI machine, apt-installed when missing), install, check (CPU)
#   bash ci/build_rocm.sh manylinux-rocm  install ROCm $RLK_ROCM_VERSION (6.2...) in a manylinux_2_28 container
#                                         (cibuildwheel's before-all)
#
# Default mode: RLK_ROCM_ARCHS keeps the package's default (gfx90a;gfx940 with ROCm 5.2), the package is built from
# its sdist (which must be self-contained: it carries the kernel headers shared with rlk-cuda) and installed without
# build isolation, then `python -m rlk info` must list backend rocm, without an AMD GPU as unavailable with a
# reason, and the CPU tests of packages/rlk-rocm/tests run. Nothing here runs a kernel.
set -euo pipefail
cd "$(dirname "$0")/.."

manylinux_rocm() {
  local version=${RLK_ROCM_VERSION:?set RLK_ROCM_VERSION, e.g. 6.2}
  cat > /etc/yum.repos.d/rocm.repo <<REPO
[rocm]
name=ROCm $version
baseurl=https://repo.radeon.com/rocm/rhel8/$version/main
enabled=1
gpgcheck=1
gpgkey=https://repo.radeon.com/rocm/rocm.gpg.key
REPO
  # the compiler (ROCm's clang), the HIP runtime and headers (hip-config.cmake) and the device libraries
  dnf install -y -q rocm-llvm hip-devel hip-runtime-amd rocm-device-libs
  /opt/rocm/llvm/bin/clang++ --version | head -n 1
}

if [ "${1:-}" = manylinux-rocm ]; then
  manylinux_rocm
  exit 0
fi
[ $# -eq 0 ] || { echo "usage: bash ci/build_rocm.sh [manylinux-rocm]" >&2; exit 2; }

export HIP_PLATFORM=amd  # Debian's hipcc otherwise picks nvcc where a CUDA toolkit is installed
start=$(date +%s)
echo "== toolchain"
if ! command -v hipcc >/dev/null && [ ! -x /opt/rocm/llvm/bin/clang++ ]; then
  apt-get install -y -q hipcc libamdhip64-dev rocm-device-libs >/dev/null
fi
# (hipcc runs rocm_agent_enumerator, which prints a traceback without a GPU: only its version line matters)
if command -v hipcc >/dev/null; then (hipcc --version 2>/dev/null || true) | grep -m 1 'HIP version' || true; fi
cmake --version | head -n 1
python3 -m pip install -q --disable-pip-version-check "scikit-build-core>=1.1" "nanobind>=2.0" "build>=1.2"
echo "== sdist, then build + install from it (the sdist must be self-contained)"
sdist_dir=$(mktemp -d)
python3 -m build -q --sdist --no-isolation packages/rlk-rocm -o "$sdist_dir"
listing=$(tar -tzf "$sdist_dir"/*.tar.gz)
echo "$listing" | grep -q 'csrc/shared/logprob.cuh' \
  || { echo "FAIL: the sdist lacks the shared kernel headers (csrc/shared)" >&2; exit 1; }
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  python3 -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps "$sdist_dir"/*.tar.gz
rm -rf "$sdist_dir"
echo "build + install took $(( $(date +%s) - start )) s"

echo "== rlk info"
info=$(python3 -m rlk info)
echo "$info" | sed -n '/^backends:/,/^ops/p'
line=$(echo "$info" | grep -E '^  rocm ' || true)
[ -n "$line" ] || { echo "FAIL: rlk info lists no backend 'rocm'" >&2; exit 1; }
if ! python3 -c 'import torch, sys; sys.exit(0 if torch.version.hip and torch.cuda.is_available() else 1)'; then
  echo "$line" | grep -q 'unavailable: .\+' \
    || { echo "FAIL: without an AMD GPU, backend rocm must be unavailable with a reason" >&2; exit 1; }
fi

echo "== rlk-rocm CPU tests"
python3 -m pytest -q -p no:xdist packages/rlk-rocm/tests
