#!/usr/bin/env bash
# Set up a development environment on a fresh machine: tools, then rlk and rlk-triton (editable).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check -r ci/requirements-dev.txt
python3 -m pip install -q --disable-pip-version-check --no-build-isolation \
  -e packages/rlk -e packages/rlk-triton -e packages/rlk-domestic
