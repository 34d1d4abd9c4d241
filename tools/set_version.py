"""Write the release version (``VERSION`` at the repository root, the single source) into every place a package
states it: the pyprojects (their version, rlk's backend extras' pins, the backends' rlk pin) and the
``__version__`` of rlk, rlk_triton, rlk_cuda, rlk_rocm and rlk_domestic. ``tests/test_packaging.py`` checks that
they agree.

    python tools/set_version.py 0.2.0     # sets VERSION, then writes it everywhere
    python tools/set_version.py           # writes VERSION's version everywhere
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECTS = [
    "packages/rlk/pyproject.toml",
    "packages/rlk-triton/pyproject.toml",
    "packages/rlk-cuda/pyproject.toml",
    "packages/rlk-rocm/pyproject.toml",
    "packages/rlk-domestic/pyproject.toml",
]
VERSION_MODULES = [
    "packages/rlk/src/rlk/core/version.py",
    "packages/rlk-triton/src/rlk_triton/__init__.py",
    "packages/rlk-cuda/src/rlk_cuda/__init__.py",
    "packages/rlk-rocm/src/rlk_rocm/__init__.py",
    "packages/rlk-domestic/src/rlk_domestic/__init__.py",
]


def write(version: str) -> list[str]:
    if not re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?", version):
        raise SystemExit(f"version: expected X.Y.Z (optionally aN / bN / rcN), got {version!r}")
    changed = []
    for rel in PYPROJECTS:
        path = ROOT / rel
        text = path.read_text()
        new = re.sub(r'^version = "[^"]+"', f'version = "{version}"', text, count=1, flags=re.M)
        new = re.sub(r'"(rlk(?:-triton|-cuda12|-cuda13|-rocm6|-domestic)?)==[^"]+"', rf'"\1=={version}"', new)
        if new != text:
            path.write_text(new)
            changed.append(rel)
    for rel in VERSION_MODULES:
        path = ROOT / rel
        text = path.read_text()
        new = re.sub(r'^__version__ = "[^"]+"', f'__version__ = "{version}"', text, count=1, flags=re.M)
        if new != text:
            path.write_text(new)
            changed.append(rel)
    return changed


def main(argv: list[str]) -> int:
    if argv:
        (ROOT / "VERSION").write_text(argv[0] + "\n")
    version = (ROOT / "VERSION").read_text().strip()
    for rel in write(version):
        print("wrote", rel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
