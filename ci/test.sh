#!/usr/bin/env bash
# The CPU test suite (what CI runs): lint, the docs site, unit tests (reference backend, Triton kernels through
# the Triton interpreter), every Triton kernel specialization the tests launched compiled for sm_90 and sm_80,
# the CPU parity matrix (quick subset) and the quick benchmark run.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1          # Triton kernels run on the CPU (slowly)
export RLK_REQUIRE_BACKENDS=reference,triton   # a backend CI installed must be there and available
export RLK_REQUIRE_TRL=1 RLK_REQUIRE_TRANSFORMERS=1 RLK_REQUIRE_MATPLOTLIB=1   # optional test deps CI installs
export PYTHONUNBUFFERED=1
out=${RLK_CI_OUT:-out/ci}
mkdir -p "$out"

echo "== ruff"; ruff check . && ruff format --check .
echo "== mypy (rlk.core)"; python3 -m mypy packages/rlk/src/rlk/core
echo "== clang-format (csrc)"; clang-format --dry-run --Werror packages/rlk-cuda/csrc/* packages/rlk-rocm/csrc/*
echo "== docs site (mkdocs build --strict: broken links, missing pages, API pages from the docstrings)"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict -q -d "$out/site"
echo "== rlk-cuda native build (nvcc, sm_90a)"; bash ci/build_cuda.sh
echo "== rlk-rocm native build (Debian's ROCm 5.2 hipcc, gfx90a and gfx940)"; bash ci/build_rocm.sh
# built and installed above (rlk-domestic by ci/install.sh); unavailable on this machine, each with its reason
export RLK_REQUIRE_INSTALLED=cuda,rocm,domestic
echo "== rlk info"; python3 -m rlk info
rm -rf "$out/triton_launches"
echo "== pytest"; RLK_RECORD_TRITON_LAUNCHES="$out/triton_launches" python3 -m pytest -n 2 --durations=15
echo "== the Triton kernels the tests launched, compiled for sm_90 and sm_80 (no GPU: Triton's LLVM and ptxas)"
env -u TRITON_INTERPRET python3 tools/triton_aot_check.py "$out"/triton_launches/*.json --arch 90 80
# the same records for AMD CDNA3 / CDNA2 (wavefront 64) through Triton's AMD backend: no ROCm, no GPU, never run
echo "== the same Triton kernels compiled for AMD gfx942 and gfx90a"
env -u TRITON_INTERPRET python3 tools/triton_aot_check.py "$out"/triton_launches/*.json --arch gfx942 gfx90a
# The declared ranges, not only the pins: the same checkout in second environments (system site-packages, so torch
# and the editable rlk come along, plus another version of one dependency).
second_env() {  # second_env DIR PIP_REQUIREMENT...
  python3 -m venv --system-site-packages "$1"
  local dir=$1; shift
  "$dir/bin/python" -m pip install -q --disable-pip-version-check "$@"
}
echo "== transformers 4.57.6 (the oldest supported): the Hugging Face paths in a second environment"
second_env "$out/venv-transformers" transformers==4.57.6
# (trl 1.16 does not import beside 4.57's huggingface_hub: its comparison runs in the main environment only)
RLK_REQUIRE_TRL=0 "$out/venv-transformers/bin/python" -m pytest -n 2 packages/rlk/tests/test_hf_compat.py \
  packages/rlk/tests/test_consistency_paths.py packages/rlk/tests/test_consistency_probe.py \
  packages/rlk/tests/test_batch_invariant.py packages/rlk/tests/test_hf_apply.py packages/rlk/tests/test_hf_groups.py \
  packages/rlk/tests/test_multimodal_processor.py packages/rlk/tests/test_multimodal_parity.py \
  packages/rlk/tests/test_multimodal_smoke.py packages/rlk/tests/test_vlm_batch_invariant.py \
  -k "not trl"
echo "== verl 0.9.1: the verl integration against the real verl in a second environment"
bash ci/install_verl_env.sh "$out/venv-verl"
RLK_REQUIRE_VERL=1 "$out/venv-verl/bin/python" -m pytest -n 2 -m verl packages/rlk/tests
# The torch range rlk declares (torch>=2.11), both ends, on the CPU: the oldest with the pinned Triton, the newest with
# the Triton and NumPy it brings. Each is a full CUDA build of torch from PyPI (about 3 GB with its nvidia-* wheels,
# about a minute to install); it runs on the CPU like the CPU build.
echo "== torch 2.11.0 (the oldest supported): rlk's tests (less the fuzz, benchmark and wheel-building files)"
second_env "$out/venv-torch-oldest" torch==2.11.0
"$out/venv-torch-oldest/bin/python" -c 'import torch; assert torch.__version__.startswith("2.11.0"), torch.__version__'
"$out/venv-torch-oldest/bin/python" -m pytest -n 2 packages/rlk/tests --ignore=packages/rlk/tests/test_packaging.py \
  --ignore-glob="packages/rlk/tests/test_fuzz_*.py" --ignore-glob="packages/rlk/tests/test_bench_*.py"
echo "== torch 2.15.0 + triton 3.9.0 + numpy 2.4.6 (the newest): the op layer and the integrations, then the Triton"
echo "   kernels under its interpreter"
# (this machine's pip caps torch at the releases it keeps on disk; the newest comes from the index)
PIP_CONSTRAINT=/dev/null second_env "$out/venv-newest" torch==2.15.0 triton==3.9.0 numpy==2.4.6
"$out/venv-newest/bin/python" -c 'import torch; assert torch.__version__.startswith("2.15.0"), torch.__version__'
# what leans on torch's own APIs: custom ops, fakes and compile, the HF patching, torch.distributed, host syncs
torch_api_tests=(custom_op batch_invariant hf_apply hf_compat hf_groups distributed_ops distributed_chain no_host_sync
  dispatch arguments pack cli)
"$out/venv-newest/bin/python" -m pytest -n 2 $(printf 'packages/rlk/tests/test_%s.py ' "${torch_api_tests[@]}")
rm -rf "$out/triton39_launches"
# Every kernel test file; the two longest sweeps (the policy-loss batch invariance over every loss, the tree
# kernels' shard bits), which repeat kernels the other tests launch, run under the pinned triton only.
RLK_RECORD_TRITON_LAUNCHES="$out/triton39_launches" "$out/venv-newest/bin/python" -m pytest -n 2 \
  packages/rlk-triton/tests -k "not (test_policy_loss_kernels and test_batch_invariance) and not single_device_bits"
echo "== the Triton kernels those tests launched, compiled for sm_90 by triton 3.9.0 (sm_80: the pinned one above)"
env -u TRITON_INTERPRET "$out/venv-newest/bin/python" tools/triton_aot_check.py "$out"/triton39_launches/*.json \
  --arch 90
# The CPU matrix's smoke subset (the pytest run above already checks the matrix per op family); the whole matrix
# (~13 min on 2 cores through the interpreter) runs by hand: `python -m parity --device cpu`, and on GPUs.
echo "== parity (CPU matrix, quick)"; python3 -m parity --device cpu --quick --out "$out/parity"
echo "== benchmarks (quick CPU mode)"; python3 bench_asv/run.py --quick --out "$out/bench"
echo "== asv (quick CPU mode)"
(cd bench_asv && asv machine --yes > /dev/null && asv check --python=same \
  && asv run --python=same --quick --launch-method forkserver --show-stderr)
# --quick saves no results, but it rewrites results/benchmarks.json with the quick mode's parameters: the committed
# one (the H200's, matching bench_asv/results/h200) is put back before the history site is built from the GPU
# results and deployed under the docs site's benchmarks/ (Pages, from main).
git checkout -- bench_asv/results/benchmarks.json
echo "== asv publish (the benchmark history site)"
asv_site=$(realpath -m "$out/site/benchmarks")
(cd bench_asv && asv publish --no-pull -o "$asv_site")
ls "$asv_site"/graphs/branch-main/machine-h200/*/ema.Ema.track_ms.json > /dev/null  # the H200 history is in it
