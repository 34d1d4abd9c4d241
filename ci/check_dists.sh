#!/usr/bin/env bash
# Check built distributions before they are published (the release workflow; by hand: after building them).
#
#   bash ci/check_dists.sh DIST_DIR
#
# DIST_DIR holds the wheels and sdists of rlk, rlk-triton, rlk-domestic and rlk-cuda12 / rlk-cuda13 (any subset with rlk).
# 1. `twine check --strict` on every file (metadata a registry accepts, the README renders);
# 2. a fresh virtual environment (no system site-packages) gets the CPU torch of ci/requirements-dev.txt and the
#    built wheels, not editable, from DIST_DIR only (no index for rlk's own packages);
# 3. from outside the checkout (so nothing imports from the source tree): `rlk --version`, `rlk info` (every backend
#    wheel installed is listed; without a GPU the native one as unavailable with its reason), `rlk demo
#    --skip-consistency` (linear_logprob's memory showcase on the CPU).
set -euo pipefail
dist=$(cd "${1:?usage: bash ci/check_dists.sh DIST_DIR}" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
python3 -m pip install -q --disable-pip-version-check "twine>=6.1"
echo "== twine check"
python3 -m twine check --strict "$dist"/*
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
torch_pin=$(grep -E '^torch==' "$root/ci/requirements-dev.txt")
echo "== fresh venv: $torch_pin (CPU), then the wheels of $dist"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$torch_pin" \
  --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
wheels=("$dist"/*.whl)
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-index --find-links "$dist" --no-deps "${wheels[@]}"
"$venv/bin/python" -m pip check
cd "$(mktemp -d)"
echo "== rlk --version"; "$venv/bin/rlk" --version
version=$("$venv/bin/python" -c 'import rlk, sys; sys.stdout.write(rlk.__version__)')
"$venv/bin/python" - "$version" <<'PY'
import sys
from importlib import metadata
import rlk
assert "site-packages" in rlk.__file__, f"rlk imported from {rlk.__file__}, not from the installed wheel"
for dist in metadata.distributions():
    name = dist.metadata["Name"]
    if name.startswith("rlk"):
        assert dist.version == sys.argv[1], (name, dist.version)
        assert dist.read_text("direct_url.json") is None or '"editable": true' not in dist.read_text("direct_url.json")
        print(f"installed {name} {dist.version} (not editable)")
PY
echo "== rlk info"; "$venv/bin/rlk" info | tee info.txt
for whl in "${wheels[@]}"; do
  case $(basename "$whl") in
    rlk_triton-*) grep -qE '^  triton ' info.txt || { echo "FAIL: rlk info lists no backend triton" >&2; exit 1; } ;;
    rlk_domestic-*) grep -qE '^  domestic ' info.txt || { echo "FAIL: rlk info lists no backend domestic" >&2; exit 1; } ;;
    rlk_cuda1*) grep -qE '^  cuda ' info.txt || { echo "FAIL: rlk info lists no backend cuda" >&2; exit 1; } ;;
  esac
done
echo "== rlk demo --skip-consistency"; "$venv/bin/rlk" demo --device cpu --skip-consistency
echo "ok: $(ls "$dist" | wc -l) files checked"
