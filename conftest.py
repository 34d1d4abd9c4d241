"""Repository-wide pytest setup.

Tests marked ``gpu`` are deselected (reported as deselected, never silently
passed) when torch sees no GPU. ``RLK_REQUIRE_GPU=1`` turns a missing GPU into
an error, so a GPU run can't quietly turn into a CPU run. Tests marked
``triton_interpreter`` are deselected unless ``TRITON_INTERPRET=1`` (CI sets it). ``multi_gpu``
tests are deselected on machines with fewer than two GPUs, ``no_gpu`` tests (behaviour without a
GPU) on machines with one, ``rocm`` tests on any torch that is not a ROCm build. The engine markers (``verl``,
``vllm``, ``deepspeed``, ``megatron``: integrations tested against the real package, each in the environment its
``ci/install_*_env.sh`` script builds) are deselected where the engine cannot be imported; ``RLK_REQUIRE_<NAME>=1``
(``RLK_REQUIRE_VERL=1``, ...) turns that into an error. ``native`` tests (rlk-cuda and rlk-rocm installed, without their
hardware) are deselected where either is not installed, an error where ``RLK_REQUIRE_INSTALLED`` names them.

``RLK_RECORD_TRITON_LAUNCHES=<dir>`` (with ``TRITON_INTERPRET=1``) records the Triton kernel
specializations the session launches into ``<dir>/launches-<worker>.json``, for
``tools/triton_aot_check.py`` to compile them for a GPU target without a GPU (``ci/test.sh``).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch


def _deselect(config, items, marker: str) -> None:
    chosen = [item for item in items if item.get_closest_marker(marker)]
    if chosen:
        config.hook.pytest_deselected(items=chosen)
        items[:] = [item for item in items if not item.get_closest_marker(marker)]


# marker: (the module its tests need, the script that builds its environment)
ENGINES = {
    "verl": ("verl.trainer.ppo.core_algos", "ci/install_verl_env.sh"),
    "vllm": ("vllm", "ci/install_vllm_env.sh"),
    "deepspeed": ("deepspeed", "ci/install_deepspeed_env.sh"),
    "megatron": ("megatron.core", "ci/install_megatron_env.sh"),
}


def _import_error(module: str) -> str | None:
    """Why ``module`` cannot be imported, or None (imported only when tests carrying its marker are collected)."""
    try:
        importlib.import_module(module)
    except Exception as err:  # an engine may fail to import with other errors than ImportError (a CUDA-only build)
        return f"{type(err).__name__}: {err}"
    return None


def _native_missing() -> list[str]:
    """The native backends (rlk-cuda, rlk-rocm) that are not installed."""
    return [name for name in ("rlk_cuda", "rlk_rocm") if importlib.util.find_spec(name) is None]


def pytest_collection_modifyitems(config, items):
    if any(item.get_closest_marker("native") for item in items) and _native_missing():
        required = {b for b in os.environ.get("RLK_REQUIRE_INSTALLED", "").split(",") if b}
        if required & {"cuda", "rocm"}:
            raise pytest.UsageError(f"RLK_REQUIRE_INSTALLED={sorted(required)} but not installed: {_native_missing()}")
        _deselect(config, items, "native")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        _deselect(config, items, "triton_interpreter")
    for marker, (module, script) in ENGINES.items():
        if not any(item.get_closest_marker(marker) for item in items):
            continue
        missing = _import_error(module)
        if missing is not None:
            require = f"RLK_REQUIRE_{marker.upper()}"
            if os.environ.get(require) == "1":
                raise pytest.UsageError(
                    f"{require}=1 but {module} cannot be imported ({missing}); set up its environment with {script}"
                )
            _deselect(config, items, marker)
    if torch.version.hip is None:
        _deselect(config, items, "rocm")
    if torch.cuda.device_count() < 2:
        _deselect(config, items, "multi_gpu")
    if torch.cuda.is_available():
        _deselect(config, items, "no_gpu")
        return
    if os.environ.get("RLK_REQUIRE_GPU") == "1":
        raise pytest.UsageError("RLK_REQUIRE_GPU=1 but torch sees no GPU")
    _deselect(config, items, "gpu")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_configure(config):
    if not os.environ.get("RLK_RECORD_TRITON_LAUNCHES") or not _interpreting():
        return
    spec = importlib.util.spec_from_file_location(
        "triton_aot_check", Path(__file__).parent / "tools" / "triton_aot_check.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    records: list[dict] = []
    recorder = tool.record_launches(records)
    recorder.__enter__()
    config._rlk_triton_launches = (tool, recorder, records)


def pytest_unconfigure(config):
    state = getattr(config, "_rlk_triton_launches", None)
    if state is None:
        return
    tool, recorder, records = state
    recorder.__exit__(None, None, None)
    out = Path(os.environ["RLK_RECORD_TRITON_LAUNCHES"])
    out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (out / f"launches-{worker}-{os.getpid()}.json").write_text(json.dumps(tool.unique(records), default=float))
