"""The batch-invariant mode + ``rlk.patch_model`` on transformers models on the GPU (bf16, realistic
shapes), the SDPA overrides, and the negative control: stock PyTorch is NOT batch-invariant there.

Every test needs CUDA (``gpu`` marker). transformers is optional unless ``RLK_REQUIRE_TRANSFORMERS=1``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from rlk.integrations.batch_invariant import batch_invariant, served_calls

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
MODEL = {"hidden": 1024, "layers": 4, "heads": 16, "kv_heads": 4, "vocab": 32000}


def _helpers():
    if os.environ.get("RLK_REQUIRE_TRANSFORMERS") != "1":
        pytest.importorskip("transformers")
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "rlk" / "tests" / "test_batch_invariant.py"
    spec = importlib.util.spec_from_file_location("_rlk_bi_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_bf16_model_is_batch_invariant_with_rlk(kind):
    helpers = _helpers()
    helpers.check_model_invariance(kind, torch.bfloat16, DEVICE, 1500, [3000, 517, 2048], **MODEL)


def test_stock_pytorch_is_not_batch_invariant_negative_control():
    """Without rlk the same sequence's bf16 logits change with the batch (cuBLAS picks kernels by shape,
    flash/SDPA splits differ): if this ever passes as invariant, the positive tests prove nothing."""
    helpers = _helpers()
    model = helpers.tiny_model("llama", torch.bfloat16, DEVICE, **MODEL)
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, MODEL["vocab"], (1500,), generator=g).to(DEVICE)
    others = [torch.randint(0, MODEL["vocab"], (n,), generator=g).to(DEVICE) for n in (3000, 517, 2048)]
    with torch.no_grad():
        alone = model(seq[None]).logits[0]
        differs = []
        for side in ("right", "left"):
            ids, mask, pos, real = helpers.padded_batch(seq, others, side)
            differs.append(not torch.equal(model(ids, attention_mask=mask, position_ids=pos).logits[0, real], alone))
        stacked = model(torch.stack([seq, seq.flip(0)])).logits[0]  # same length, no padding: batch of 2
        differs.append(not torch.equal(stacked, alone))
    assert any(differs), (
        "stock PyTorch gave bitwise identical logits alone and batched in every case: "
        "the negative control failed to show batch variance"
    )


SDPA_KERNELS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


@pytest.mark.parametrize("kernel", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "default"])
@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_overrides_are_invariant_and_close_to_stock(causal, kernel):
    """Each SDPA kernel torch may pick (forced, and torch's own choice: cuDNN on Hopper) runs on rlk under the
    mode, forward and backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if kernel == "default":
        _check_sdpa(causal)
        return
    with sdpa_kernel(getattr(SDPBackend, kernel)):
        _check_sdpa(causal)


def test_sdpa_backward_of_a_stock_forward_stays_stock():
    """A forward run before the mode was switched on keeps the stock backward (rlk's backward overrides only
    serve the saved state of an rlk forward)."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (
        torch.randn(2, 4, 300, 64, generator=g).to(DEVICE, torch.bfloat16).requires_grad_(True) for _ in range(3)
    )
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = torch.autograd.grad(out.float().square().sum(), (q, k, v), retain_graph=True)
    with batch_invariant():
        before = sum(served_calls[f"{name}_backward"] for name in SDPA_KERNELS)
        got = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        assert sum(served_calls[f"{name}_backward"] for name in SDPA_KERNELS) == before
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def _check_sdpa(causal):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(4, 8, 700, 64, generator=g).to(DEVICE, torch.bfloat16)
    k = torch.randn(4, 8, 700, 64, generator=g).to(DEVICE, torch.bfloat16)
    v = torch.randn(4, 8, 700, 64, generator=g).to(DEVICE, torch.bfloat16)
    stock = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with batch_invariant():
        before = sum(served_calls[name] + served_calls[f"{name}_backward"] for name in SDPA_KERNELS)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        out.float().square().sum().backward()
        one = [t[2:3].clone().requires_grad_(True) for t in (q, k, v)]
        out1 = F.scaled_dot_product_attention(*one, is_causal=causal)
        out1.float().square().sum().backward()
        after = sum(served_calls[name] + served_calls[f"{name}_backward"] for name in SDPA_KERNELS)
    assert after >= before + 4, "SDPA forward and backward did not both run on rlk (twice)"
    assert torch.equal(out[2], out1[0])
    for full, single in zip(leaves, one):
        assert torch.equal(full.grad[2], single.grad[0])
    torch.testing.assert_close(out.float(), stock.float(), atol=2e-2, rtol=2e-2)


def test_realistic_softmax_and_linear_rows_are_invariant():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2048, 1024, generator=g).to(DEVICE, torch.bfloat16)
    weight = (torch.randn(151936, 1024, generator=g) / 32).to(DEVICE, torch.bfloat16)
    with batch_invariant():
        logits = F.linear(hidden, weight)
        logp = torch.log_softmax(logits.float(), -1)
        for n in (1, 7, 65, 1000):
            part = F.linear(hidden[:n], weight)
            assert torch.equal(part[0], logits[0]), f"linear row differs with {n} rows"
            assert torch.equal(torch.log_softmax(part.float(), -1)[0], logp[0]), f"log_softmax row, {n} rows"
