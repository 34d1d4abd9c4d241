"""``rlk multimodal-smoke`` (issue 21 item 7): the image-text GRPO step passes every stage on the CPU (and on a GPU,
marker ``gpu``), a broken stage fails the command, bad arguments are refused. Runs under transformers 5.x and 4.57
(CI runs this file under both)."""

from __future__ import annotations

import json

import pytest
import torch

import rlk
from rlk.app import cli
from rlk.app.multimodal_smoke import smoke

STAGES = ["layout parity", "modality-aware log-probs", "loss masking", "one loss step"]


def _names(report) -> list[str]:
    return [s["stage"].split(" (")[0] for s in report.stages]


def test_every_stage_passes_on_the_cpu():
    report = smoke(prompts=2, group_size=3, seed=1, device="cpu")
    assert _names(report) == STAGES
    assert report.passed, report.format()
    figures = report.stages[1]["figures"]
    assert figures["visual tokens"] > figures["scored positions"] > 0


def test_the_command_prints_json_and_exits_0(capsys):
    assert cli.main(["multimodal-smoke", "--prompts", "1", "--group-size", "2", "--json", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] and [s["stage"].split(" (")[0] for s in out["stages"]] == STAGES


def test_a_log_prob_path_that_ignores_the_spans_fails(monkeypatch, capsys):
    """Negative control: scoring every position (the spans dropped) is caught at stage 2 and the command exits 1."""
    plain = rlk.linear_logprob

    def unmasked(hidden, weight, targets, **kw):
        kw.pop("loss_spans", None)
        return plain(hidden, weight, targets, **kw)

    monkeypatch.setattr(rlk, "linear_logprob", unmasked)
    assert cli.main(["multimodal-smoke", "--prompts", "1", "--group-size", "2", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  modality-aware log-probs" in out and "BAD 0 on every position predicting a visual token" in out
    assert "one loss step" not in out and out.rstrip().endswith("FAILED")


@pytest.mark.parametrize("argv", [["--prompts", "0"], ["--group-size", "1"]])
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["multimodal-smoke", *argv])
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.gpu
def test_every_stage_passes_on_the_gpu():
    report = smoke(prompts=4, group_size=8, seed=0, device="cuda")
    assert report.passed, report.format()
    assert torch.cuda.is_available()
