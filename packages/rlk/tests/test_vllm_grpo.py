"""``examples/grpo_vllm.py`` on the CPU: a few GRPO steps rolled out by vLLM + the rlk plugin, weights synced back;
the first micro-step's importance ratio is exactly 1 on every step with rlk on, and not with ``--stock``."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.triton_interpreter, pytest.mark.slow]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo_vllm.py"


def _example():
    spec = importlib.util.spec_from_file_location("grpo_vllm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_vllm_ratio_exactly_one(tmp_path):
    log = _example().main(["--steps", "2", "--out", str(tmp_path)])
    assert len(log) == 2
    assert all(r["ratio_exactly_1"] and r["max_abs_delta"] == 0.0 for r in log)
    assert all("bitwise" in r["weight_sync"] for r in log)
    assert (tmp_path / "log.jsonl").read_text().count("\n") == 2


def test_grpo_vllm_stock_drifts():
    log = _example().main(["--steps", "1", "--stock"])
    assert log[0]["max_abs_delta"] > 0.0
