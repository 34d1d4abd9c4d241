"""Repository-wide pytest setup.

Tests marked ``gpu`` are deselected (reported as deselected, never silently
passed) when torch sees no GPU. ``RLK_REQUIRE_GPU=1`` turns a missing GPU into
an error, so a GPU run can't quietly turn into a CPU run.
"""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    if os.environ.get("RLK_REQUIRE_GPU") == "1":
        raise pytest.UsageError("RLK_REQUIRE_GPU=1 but torch sees no GPU")
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
