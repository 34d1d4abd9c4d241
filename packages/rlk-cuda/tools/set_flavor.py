"""Set the CUDA flavour of the rlk-cuda distribution: rewrite ``name = "rlk-cudaNN"`` in pyproject.toml.

Usage::

    python packages/rlk-cuda/tools/set_flavor.py cuda12 | cuda13 | auto

``auto`` takes the major version of the ``nvcc`` on PATH (or ``$CUDACXX``). Registries refuse local
version tags (``+cu128``), so the flavour lives in the name; both distributions import ``rlk_cuda``.
The build (CMakeLists.txt) refuses a name that does not match the toolkit, so a wrong flavour fails
loudly instead of producing a mislabelled wheel. Prints the name it set.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
NAME_LINE = re.compile(r'^name = "rlk-cuda\d*"$', re.MULTILINE)


def nvcc_major() -> str:
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
    if not nvcc:
        sys.exit("set_flavor: no nvcc on PATH (and CUDACXX unset): pass cuda12 or cuda13")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release (\d+)\.", out)
    if not match:
        sys.exit(f"set_flavor: cannot read the CUDA version from `{nvcc} --version`")
    return match.group(1)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not re.fullmatch(r"cuda\d+|auto", argv[0]):
        sys.exit(__doc__)
    major = nvcc_major() if argv[0] == "auto" else argv[0].removeprefix("cuda")
    name = f"rlk-cuda{major}"
    text = PYPROJECT.read_text()
    if len(NAME_LINE.findall(text)) != 1:
        sys.exit(f'set_flavor: expected exactly one line `name = "rlk-cudaNN"` in {PYPROJECT}')
    PYPROJECT.write_text(NAME_LINE.sub(f'name = "{name}"', text))
    print(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
