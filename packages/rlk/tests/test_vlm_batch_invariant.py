"""The batch-invariant prefill chain on a vision-language model: a random-weight Qwen2-VL (transformers' own
classes, built from a config) under ``rlk.batch_invariant()`` + ``rlk.patch_model``.

The model, samples and comparisons are those of ``tools/vlm_invariance.py``: each sample's response log-probs alone
(batch 1) against the same sample in batches of other sizes, other image counts, left and right padding, with the
images' pixel values or vision-tower outputs taken from a per-image cache. Under rlk every comparison is
``torch.equal``; with stock kernels at least one differs (the negative control). The CPU run (``triton_interpreter``)
uses the tool's ``tiny`` preset in fp32, the GPU run its ``small`` preset in bf16. The two aten overrides the vision
tower needs (``convolution`` with stride == kernel, ``native_layer_norm``) are checked on their own too.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlk.integrations.batch_invariant import batch_invariant, disable_batch_invariant, served_calls

TOOL = Path(__file__).resolve().parents[3] / "tools" / "vlm_invariance.py"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
routed = pytest.mark.triton_interpreter if not ON_GPU else pytest.mark.gpu


def _tool():
    spec = importlib.util.spec_from_file_location("vlm_invariance", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _need_transformers():
    if os.environ.get("RLK_REQUIRE_TRANSFORMERS") == "1":
        import transformers  # noqa: F401  (CI installs it: fail loudly when it is missing)
    else:
        pytest.importorskip("transformers")
    pytest.importorskip("PIL")  # transformers' Qwen2-VL image processor


@pytest.fixture(autouse=True)
def _mode_off_after_each_test():
    yield
    disable_batch_invariant()


# ---------------------------------------------------------------------------
# the vision tower's overrides
# ---------------------------------------------------------------------------


@routed
def test_patch_embedding_convolutions_are_matmuls_per_patch():
    g = torch.Generator().manual_seed(0)
    x3 = torch.randn(5, 3, 2, 4, 4, generator=g).to(DEVICE)  # Qwen2-VL: one patch per row
    w3 = torch.randn(8, 3, 2, 4, 4, generator=g).to(DEVICE)
    b3 = torch.randn(8, generator=g).to(DEVICE)
    x2 = torch.randn(2, 3, 9, 13, generator=g).to(DEVICE)  # ViT-style: a grid of patches, trailing pixels dropped
    w2 = torch.randn(6, 3, 4, 4, generator=g).to(DEVICE)
    stock = [F.conv3d(x3, w3, b3, stride=(2, 4, 4)), F.conv2d(x2, w2, stride=4), F.conv2d(x2, w2, stride=2)]
    with batch_invariant():
        before = served_calls["convolution"]
        got = [F.conv3d(x3, w3, b3, stride=(2, 4, 4)), F.conv2d(x2, w2, stride=4)]
        assert served_calls["convolution"] == before + 2
        got.append(F.conv2d(x2, w2, stride=2))  # overlapping patches: the stock kernel
        assert served_calls["convolution"] == before + 2
        alone = F.conv3d(x3[3:4], w3, b3, stride=(2, 4, 4))
    for expected, result in zip(stock, got):
        assert result.shape == expected.shape
        torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(alone[0], got[0][3]), "a patch's embedding depends on the other patches"


@routed
def test_layer_norm_is_per_row_and_keeps_the_stock_backward():
    g = torch.Generator().manual_seed(1)
    norm = torch.nn.LayerNorm(16).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g))
        norm.bias.copy_(torch.randn(16, generator=g))
    x = torch.randn(3, 5, 16, generator=g).to(DEVICE)
    x_stock, x_rlk = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    expected = norm(x_stock)
    expected.pow(2).sum().backward()
    with batch_invariant():
        before = served_calls["native_layer_norm"]
        got = norm(x_rlk)
        got.pow(2).sum().backward()
        alone = norm(x[1:2, 2:3])
        assert served_calls["native_layer_norm"] == before + 2
        norm.double()(x.double())  # float64: the stock kernel
        assert served_calls["native_layer_norm"] == before + 2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_rlk.grad, x_stock.grad, rtol=1e-4, atol=1e-4)
    assert torch.equal(alone[0, 0], got[1, 2]), "a row's layer norm depends on the other rows"


# ---------------------------------------------------------------------------
# the whole prefill
# ---------------------------------------------------------------------------


def check_vlm_invariance(preset_name: str) -> dict:
    _need_transformers()
    tool = _tool()
    preset = tool.PRESETS[preset_name]
    start = dict(served_calls)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="rlk")  # any fallback to stock code fails the test
        results = tool.run(preset, DEVICE)
    served = {op: served_calls[op] - start.get(op, 0) for op in served_calls}
    for op in ("convolution", "native_layer_norm", "addmm", "mm", "_log_softmax"):
        assert served.get(op, 0) > 0, f"{op} did not run on rlk in the VLM forward"
    names = {row.name for row in results["rlk"]}
    assert {"batch4-right", "batch4-left", "pixel-cache", "embed-cache"} <= names
    assert len({row.name for row in results["rlk"] if row.name.startswith("images")}) == 2
    differ = [(row.name, row.sample, row.max_diff) for row in results["rlk"] if not row.equal]
    assert not differ, f"response log-probs differ under rlk: {differ}"
    assert any(not row.equal for row in results["stock"]), (
        "negative control: stock kernels gave bitwise-equal log-probs in every comparison"
    )
    return results


@pytest.mark.triton_interpreter
def test_tiny_qwen2_vl_response_logprobs_are_batch_invariant_cpu():
    check_vlm_invariance("tiny")


@pytest.mark.gpu
def test_qwen2_vl_response_logprobs_are_batch_invariant_gpu():
    check_vlm_invariance("small")


# ---------------------------------------------------------------------------
# the tool's command line
# ---------------------------------------------------------------------------


def test_the_tool_refuses_bad_arguments():
    tool = _tool()
    with pytest.raises(SystemExit):
        tool.main(["--preset", "huge"])
    with pytest.raises(SystemExit):
        tool.main(["--layers", "0"])


def test_the_tool_exit_code_follows_the_verdicts(monkeypatch, capsys):
    tool = _tool()
    same, drift = tool.Comparison("batch4-left", 0, True, 0.0), tool.Comparison("embed-cache", 1, False, 4.8e-7)
    verdicts = {"rlk": [same], "stock": [drift]}
    monkeypatch.setattr(tool, "run", lambda preset, device, seed, chains: {c: verdicts[c] for c in chains})
    assert tool.main(["--preset", "tiny", "--device", "cpu", "--expect-stock-drift"]) == 0
    out = capsys.readouterr().out
    assert "rlk    batch4-left     sample 0  bitwise-equal yes" in out
    assert "stock  embed-cache     sample 1  bitwise-equal no " in out and "negative control holds" in out
    verdicts["stock"] = [same]
    assert tool.main(["--preset", "tiny", "--device", "cpu"]) == 0
    assert tool.main(["--preset", "tiny", "--device", "cpu", "--expect-stock-drift"]) == 1
    verdicts["rlk"] = [drift]
    assert tool.main(["--preset", "tiny", "--device", "cpu", "--no-stock"]) == 1
    assert "NOT batch-invariant" in capsys.readouterr().out
