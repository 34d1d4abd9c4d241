#!/usr/bin/env bash
# A second environment for the Megatron-core integration tests (packages/rlk/tests/test_engine_megatron.py):
# a venv at $1 on top of the system Python's packages (torch, numpy, pytest, transformers come from there) with
# megatron-core and rlk (editable, this checkout). megatron-core needs only torch, numpy and packaging at import;
# its extras (Transformer Engine, Apex, flash-attn) are not used: rlk's layer specs build on its "local" layers.
#   bash ci/install_megatron_env.sh /tmp/venv-megatron
#   RLK_REQUIRE_MEGATRON=1 TRITON_INTERPRET=1 /tmp/venv-megatron/bin/python -m pytest -p no:xdist \
#     -m megatron packages/rlk/tests/test_engine_megatron.py
# Tested: megatron-core 0.16.1 (the newest for Python 3.11; 0.17+ need 3.12) with torch 2.13 CPU.
set -euo pipefail
venv="${1:?usage: ci/install_megatron_env.sh VENV_DIR}"
version="${RLK_MEGATRON_CORE_VERSION:-0.16.1}"
root="$(cd "$(dirname "$0")/.." && pwd)"
python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "megatron-core==$version"
# rlk from this checkout; the venv's own pip/setuptools may be older than what rlk's pyproject needs, so the
# system ones build it (the venv sees them through --system-site-packages)
"$venv/bin/python" -m pip uninstall -q -y setuptools >/dev/null 2>&1 || true
for pkg in rlk rlk-triton rlk-domestic; do
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$root/packages/$pkg"
done
"$venv/bin/python" - <<'PY'
import importlib.metadata as md

import megatron.core.parallel_state  # noqa: F401
import rlk

print("megatron-core", md.version("megatron-core"), "torch", md.version("torch"), "rlk", rlk.__file__)
PY
