"""Repository-wide pytest setup.

Tests marked ``gpu`` are deselected (reported as deselected, never silently
passed) when torch sees no GPU. ``RLK_REQUIRE_GPU=1`` turns a missing GPU into
an error, so a GPU run can't quietly turn into a CPU run. Tests marked
``triton_interpreter`` are deselected unless ``TRITON_INTERPRET=1`` (CI sets it). ``multi_gpu``
tests are deselected on machines with fewer than two GPUs, ``no_gpu`` tests (behaviour without a
GPU) on machines with one.
"""

from __future__ import annotations

import os

import pytest
import torch


def _deselect(config, items, marker: str) -> None:
    chosen = [item for item in items if item.get_closest_marker(marker)]
    if chosen:
        config.hook.pytest_deselected(items=chosen)
        items[:] = [item for item in items if not item.get_closest_marker(marker)]


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        _deselect(config, items, "triton_interpreter")
    if torch.cuda.device_count() < 2:
        _deselect(config, items, "multi_gpu")
    if torch.cuda.is_available():
        _deselect(config, items, "no_gpu")
        return
    if os.environ.get("RLK_REQUIRE_GPU") == "1":
        raise pytest.UsageError("RLK_REQUIRE_GPU=1 but torch sees no GPU")
    _deselect(config, items, "gpu")
