"""The batch-invariant prefill chain on a vision-language model: a random-weight Qwen2-VL or Qwen2.5-VL
(transformers' own classes, built from a config) under ``rlk.batch_invariant()`` + ``rlk.patch_model``.

The model, samples and comparisons are those of ``tools/vlm_invariance.py``: each sample's response log-probs alone
(batch 1) against the same sample in batches of other sizes, other image counts, left and right padding, with the
images' pixel values or vision-tower outputs taken from a per-image cache. Under rlk every comparison is
``torch.equal``; with stock kernels at least one differs (the negative control). The CPU run (``triton_interpreter``)
uses the tool's ``tiny`` preset in fp32, the GPU runs its ``small`` preset in bf16. Two more CPU runs cover videos
(Qwen2-VL: ``pixel_values_videos`` with 2 temporal patches, next to images) and Qwen2.5-VL (RMSNorm, SwiGLU and
windowed attention in the vision tower, a window block and a full-attention block; images and a video), with a
1-layer language model and the full-batch and embedding-cache comparisons only (``quick``: the interpreter is
slow); on a GPU, both models with and without videos run every comparison. The two aten overrides the vision tower
needs (``convolution`` with stride == kernel, ``native_layer_norm``) are checked on their own too.
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

from rlk.integrations.batch_invariant import (
    batch_invariant,
    disable_batch_invariant,
    is_batch_invariant_enabled,
    served_calls,
)

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
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # rlk's fp32 products are IEEE, not TF32
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


def check_vlm_invariance(
    preset_name: str,
    model: str = "qwen2-vl",
    video: bool = False,
    quick: bool = False,
    layers: int | None = None,
    plan: tuple[str, ...] | None = None,
) -> dict:
    """The tool's comparisons for ``model`` (``video``: samples with videos too; ``quick``: no smaller batches, no
    pixel cache; ``layers``: the language model's depth instead of the preset's; ``plan``: the samples' media instead
    of the tool's default), checked: every rlk comparison bitwise equal, no fallback warning, the vision tower's ops
    served by rlk (its RMSNorm modules patched, both kinds of Qwen2.5-VL blocks attending over their own segments),
    stock kernels drifting somewhere."""
    _need_transformers()
    tool = _tool()
    preset = tool.resolve(tool.PRESETS[preset_name], model)
    if layers is not None:
        preset["layers"] = layers
    watched: dict = {"segments": {}, "norms": []}
    build = tool.build_model

    def build_and_watch(*args, **kwargs):
        built = build(*args, **kwargs)
        for index, block in enumerate(built.model.visual.blocks):

            def count(module, args, kwargs, index=index):
                cu_seqlens = kwargs.get("cu_seqlens", args[1] if len(args) > 1 else None)
                watched["segments"].setdefault(index, []).append(len(cu_seqlens) - 1)

            block.attn.register_forward_pre_hook(count, with_kwargs=True)
        for module in built.model.visual.modules():
            if type(module).__name__.endswith("RMSNorm"):

                def patched(module, args):
                    if is_batch_invariant_enabled():
                        watched["norms"].append("forward" in module.__dict__)

                module.register_forward_pre_hook(patched)
        return built

    start = dict(served_calls)
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(tool, "build_model", build_and_watch)
        warnings.filterwarnings("error", message="rlk")  # any fallback to stock code fails the test
        results = tool.run(preset, DEVICE, model=model, video=video, quick=quick, plan=plan)
    served = {op: served_calls[op] - start.get(op, 0) for op in served_calls}
    ops = ["convolution", "addmm", "mm", "_log_softmax"]
    if model == "qwen2-vl":
        ops.append("native_layer_norm")  # Qwen2-VL's vision LayerNorm (Qwen2.5-VL's RMSNorm: patch_model)
    for op in ops:
        assert served.get(op, 0) > 0, f"{op} did not run on rlk in the VLM forward"
    names = {row.name for row in results["rlk"]}
    assert {"batch4-right", "batch4-left", "embed-cache"} <= names and ("pixel-cache" in names) != quick
    smaller = {row.name for row in results["rlk"] if row.name.startswith("images")}
    assert len(smaller) == (0 if quick else 2)
    differ = [(row.name, row.sample, row.max_diff) for row in results["rlk"] if not row.equal]
    assert not differ, f"response log-probs differ under rlk: {differ}"
    assert any(not row.equal for row in results["stock"]), (
        "negative control: stock kernels gave bitwise-equal log-probs in every comparison"
    )
    if model == "qwen2.5-vl":
        assert watched["norms"] and all(watched["norms"]), "a vision RMSNorm ran the stock forward under rlk"
        full = set(tool.full_attention_blocks(preset["vision_depth"]))
        segments = watched["segments"]
        window = set(segments) - full
        assert full and window, f"the vision tower needs window and full-attention blocks, got {sorted(segments)}"
        for w in window:  # same calls, each cut into more (smaller) windows than the full blocks' per-frame segments
            for f in full:
                assert len(segments[w]) == len(segments[f])
                assert all(a >= b for a, b in zip(segments[w], segments[f])) and segments[w] != segments[f]
    return results


@pytest.mark.triton_interpreter
def test_tiny_qwen2_vl_response_logprobs_are_batch_invariant_cpu():
    # a 1-layer language model (the preset's 2 layers run the same ops twice): every comparison, the stock drift
    check_vlm_invariance("tiny", layers=1)


@pytest.mark.slow
@pytest.mark.triton_interpreter
def test_tiny_qwen2_vl_with_videos_is_batch_invariant_cpu():
    check_vlm_invariance("tiny", video=True, quick=True, layers=1)


@pytest.mark.slow
@pytest.mark.triton_interpreter
def test_tiny_qwen2_5_vl_with_images_and_videos_is_batch_invariant_cpu():
    # an image of one window (56 x 56 pixels: 2 x 2 merged tokens, windows of 2 x 2), then a sample with an image and a
    # video of two windows each (a frame's): few patches (88), window blocks cut finer than the full-attention blocks
    check_vlm_invariance("tiny", model="qwen2.5-vl", video=True, quick=True, layers=1, plan=("i", "iv", "", ""))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "model, video", [("qwen2-vl", False), ("qwen2-vl", True), ("qwen2.5-vl", False), ("qwen2.5-vl", True)]
)
def test_qwen2_vl_response_logprobs_are_batch_invariant_gpu(model, video):
    # the 8B shapes: at the "small" preset an H100's stock kernels agree across batch shapes (no negative control)
    check_vlm_invariance("8b", model=model, video=video)


# ---------------------------------------------------------------------------
# the tool's command line
# ---------------------------------------------------------------------------


def test_the_tool_refuses_bad_arguments():
    tool = _tool()
    with pytest.raises(SystemExit):
        tool.main(["--preset", "huge"])
    with pytest.raises(SystemExit):
        tool.main(["--layers", "0"])
    with pytest.raises(SystemExit):
        tool.main(["--model", "qwen3-vl"])
    with pytest.raises(SystemExit):
        tool.main(["--model", "qwen2.5-vl", "--vision-depth", "1"])  # no room for both kinds of vision blocks


def test_the_tool_exit_code_follows_the_verdicts(monkeypatch, capsys):
    tool = _tool()
    same, drift = tool.Comparison("batch4-left", 0, True, 0.0), tool.Comparison("embed-cache", 1, False, 4.8e-7)
    verdicts = {"rlk": [same], "stock": [drift]}
    monkeypatch.setattr(tool, "run", lambda preset, device, seed, chains, **kw: {c: verdicts[c] for c in chains})
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
