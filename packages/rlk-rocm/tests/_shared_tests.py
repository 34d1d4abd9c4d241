"""Loads one of rlk-cuda's GPU test files for the rocm backend: the test bodies live once, in
packages/rlk-cuda/tests, and read the module-level ``BACKEND`` set here before the file runs. These tests
are monorepo-only (neither sdist ships them), so the file is found next to this package's.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

CUDA_TESTS = Path(__file__).resolve().parents[2] / "rlk-cuda" / "tests"


def load_cuda_tests(stem: str, backend: str = "rocm") -> ModuleType:
    """``packages/rlk-cuda/tests/<stem>.py`` run with ``BACKEND = backend``, under a name of its own (so it never
    clashes with the module pytest imports from that file)."""
    name = f"_rlk_{backend}_shared_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, CUDA_TESTS / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    module.BACKEND = backend
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
