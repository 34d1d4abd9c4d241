"""``rlk consistency`` reporting: the table, JSON, HTML and PNG from a synthetic report dict (fast, no model),
the verdict logic, and one end-to-end run on the tiny model under the Triton interpreter."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import xml.etree.ElementTree as ET

import pytest
import torch

from rlk.app.consistency import report as rep
from rlk.app.consistency import run


def _chain(drift: float, layers: int = 3, n: int = 3) -> dict:
    """One chain's part of a report; ``drift`` 0 means bitwise equal everywhere."""
    equal = drift == 0
    per_layer = [
        {
            "layer": i,
            "max_abs": drift * (i + 1),
            "mean_abs": drift * (i + 1) / 10,
            "first_op": None if equal else "q_proj",
            "equal": equal,
            "out_max_abs": drift,
            "out_mean_abs": drift / 10,
        }
        for i in range(layers)
    ]
    agg = {
        "tokens": 12,
        "equal_tokens": 12 if equal else 5,
        "equal_sequences": n if equal else 1,
        "sequences": n,
        "max_abs": drift,
        "mean_abs": drift / 3,
        "bitwise": equal,
    }
    grads = {
        "equal_sequences": n if equal else 0,
        "sequences": n,
        "max_abs": drift * 4,
        "max_rel_l2": drift,
        "bitwise": equal,
    }
    seqs = [
        {
            "index": i,
            "prompt_len": 5 + i,
            "response_len": 4,
            "rollout_vs_training_max_abs": drift,
            "rollout_vs_training_equal": equal,
            "rollout_vs_training_equal_tokens": 4 if equal else 2,
            "split_a_vs_b_max_abs": drift,
            "split_a_vs_b_equal": equal,
            "grad_equal": equal,
            "grad_max_abs": drift * 4,
            "grad_rel_l2": drift,
            "rollout_vs_reference_max_abs": 1e-6,
            "training_vs_reference_max_abs": 1e-6,
        }
        for i in range(n)
    ]
    return {
        "enabled": equal,
        "responses": [[1, 2, 3, 4]] * n,
        "response_lengths": [4] * n,
        "rollout_vs_training": agg,
        "split_a_vs_b": dict(agg),
        "gradients": grads,
        "probe": {
            "first_divergent": None if equal else [0, "q_proj"],
            "per_layer": per_layer,
            "per_op": {},
            "tokens": 20,
            "ops": [],
        },
        "timings": {
            "rollout_s": 0.5,
            "rollout_tokens": 30,
            "rollout_tokens_per_s": 50.0 if equal else 60.0,
            "training_forward_s": 0.1,
            "training_tokens": 33,
            "training_tokens_per_s": 330.0,
        },
        "rlk_calls": 100 if equal else 0,
        "sequences": seqs,
    }


def synthetic_report(on_drift: float = 0.0, off_drift: float = 3e-7, device: str = "cpu") -> dict:
    off, on = _chain(off_drift), _chain(on_drift)
    contract = {
        "op": "selected_logprob",
        "dtype": "float32",
        "atol": 2e-5,
        "rtol": 2e-6,
        "scale": "1 + |ref|",
        "judged": True,
        "ok": True,
        "paths": {
            f"{c}.{p}": {"worst": 1e-6, "allowed": 2e-5, "ratio": 0.05, "ok": True, "max_abs": 1e-6, "mean_abs": 1e-7}
            for c in ("off", "on")
            for p in ("rollout", "training")
        },
    }
    dev = torch.device(device)
    verdicts = run._verdicts(off, on, contract, dev)
    failed = [v["name"] for v in verdicts if v["gates_exit"] and v["status"] == "fail"]
    d_off = torch.tensor([0.0] * 5 + [off_drift] * 7, dtype=torch.float64)
    d_on = torch.tensor([0.0] * 7 + [on_drift] * 5, dtype=torch.float64)
    return {
        "report": "rlk consistency",
        "schema": 1,
        "created": "2026-01-01T00:00:00+00:00",
        "model": {
            "name": "tiny",
            "class": "Qwen3ForCausalLM",
            "model_type": "qwen3",
            "parameters": 123456,
            "config": {"hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 512},
        },
        "device": {"device": device, "name": "test", "chain_backend": "test"},
        "dtype": "float32",
        "versions": {"torch": torch.__version__, "rlk": "0"},
        "seeds": {"weights": 0, "prompts": 0, "sampling": 0},
        "settings": {
            "prompts": 3,
            "max_new_tokens": 4,
            "prefill_chunk": 8,
            "temperature": 1.0,
            "scoring": "t=1",
            "split_a": run.SPLIT_A_NAME,
            "split_b": run.SPLIT_B_NAME,
            "split_b_micro_batches": [[0], [1, 2]],
        },
        "prompt_lengths": [5, 6, 7],
        "reference": {"dtype": "float64", "how": "alone"},
        "contract": contract,
        "histogram": {
            "what": "|rollout lp - training lp|",
            "edges": [None if math.isinf(e) else e for e in run.HIST_EDGES],
            "labels": run.histogram_labels(),
            "off": run.histogram(d_off),
            "on": run.histogram(d_on),
        },
        "chains": {"off": off, "on": on},
        "throughput": run._throughput({"off": off, "on": on}),
        "verdicts": verdicts,
        "failed": failed,
        "passed": not failed,
        "seconds": 1.0,
        "notes": ["a note with <html> & characters"],
    }


def test_histogram_bins_zero_separately_and_by_decade():
    v = torch.tensor([0.0, 0.0, 1e-12, 1e-9, 5e-9, 0.5, 1.0, 20.0, math.inf, math.nan], dtype=torch.float64)
    counts = run.histogram(v)
    labels = run.histogram_labels()
    assert len(counts) == len(labels) == len(run.HIST_EDGES)
    assert sum(counts) == v.numel()
    got = dict(zip(labels, counts))
    assert got["0"] == 2 and got["(0, 1e-9)"] == 1 and got["[1e-9, 1e-8)"] == 2
    assert got["[1e-1, 1e0)"] == 1 and got["[1e0, 1e1)"] == 1
    assert got["[1e1, inf]"] == 3  # 20, inf and NaN


def test_table_shows_both_chains_and_the_verdicts():
    r = synthetic_report()
    text = rep.format_table(r)
    assert "rlk off" in text and "rlk on" in text
    assert "rollout vs training: max |delta lp|" in text
    assert "layer 0 q_proj" in text and "none (bitwise equal)" in text
    assert "PASS  rlk on: rollout log-probs == training log-probs" in text
    assert "INFO" not in text  # off drifts here, so its control passes
    assert "rlk overhead" not in text  # the CPU interpreter's overhead means nothing
    gpu_text = rep.format_table(synthetic_report(device="cuda"))
    assert "rlk overhead, rollout forward (t_on / t_off - 1)" in gpu_text and "+20%" in gpu_text
    assert text.rstrip().endswith("PASSED: every rlk-on claim holds bit for bit")


def test_a_failing_on_claim_fails_the_report():
    r = synthetic_report(on_drift=1e-7)
    assert not r["passed"]
    assert set(r["failed"]) >= {
        "on.rollout_equals_training",
        "on.split_invariant_logprobs",
        "on.split_invariant_gradients",
    }
    assert "FAILED: on.rollout_equals_training" in rep.format_table(r)


def test_off_drift_zero_is_info_on_cpu_and_a_failure_on_a_gpu():
    cpu = synthetic_report(off_drift=0.0, device="cpu")
    v = {x["name"]: x for x in cpu["verdicts"]}["off.drift_nonzero"]
    assert v["status"] == "info" and not v["gates_exit"] and cpu["passed"]
    gpu = synthetic_report(off_drift=0.0, device="cuda")
    v = {x["name"]: x for x in gpu["verdicts"]}["off.drift_nonzero"]
    assert v["status"] == "fail" and v["gates_exit"] and gpu["failed"] == ["off.drift_nonzero"]


def test_contract_verdict_judges_float32_and_reports_16_bit():
    ref = [torch.tensor([-1.0, -2.0])]
    close = {"x": [torch.tensor([-1.0 + 1e-6, -2.0])]}
    far = {"x": [torch.tensor([-1.0 + 1e-3, -2.0])]}
    s = run._contract_verdict(torch.float32, close, ref)
    assert s["judged"] and s["ok"] and s["paths"]["x"]["ratio"] < 1
    s = run._contract_verdict(torch.float32, far, ref)
    assert s["judged"] and not s["ok"] and s["paths"]["x"]["ratio"] > 1
    s = run._contract_verdict(torch.bfloat16, far, ref)
    assert not s["judged"] and s["dtype"] == "bfloat16"


def test_json_is_strict_and_round_trips(tmp_path):
    r = synthetic_report()
    r["chains"]["off"]["probe"]["per_layer"][0]["max_abs"] = math.nan
    path = rep.write_json(r, str(tmp_path / "report.json"))
    text = open(path).read()
    assert "NaN" not in text and "Infinity" not in text
    back = json.loads(text)
    assert back["chains"]["off"]["probe"]["per_layer"][0]["max_abs"] is None
    assert back["verdicts"] == r["verdicts"]


def test_html_is_self_contained_with_two_inline_charts(tmp_path):
    r = synthetic_report()
    page = open(rep.write_html(r, str(tmp_path / "drift.html"))).read()
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 2
    low = page.lower()
    for external in ("<script", "<link", "src=", "href=", "@import", "url("):
        assert external not in low, f"the page refers to something outside itself: {external}"
    assert "0 (bitwise equal)" in page  # the floor of the log-scale chart
    assert "&lt;html&gt; &amp; characters" in page  # escaped
    for svg in (rep.svg_layer_chart(r), rep.svg_histogram(r)):
        ET.fromstring(svg)  # well-formed


def test_layer_chart_draws_zero_on_the_floor_and_handles_all_zero():
    r = synthetic_report()
    svg = rep.svg_layer_chart(r)
    assert svg.count("<circle") == 6  # 3 layers x 2 chains
    assert "max |delta| 0</title>" in svg  # rlk on: every layer on the floor
    both_zero = synthetic_report(off_drift=0.0)
    ET.fromstring(rep.svg_layer_chart(both_zero))
    assert rep.log_range([0.0, None]) == (-8, 0)
    assert rep.log_range([3e-7, 2e-3]) == (-7, -2)


def test_png_is_skipped_with_a_note_without_matplotlib(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    r = synthetic_report()
    files = rep.write_all(r, str(tmp_path / "out"))
    assert files["png"] is None and "matplotlib is not installed" in files["png_note"]
    assert not (tmp_path / "out" / "drift.png").exists()
    back = json.load(open(files["json"]))
    assert back["files"]["html"].endswith("drift.html") and any("matplotlib" in n for n in back["notes"])


def test_png_with_matplotlib(tmp_path):
    if importlib.util.find_spec("matplotlib") is None:
        if os.environ.get("RLK_REQUIRE_MATPLOTLIB") == "1":
            raise ImportError("RLK_REQUIRE_MATPLOTLIB=1 but matplotlib is not installed")
        pytest.skip("matplotlib is not installed (optional); set RLK_REQUIRE_MATPLOTLIB=1 to make this an error")
    path, note = rep.write_png(synthetic_report(), str(tmp_path / "drift.png"))
    assert note is None and open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_rendering_does_not_modify_the_report():
    r = synthetic_report()
    before = copy.deepcopy(r)
    rep.format_table(r)
    rep.render_html(r)
    assert r == before


@pytest.mark.triton_interpreter
def test_end_to_end_tiny_model_on_cpu(tmp_path):
    if os.environ.get("RLK_REQUIRE_TRANSFORMERS") == "1":
        import transformers  # noqa: F401  (CI installs it: fail loudly when it is missing)
    else:
        pytest.importorskip("transformers")
    out = tmp_path / "cons"
    r = run.run_consistency(
        "tiny", device="cpu", prompts=3, max_new_tokens=4, out=str(out), progress=False, timing=False, print_table=False
    )
    verdicts = {v["name"]: v for v in r["verdicts"]}
    for name in (
        "on.rollout_equals_training",
        "on.split_invariant_logprobs",
        "on.split_invariant_gradients",
        "on.rlk_kernels_ran",
    ):
        assert verdicts[name]["status"] == "pass", verdicts[name]
    assert r["passed"] and r["chains"]["on"]["probe"]["first_divergent"] is None
    assert r["contract"]["op"] == "selected_logprob" and r["contract"]["dtype"] == "float32"
    assert (out / "report.json").exists() and (out / "drift.html").exists()
    assert (out / "drift.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    back = json.loads((out / "report.json").read_text())
    assert back["prompt_lengths"] == r["prompt_lengths"] and len(back["chains"]["on"]["sequences"]) == 3
    assert sum(back["histogram"]["on"]) == back["chains"]["on"]["rollout_vs_training"]["tokens"]
