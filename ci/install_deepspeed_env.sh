#!/usr/bin/env bash
# A second environment for the DeepSpeed ZeRO-3 tests (packages/rlk/tests/test_engine_deepspeed.py): a venv at $1 on
# top of the system Python's packages (torch, numpy, pydantic, psutil, transformers come from there), with
# deepspeed 0.19.8 built from its sdist without its C++/CUDA ops (DS_BUILD_OPS=0: ZeRO-3 on the CPU needs none; the
# optimizer is torch's Adam) and the few modules its import needs, each pinned, no dependencies resolved. rlk,
# rlk-triton and rlk-domestic are installed editable from this checkout, so the venv tests the tree it sits beside.
#   bash ci/install_deepspeed_env.sh /tmp/venv-ds
#   DS_ACCELERATOR=cpu TRITON_INTERPRET=1 RLK_REQUIRE_DEEPSPEED=1 \
#     /tmp/venv-ds/bin/python -m pytest -p no:xdist packages/rlk/tests/test_engine_deepspeed.py
set -euo pipefail
venv="${1:?usage: ci/install_deepspeed_env.sh VENV_DIR}"
root="$(cd "$(dirname "$0")/.." && pwd)"
python3 -m venv --system-site-packages "$venv"
# The venv's own pip and setuptools are older than the system's; without them the system ones (which read rlk's
# pyproject) are used.
"$venv/bin/python" -m pip uninstall -q -y pip setuptools 2>/dev/null || true
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps)
# hjson, msgpack, ninja, py-cpuinfo, einops: what `import deepspeed` and its ZeRO-3 engine import.
"${pip[@]}" hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 py-cpuinfo==9.0.0 einops==0.8.2
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "${pip[@]}" --no-build-isolation deepspeed==0.19.8
"${pip[@]}" --no-build-isolation -e "$root/packages/rlk" -e "$root/packages/rlk-triton" -e "$root/packages/rlk-domestic"
DS_ACCELERATOR=cpu "$venv/bin/python" -c "
import deepspeed, rlk
print('deepspeed', deepspeed.__version__, 'rlk from', rlk.__file__)"
