#!/usr/bin/env bash
# A second environment for the verl integration tests (packages/rlk/tests/test_verl_integration.py):
# a venv at $1 on top of the system Python's packages (torch, numpy, pytest, transformers come from there),
# with verl 0.9.1 and only what `import verl.trainer.ppo.core_algos` needs on the CPU, each pinned, no dependencies
# resolved (verl's own requirements pull in vLLM-era pins, wandb, ...: none of it is needed for its loss code).
#   bash ci/install_verl_env.sh /work/venvs/verl
#   RLK_REQUIRE_VERL=1 PYTHONPATH=packages/rlk/src:packages/rlk-triton/src \
#     /work/venvs/verl/bin/python -m pytest packages/rlk/tests/test_verl_integration.py
set -euo pipefail
venv="${1:?usage: ci/install_verl_env.sh VENV_DIR}"
python3 -m venv --system-site-packages "$venv"
# ray: verl.protocol imports it (msgpack, protobuf: ray's import-time needs); tensordict (pyvers: its need);
# omegaconf 2.4 (2.3 pins an older antlr4 runtime than the system's); codetiming: verl.utils.profiler.
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
  verl==0.9.1 ray==2.60.0 msgpack==1.2.4 protobuf==7.36.2 tensordict==0.10.0 pyvers==0.2.3 omegaconf==2.4.0 \
  codetiming==1.4.0
"$venv/bin/python" -c "import verl, verl.trainer.ppo.core_algos; print('verl', verl.__version__, 'ok')"
