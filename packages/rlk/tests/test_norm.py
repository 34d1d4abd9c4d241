"""The public ``rms_norm`` op on the reference backend: math against an independent re-derivation of
Hugging Face's modules, autograd, torch.library integration, shapes and bad input. Tolerances come
from the contract; fp64 runs are compared tightly."""

from __future__ import annotations

import pytest
import torch
from compile_check import assert_compiled_matches_eager

import rlk
from rlk.core import contract
from rlk.ops.norm import rms_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


# ---------------------------------------------------------------------------
# Hugging Face's formulas, written out (LlamaRMSNorm / Qwen3RMSNorm, Gemma3RMSNorm, the decoder
# layer's residual add); ``compute`` is float32 as in HF, float64 for ground truth.
# ---------------------------------------------------------------------------


def hf_llama(x, weight, eps=EPS, compute=torch.float32):
    input_dtype = x.dtype
    h = x.to(compute)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def hf_gemma(x, weight, eps=EPS, compute=torch.float32):
    out = x.to(compute)
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    out = out * (1.0 + weight.to(compute))
    return out.type_as(x)


def hf(x, weight, gemma, residual=None, compute=torch.float32):
    """``(y, s)``: HF's ``hidden_states = residual + hidden_states`` then the norm."""
    s = x if residual is None else residual + x
    return (hf_gemma if gemma else hf_llama)(s, weight, compute=compute), s


def _inputs(shape=(3, 5, 64), dtype=torch.float32, seed=0, w_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(w_dtype or dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    return x, w, r


def _check_y(dtype, y, ref):
    e = contract.entry("rms_norm", dtype)
    dev = contract.compare_outputs(e, "y", y.reshape(-1), ref.reshape(-1), 1.0 + ref.double().abs().reshape(-1))
    assert dev.ok, dev


# ---------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_hf_formula(dtype, gemma, fused):
    """y against HF's formula in fp64 (contract), and the new residual equal to HF's ``residual + x``."""
    x, w, r = _inputs(dtype=dtype)
    out = rms_norm(x, w, EPS, residual=r if fused else None, gemma=gemma)
    y, s = out if fused else (out, None)
    assert y.dtype == dtype and y.shape == x.shape
    truth, hf_s = hf(x.double(), w.double(), gemma, r.double() if fused else None, compute=torch.float64)
    _check_y(dtype, y, truth)
    same_dtype, _ = hf(x, w, gemma, r if fused else None)  # HF itself in the input dtype
    _check_y(dtype, same_dtype, truth)
    if fused:
        assert torch.equal(s, r + x)


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_fp64_matches_hf_formula_tightly(gemma):
    x, w, r = (t.double() for t in _inputs())
    y, s = rms_norm(x, w, EPS, residual=r, gemma=gemma)
    truth, _ = hf(x, w, gemma, r, compute=torch.float64)
    torch.testing.assert_close(y, truth, rtol=1e-13, atol=1e-13)
    assert torch.equal(s, r + x)


def test_fp32_weight_with_16bit_input_follows_torch_promotion():
    """Llama: ``fp32 weight * n.to(bf16)`` is fp32 (as in HF); Gemma: x.dtype. grad_weight stays fp32."""
    x, w, _ = _inputs(dtype=torch.bfloat16, w_dtype=torch.float32)
    y = rms_norm(x, w)
    assert y.dtype == torch.float32 == hf_llama(x, w).dtype
    _check_y(torch.bfloat16, y, hf_llama(x.double(), w.double(), compute=torch.float64).to(torch.bfloat16).double())
    assert rms_norm(x, w, gemma=True).dtype == torch.bfloat16
    w.requires_grad_(True)
    rms_norm(x, w).sum().backward()
    assert w.grad.dtype == torch.float32


def test_zero_row_and_eps():
    x = torch.zeros(2, 8)
    x[1] = 3.0
    w = torch.ones(8)
    y = rms_norm(x, w, eps=0.5)
    assert torch.equal(y[0], torch.zeros(8))
    torch.testing.assert_close(y[1], torch.full((8,), 3.0 / (9.0 + 0.5) ** 0.5))


ON_GPU = torch.cuda.is_available()


@pytest.mark.parametrize(("magnitude", "eps"), [(1e20, EPS), (3e38, EPS), (1e-30, 0.0), (1e-30, 1e-35)])
@pytest.mark.parametrize(
    "backend",
    [
        "reference",
        pytest.param("triton", marks=pytest.mark.gpu if ON_GPU else pytest.mark.triton_interpreter),
        pytest.param("cuda", marks=pytest.mark.gpu),
    ],
)
def test_rows_of_extreme_magnitude(backend, magnitude, eps):
    """``mean(x^2)`` overflowed fp32 for |x| of 1e20 (rstd 0: y = 0) and underflowed for 1e-30 with a tiny eps (rstd
    inf: y = inf); such rows are now computed on x scaled by a power of two. y and the gradients within the contract
    of fp64; the ordinary rows of the same batch keep the bits of HF's fp32 formula (reference backend). Rows of
    24 and of 9000 columns (the long-row kernels)."""
    device = torch.device("cuda" if ON_GPU else "cpu")
    reason = rlk.core.dispatch.why_not(backend, rlk.core.abi.OPS["rms_norm"], device, torch.float32)
    if reason is not None:  # rlk-cuda where it was not built (the GPU run without ci/build_cuda.sh)
        pytest.skip(f"{backend} does not run rms_norm here: {reason}")
    g = torch.Generator().manual_seed(5)
    for width in (24, 9000) if ON_GPU else (24,):
        x = torch.randn(4, width, generator=g)
        x[:2] = (
            magnitude * (0.25 + 0.75 * torch.rand(2, width, generator=g)) * torch.randn(2, width, generator=g).sign()
        )
        w = 1 + 0.3 * torch.randn(width, generator=g)
        grad_y = torch.randn(4, width, generator=g)
        xg, wg = x.clone().to(device).requires_grad_(), w.clone().to(device).requires_grad_()
        with rlk.use_backend(backend):
            y = rms_norm(xg, wg, eps)
        y.backward(grad_y.to(device))
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        truth = hf_llama(x64, w64, eps, compute=torch.float64)
        truth.backward(grad_y.double())
        _check_y(torch.float32, y.detach().cpu(), truth.detach())
        e = contract.entry("rms_norm", torch.float32)
        for name, got, want in (("grad_x", xg.grad, x64.grad), ("grad_weight", wg.grad, w64.grad)):
            dev = contract.compare_grad(e, name, got.cpu(), want, 1.0)
            assert dev.ok, (width, dev)
        if backend == "reference":
            assert torch.equal(y[2:], hf_llama(x[2:].to(device), w.to(device), eps))


# ---------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_hf_autograd(dtype, gemma, fused):
    """grad x / weight / residual (upstream gradients on y and on the new residual) vs HF in fp64."""
    x, w, r = _inputs(dtype=dtype)
    g = torch.Generator().manual_seed(1)
    gy, gs = torch.randn(2, *x.shape, generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, r)]
    out = rms_norm(leaves[0], leaves[1], EPS, residual=leaves[2] if fused else None, gemma=gemma)
    y, s = out if fused else (out, None)
    loss = (y.double() * gy.double()).sum() + ((s.double() * gs.double()).sum() if fused else 0)
    loss.backward()
    leaves64 = [t.double().requires_grad_(True) for t in (x, w, r)]
    y64, s64 = hf(leaves64[0], leaves64[1], gemma, leaves64[2] if fused else None, compute=torch.float64)
    ((y64 * gy.double()).sum() + ((s64 * gs.double()).sum() if fused else 0)).backward()
    e = contract.entry("rms_norm", dtype)
    names = ("grad_x", "grad_weight", "grad_residual")
    for name, leaf, leaf64 in list(zip(names, leaves, leaves64))[: 3 if fused else 2]:
        assert leaf.grad.dtype == leaf.dtype
        dev = contract.compare_grad(e, name, leaf.grad, leaf64.grad, 1.0)
        assert dev.ok, dev
    if fused:
        assert torch.equal(leaves[0].grad, leaves[2].grad)
    else:
        assert leaves[2].grad is None


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_fp64_gradients_match_hf_autograd_tightly(gemma):
    x, w, r = (t.double().requires_grad_(True) for t in _inputs(shape=(7, 40)))
    y, s = rms_norm(x, w, EPS, residual=r, gemma=gemma)
    (y.sin().sum() + s.cos().sum()).backward()
    grads = [t.grad for t in (x, w, r)]
    x2, w2, r2 = (t.detach().clone().requires_grad_(True) for t in (x, w, r))
    y2, s2 = hf(x2, w2, gemma, r2, compute=torch.float64)
    (y2.sin().sum() + s2.cos().sum()).backward()
    for got, want in zip(grads, (x2.grad, w2.grad, r2.grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_fp64_gradcheck(gemma, fused):
    x, w, r = (t.double().requires_grad_(True) for t in _inputs(shape=(2, 3, 12)))
    if fused:
        assert torch.autograd.gradcheck(lambda a, b, c: rms_norm(a, b, 1e-3, residual=c, gemma=gemma), (x, w, r))
    else:
        assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-3, gemma=gemma), (x, w))


def test_only_some_inputs_or_outputs_need_grad():
    x, w, r = _inputs(shape=(4, 16))
    wl = w.clone().requires_grad_(True)
    rms_norm(x, wl).sum().backward()
    assert wl.grad is not None
    xl = x.clone().requires_grad_(True)
    rms_norm(xl, w).sum().backward()
    assert xl.grad.shape == x.shape
    # only the new residual is used: grad_x = grad_residual = the upstream gradient of s
    xl, rl = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
    _, s = rms_norm(xl, w, residual=rl)
    (3 * s).sum().backward()
    assert torch.equal(xl.grad, torch.full_like(x, 3.0)) and torch.equal(rl.grad, xl.grad)


# ---------------------------------------------------------------------------
# shapes, strides, torch.library, torch.compile
# ---------------------------------------------------------------------------


def test_empty_input():
    x = torch.randn(2, 0, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    r = torch.randn(2, 0, 8, requires_grad=True)
    y, s = rms_norm(x, w, residual=r)
    assert y.shape == s.shape == (2, 0, 8)
    (y.sum() + s.sum()).backward()
    assert x.grad.shape == x.shape and r.grad.shape == r.shape and torch.equal(w.grad, torch.zeros(8))


def test_non_contiguous_input_matches_contiguous():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(32, 6, generator=g).T  # [6, 32], strides (1, 6)
    res = torch.randn(12, 32, generator=g)[::2]
    w = torch.randn(64, generator=g)[::2]
    y, s = rms_norm(wide, w, residual=res)
    y_ref, s_ref = rms_norm(wide.contiguous(), w.contiguous(), residual=res.contiguous())
    assert torch.equal(y, y_ref) and torch.equal(s, s_ref)


def test_opcheck_custom_ops():
    x, w, r = _inputs(shape=(6, 24))
    for residual in (None, r):
        for gemma in (False, True):
            args = (
                x.clone().requires_grad_(True),
                w.clone().requires_grad_(True),
                None if residual is None else residual.clone().requires_grad_(True),
                EPS,
                gemma,
            )
            torch.library.opcheck(torch.ops.rlk.rms_norm_fwd.default, args)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + EPS)
    gy = torch.randn(6, 24, generator=torch.Generator().manual_seed(4))
    for grad_residual in (None, gy * 0.5):
        for need_w in (False, True):
            torch.library.opcheck(
                torch.ops.rlk.rms_norm_bwd.default, (gy, x, w, rstd, grad_residual, False, need_w, "reference")
            )


def test_torch_compile_fullgraph_matches_eager():
    x, w, r = _inputs(shape=(2, 5, 32))

    def loss_fn(a, b, c):
        y, s = rms_norm(a, b, EPS, residual=c)
        y2 = rms_norm(s * 0.5, b, EPS, gemma=True)
        return (y * y2).sum() + s.square().sum()

    assert_compiled_matches_eager(loss_fn, (x, w, r), backend="aot_eager")


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: rms_norm(torch.randn(3, 8), torch.randn(7)), ValueError, r"weight: expected shape \(8,\)"),
        (lambda: rms_norm(torch.randn(3, 8), torch.randn(1, 8)), ValueError, r"weight: expected shape \(8,\)"),
        (
            lambda: rms_norm(torch.randn(3, 8), torch.randn(8), residual=torch.randn(3, 7)),
            ValueError,
            r"residual: expected shape \(3, 8\)",
        ),
        (lambda: rms_norm(torch.randn(3, 8).long(), torch.randn(8)), TypeError, "x: expected dtype"),
        (lambda: rms_norm(torch.randn(3, 8), torch.randn(8).int()), TypeError, "weight: expected dtype"),
        (lambda: rms_norm(torch.randn(3, 8), torch.randn(8).half()), TypeError, "weight: expected the dtype of x"),
        (
            lambda: rms_norm(torch.randn(3, 8), torch.randn(8), residual=torch.randn(3, 8).half()),
            TypeError,
            "residual: expected the dtype of x",
        ),
        (
            lambda: rms_norm(torch.randn(3, 8), torch.randn(8), eps=-1e-6),
            ValueError,
            "eps: must be a finite number >= 0",
        ),
        (lambda: rms_norm(torch.randn(3, 8), torch.randn(8), eps=float("nan")), ValueError, "eps: must be"),
        (lambda: rms_norm(torch.randn(3, 8), torch.randn(8), eps="small"), TypeError, "eps: expected a number"),
        (lambda: rms_norm(torch.randn(3, 0), torch.randn(0)), ValueError, "H >= 1"),
        (lambda: rms_norm(torch.tensor(1.0), torch.randn(1)), ValueError, r"x: expected shape \[..., H\]"),
        (lambda: rms_norm([1.0, 2.0], torch.randn(2)), TypeError, "x: expected a torch.Tensor"),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_device_mismatch_is_named():
    with pytest.raises(ValueError, match="weight: expected device cpu"):
        rms_norm(torch.randn(3, 8), torch.randn(8, device="meta"))
    with pytest.raises(ValueError, match="residual: expected device cpu"):
        rms_norm(torch.randn(3, 8), torch.randn(8), residual=torch.randn(3, 8, device="meta"))


# ---------------------------------------------------------------------------
# GPU: the backend rlk picks there, under opcheck and inductor
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compile_and_opcheck_on_the_gpu_backend(dtype):
    x, w, r = (t.cuda() for t in _inputs(shape=(3, 11, 256), dtype=dtype))
    assert rlk.explain("rms_norm", x).backend != "reference"
    torch.library.opcheck(
        torch.ops.rlk.rms_norm_fwd.default,
        (
            x.reshape(33, 256).requires_grad_(),
            w.clone().requires_grad_(),
            r.reshape(33, 256).requires_grad_(),
            EPS,
            False,
        ),
    )

    def loss_fn(a, b, c):
        y, s = rms_norm(a, b, EPS, residual=c)
        return (y.float() * rms_norm(s, b, gemma=True).float()).sum() + s.float().square().sum()

    assert_compiled_matches_eager(loss_fn, (x, w, r))


@pytest.mark.gpu
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_gpu_backend_matches_hf_formula(gemma):
    """bf16 [4, 2048, 4096] through the public op on the GPU backend vs HF's formula in fp64."""
    x, w, r = (t.cuda() for t in _inputs(shape=(4, 2048, 4096), dtype=torch.bfloat16))
    y, s = rms_norm(x, w, EPS, residual=r, gemma=gemma)
    truth, _ = hf(x.double(), w.double(), gemma, r.double(), compute=torch.float64)
    _check_y(torch.bfloat16, y, truth)
    assert torch.equal(s, r + x)
