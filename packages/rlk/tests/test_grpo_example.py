"""``examples/grpo.py``, the end-to-end GRPO loop: a few steps run, and with rlk's chain on the first micro-step's
importance ratio is exactly 1 for every token (the rollout's log-probs equal training's, which come from
``rlk.integrations.hf.group_logprobs`` once per micro-batch of whole groups, bit for bit); on a GPU, with stock
kernels in bf16, it is not.
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


def test_micro_batches_are_runs_of_whole_groups():
    grpo = _example()
    assert grpo.group_micro_batches(4, 2) == [range(0, 2), range(2, 4)]
    assert grpo.group_micro_batches(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert grpo.group_micro_batches(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert grpo.group_micro_batches(7, 1) == [range(0, 7)]


@pytest.mark.parametrize("value", ["3", "0"])
def test_micro_batches_outside_one_to_the_groups_is_an_error_naming_the_argument(value, capsys):
    with pytest.raises(SystemExit) as exc:
        _example().main([*SMALL, "--steps", "1", "--device", "cpu", "--stock", "--micro-batches", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--micro-batches" in err and f"{value} is not in 1..2" in err and "--prompts" in err


def _count_group_logprobs(monkeypatch):
    """Wrap ``rlk.integrations.hf.group_logprobs`` (the example looks it up per call): one ``(prompts,
    [len(responses[g]) ...], [len(response) ...])`` entry per call."""
    import rlk.integrations.hf as hf

    calls, real = [], hf.group_logprobs

    def counted(model, prompts, responses, **kwargs):
        calls.append(([list(p) for p in prompts], [len(r) for r in responses], [len(x) for r in responses for x in r]))
        return real(model, prompts, responses, **kwargs)

    monkeypatch.setattr(hf, "group_logprobs", counted)
    return calls


@pytest.mark.triton_interpreter
def test_rlk_on_the_first_micro_step_ratio_is_exactly_one(tmp_path, monkeypatch):
    _transformers()
    grpo = _example()
    calls = _count_group_logprobs(monkeypatch)

    def no_padded_batch(*args):
        raise AssertionError("the rlk path built a right-padded training batch")

    monkeypatch.setattr(grpo, "training_batch", no_padded_batch)
    seen_prompts = []
    real_rollout = grpo.rollout
    monkeypatch.setattr(
        grpo,
        "rollout",
        lambda model, prompts, *a, **k: seen_prompts.append(prompts) or real_rollout(model, prompts, *a, **k),
    )
    # one layer of the tiny model (its second runs the same ops again under the interpreter)
    log = grpo.main([*SMALL, "--layers", "1", "--steps", "2", "--device", "cpu", "--out", str(tmp_path)])
    assert [r["step"] for r in log] == [0, 1]
    # training went through group_logprobs: 2 steps x 2 micro-batches, each one group (prompt once) of 2 responses
    # of 3 tokens; never through the right-padded batch
    assert len(calls) == 4
    for k, (prompts, members, lengths) in enumerate(calls):
        step, micro = divmod(k, 2)
        assert prompts == [seen_prompts[step][2 * micro]] and members == [2] and lengths == [3, 3], calls
    for record in log:
        assert record["max_abs_delta"] == 0.0 and record["ratio_exactly_1"], record
        assert 0.0 <= record["reward"] <= 1.0 and record["step_s"] > 0 and record["peak_mib"] > 0
    written = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert written == log


def test_stock_runs_the_same_loop(monkeypatch):
    _transformers()
    grpo = _example()
    calls = _count_group_logprobs(monkeypatch)
    rows = []
    real = grpo.training_batch
    monkeypatch.setattr(
        grpo,
        "training_batch",
        lambda prompts, responses, r, device: rows.append(list(r)) or real(prompts, responses, r, device),
    )
    log = grpo.main([*SMALL, "--steps", "2", "--device", "cpu", "--stock"])
    assert len(log) == 2 and all(0.0 <= r["reward"] <= 1.0 for r in log)
    # right-padded micro-batches of whole groups (2 groups of 2 over 2 micro-batches), no group_logprobs
    assert rows == [[0, 1], [2, 3]] * 2 and not calls


@pytest.mark.gpu
def test_on_the_gpu_rlk_gives_ratio_one_and_stock_bf16_does_not():
    _transformers()
    grpo = _example()
    args = [
        "--steps",
        "1",
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--model",
        "qwen3-8b-shape",
        "--layers",
        "2",
        "--prompts",
        "8",
        "--group",
        "8",
        "--max-new-tokens",
        "16",
        "--prompt-len",
        "32",
    ]
    on = grpo.main(args)
    stock = grpo.main([*args, "--stock"])
    assert on[0]["max_abs_delta"] == 0.0
    assert stock[0]["max_abs_delta"] > 0.0
