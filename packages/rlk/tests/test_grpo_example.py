"""``examples/grpo.py``, the end-to-end GRPO loop: a few steps run, and with rlk's chain on the first micro-step's
importance ratio is exactly 1 for every token (the rollout's log-probs equal training's bit for bit); on a GPU,
with stock kernels in bf16, it is not.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).parents[3] / "examples" / "grpo.py"
SMALL = ["--prompts", "2", "--group", "2", "--prompt-len", "3", "--max-new-tokens", "3"]


def _example():
    spec = importlib.util.spec_from_file_location("grpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _transformers():
    if os.environ.get("RLK_REQUIRE_TRANSFORMERS") == "1":
        import transformers  # noqa: F401
        return
    pytest.importorskip("transformers")


def test_the_verifier_and_the_prompts():
    grpo = _example()
    assert grpo.verify([5, 1], [2, 3, 4, 6]) == 0.75
    gen = torch.Generator().manual_seed(0)
    prompts = grpo.make_prompts(5, 4, 100, gen)
    assert len(prompts) == 5 and all(2 <= len(p) <= 4 and all(1 <= t < 100 for t in p) for p in prompts)


@pytest.mark.triton_interpreter
def test_rlk_on_the_first_micro_step_ratio_is_exactly_one(tmp_path):
    _transformers()
    grpo = _example()
    log = grpo.main([*SMALL, "--steps", "2", "--device", "cpu", "--out", str(tmp_path)])
    assert [r["step"] for r in log] == [0, 1]
    for record in log:
        assert record["max_abs_delta"] == 0.0 and record["ratio_exactly_1"], record
        assert 0.0 <= record["reward"] <= 1.0 and record["step_s"] > 0 and record["peak_mib"] > 0
    written = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert written == log


def test_stock_runs_the_same_loop():
    _transformers()
    log = _example().main([*SMALL, "--steps", "2", "--device", "cpu", "--stock"])
    assert len(log) == 2 and all(0.0 <= r["reward"] <= 1.0 for r in log)


@pytest.mark.gpu
def test_on_the_gpu_rlk_gives_ratio_one_and_stock_bf16_does_not():
    _transformers()
    grpo = _example()
    args = ["--steps", "1", "--device", "cuda", "--dtype", "bfloat16", "--model", "qwen3-8b-shape", "--layers", "2",
            "--prompts", "8", "--group", "8", "--max-new-tokens", "16", "--prompt-len", "32"]
    on = grpo.main(args)
    stock = grpo.main([*args, "--stock"])
    assert on[0]["max_abs_delta"] == 0.0
    assert stock[0]["max_abs_delta"] > 0.0
