"""``rlk consistency --rollout vllm`` (a real vLLM engine, stock and with the rlk plugin, scored by transformers) and
its prechecks: the clean run passes with every rlk log-prob bitwise equal; a planted mismatch (the trainer's padding
on the other side of its mask, one weight moved by one ulp) is caught and fails the run (exit code 1)."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.triton_interpreter]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ARGS = [
    "consistency",
    "--rollout",
    "vllm",
    "--model",
    "tiny",
    "--prompts",
    "4",
    "--max-new-tokens",
    "4",
    "--no-progress",
]


def _run(tmp_path, *extra):
    from rlk.app.cli import main

    code = main([*ARGS, "--out", str(tmp_path), *extra])
    return code, json.loads((tmp_path / "report.json").read_text())


def test_cli_vllm_rollout_bitwise(tmp_path):
    code, report = _run(tmp_path)
    assert code == 0, report["failed"]
    rlk_vs_rlk = report["chains"]["rlk"]["trainer"]["rlk"]
    assert rlk_vs_rlk["rollout"]["all_equal"] and rlk_vs_rlk["rollout"]["tokens"] == 16
    assert rlk_vs_rlk["prompt"]["all_equal"] and rlk_vs_rlk["prompt"]["max_abs"] == 0.0
    assert all(check["ok"] for check in report["prechecks"]["rlk"].values())
    assert report["prechecks"]["rlk"]["weights"]["equal"] > 0
    # negative control: the stock engine is not the rlk trainer bit for bit, and the rlk engine not the stock one
    assert not report["chains"]["stock"]["trainer"]["rlk"]["prompt"]["all_equal"]
    assert not report["chains"]["rlk"]["trainer"]["stock"]["prompt"]["all_equal"]
    assert report["settings"]["prompt_tokens"] > report["settings"]["max_num_batched_tokens"]  # chunked prefill


@pytest.mark.slow
@pytest.mark.parametrize("plant, failing", [("padding-side", "inputs"), ("weight", "weights")])
def test_cli_vllm_planted_mismatch_is_caught(tmp_path, plant, failing):
    code, report = _run(tmp_path, "--plant", plant)
    assert code == 1
    assert "prechecks" in report["failed"]
    assert not report["prechecks"]["rlk"][failing]["ok"]
    if plant == "weight":
        assert report["prechecks"]["rlk"]["weights"]["different"] == ["model.norm.weight"]


def test_cli_vllm_rollout_arguments():
    from rlk.app.cli import main

    with pytest.raises(SystemExit) as info:
        main(["consistency", "--rollout", "vllm", "--dtype", "bfloat16"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        main(["consistency", "--plant", "weight"])  # --plant needs --rollout vllm


def test_check_inputs_catches_padding_side():
    from rlk.integrations.vllm import training

    prompts, responses = [[5, 6, 7], [8, 9]], [[1, 2], [3]]
    good = training.padded_batch(prompts, responses, padding_side="left")
    assert training.check_inputs(good, prompts, responses)["ok"]
    bad = training.padded_batch(prompts, responses, padding_side="left", mask_side="right")
    result = training.check_inputs(bad, prompts, responses)
    assert not result["ok"] and result["first_bad_row"] == 1  # row 0 has no padding


def test_weight_mapping_and_checksums():
    from rlk.app.consistency.vllm_rollout import build_model
    from rlk.integrations.vllm import weights

    model = build_model("tiny", dtype=torch.float32, seed=0)
    state = weights.vllm_state_dict(model.state_dict())
    qkv = state["model.layers.0.self_attn.qkv_proj.weight"]
    attn = model.model.layers[0].self_attn
    assert torch.equal(qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    sums = weights.weight_checksums(state)
    assert weights.compare_checksums(sums, dict(sums))["ok"]
    moved = dict(state)
    moved["model.norm.weight"] = moved["model.norm.weight"].clone()
    moved["model.norm.weight"][3] += 1e-3
    result = weights.compare_checksums(sums, weights.weight_checksums(moved))
    assert not result["ok"] and result["different"] == ["model.norm.weight"]
