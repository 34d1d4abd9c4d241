"""The public GEMM ops ``rlk.ops.matmul.matmul`` / ``rlk.ops.matmul.linear`` on the reference backend (and,
with a GPU, the backend rlk picks there): math against torch in float64, autograd, torch.library
integration, layouts, empty sizes and bad input. Tolerances come from the contract; the scale of
an element is ``(|a| @ |b|) + |bias|`` (``rlk.reference.matmul.error_scale``)."""

from __future__ import annotations

import pytest
import torch
from compile_check import assert_compiled_matches_eager

from rlk.core import contract
from rlk.ops.matmul import linear, matmul
from rlk.reference.matmul import error_scale

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rand(*shape, seed=0, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def _check_value(dtype, name, got, truth, scale):
    dev = contract.compare_outputs(
        contract.entry("matmul", dtype), name, got.reshape(-1), truth.reshape(-1), scale.reshape(-1)
    )
    assert dev.ok, dev


def _check_grad(dtype, name, got, truth):
    assert got.dtype == dtype and got.shape == truth.shape
    dev = contract.compare_grad(contract.entry("matmul", dtype), name, got, truth, 0.0)
    assert dev.ok, dev


# ---------------------------------------------------------------------------
# values and gradients
# ---------------------------------------------------------------------------


def test_fp64_equals_torch():
    a, b = _rand(3, 5, 24, seed=1, dtype=torch.float64), _rand(24, 7, seed=2, dtype=torch.float64)
    torch.testing.assert_close(matmul(a, b), a @ b, rtol=1e-13, atol=1e-13)
    w, bias = _rand(7, 24, seed=3, dtype=torch.float64), _rand(7, seed=4, dtype=torch.float64)
    torch.testing.assert_close(linear(a, w, bias), torch.nn.functional.linear(a, w, bias), rtol=1e-13, atol=1e-13)
    bb = _rand(3, 24, 7, seed=5, dtype=torch.float64)
    torch.testing.assert_close(matmul(a, bb), torch.bmm(a, bb), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_fp64_torch(dtype):
    """Forward and all three gradients against torch autograd in float64 on the same (rounded) inputs."""
    x, w = _rand(2, 9, 40, seed=1, dtype=dtype), _rand(33, 40, seed=2, dtype=dtype)
    bias = _rand(33, seed=3, dtype=dtype)
    g = _rand(2, 9, 33, seed=4, dtype=dtype)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, bias)]
    out = linear(*leaves)
    assert out.dtype == dtype and out.shape == (2, 9, 33)
    out.backward(g)
    leaves64 = [t.double().requires_grad_(True) for t in (x, w, bias)]
    truth = torch.nn.functional.linear(*leaves64)
    truth.backward(g.double())
    _check_value(dtype, "out", out, truth, error_scale(x.reshape(-1, 40), w.T, bias))
    for name, leaf, leaf64 in zip(("grad_x", "grad_weight", "grad_bias"), leaves, leaves64):
        _check_grad(dtype, name, leaf.grad, leaf64.grad)
    assert leaves[1].grad.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_and_bmm_match_fp64_torch(dtype):
    a, b, bb = (
        _rand(4, 6, 24, seed=1, dtype=dtype),
        _rand(24, 10, seed=2, dtype=dtype),
        _rand(4, 24, 10, seed=3, dtype=dtype),
    )
    for rhs, ref_fn in ((b, torch.matmul), (bb, torch.bmm)):
        la, lb = a.clone().requires_grad_(True), rhs.clone().requires_grad_(True)
        out = matmul(la, lb)
        g = _rand(*out.shape, seed=9, dtype=dtype)
        out.backward(g)
        a64, b64 = a.double().requires_grad_(True), rhs.double().requires_grad_(True)
        truth = ref_fn(a64, b64)
        truth.backward(g.double())
        assert out.shape == truth.shape and out.dtype == dtype
        scale = torch.abs(a.double()) @ torch.abs(rhs.double())
        _check_value(dtype, "out", out, truth, scale)
        _check_grad(dtype, "grad_a", la.grad, a64.grad)
        _check_grad(dtype, "grad_b", lb.grad, b64.grad)


def test_fp64_gradcheck():
    a = _rand(2, 3, 6, seed=1, dtype=torch.float64).requires_grad_(True)
    b = _rand(6, 4, seed=2, dtype=torch.float64).requires_grad_(True)
    bb = _rand(2, 6, 4, seed=3, dtype=torch.float64).requires_grad_(True)
    w = _rand(4, 6, seed=4, dtype=torch.float64).requires_grad_(True)
    bias = _rand(4, seed=5, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(matmul, (a, b))
    assert torch.autograd.gradcheck(matmul, (a, bb))
    assert torch.autograd.gradcheck(linear, (a, w, bias))
    # column-major operands (their gradients are allocated column-major too)
    a_cm = _rand(6, 3, seed=6, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, y: matmul(x.T, y.T), (a_cm, w))


def test_only_some_inputs_need_grad():
    x, w, bias = _rand(5, 8, seed=1), _rand(3, 8, seed=2).requires_grad_(True), _rand(3, seed=3)
    linear(x, w, bias).sum().backward()
    assert w.grad is not None and w.grad.shape == (3, 8)
    x = x.requires_grad_(True)
    w2 = w.detach()
    bias = bias.requires_grad_(True)
    linear(x, w2, bias).sum().backward()
    assert x.grad is not None and torch.equal(bias.grad, torch.full((3,), 5.0))


# ---------------------------------------------------------------------------
# layouts and sizes
# ---------------------------------------------------------------------------


def test_transposed_and_strided_inputs_give_the_same_bits():
    a, b = _rand(12, 20, seed=1), _rand(20, 9, seed=2)
    expected = matmul(a, b)
    a_cm = a.T.contiguous().T  # column-major
    b_cm = b.T.contiguous().T
    assert not a_cm.is_contiguous() and not b_cm.is_contiguous()
    assert torch.equal(matmul(a_cm, b_cm), expected)
    wide = torch.zeros(24, 40)
    wide[::2, ::2] = a  # neither row- nor column-major: copied by the op
    assert torch.equal(matmul(wide[::2, ::2], b), expected)
    w = b.T.contiguous()
    assert torch.equal(linear(a, w), expected)
    assert torch.equal(linear(a, w.T.contiguous().T), expected)  # a column-major weight


def test_gradients_follow_the_input_layout():
    a = _rand(12, 20, seed=1).T.contiguous().T.requires_grad_(True)  # column-major [12, 20]
    b = _rand(20, 9, seed=2).requires_grad_(True)
    matmul(a, b).backward(_rand(12, 9, seed=3))
    assert a.grad.shape == (12, 20) and b.grad.is_contiguous()
    a2, b2 = a.detach().contiguous().requires_grad_(True), b.detach().clone().requires_grad_(True)
    matmul(a2, b2).backward(_rand(12, 9, seed=3))
    assert torch.equal(a.grad, a2.grad) and torch.equal(b.grad, b2.grad)


def test_empty_sizes():
    # M = 0: empty output; grad of b and bias are zeros
    x = torch.randn(0, 5, requires_grad=True)
    w, bias = torch.randn(3, 5, requires_grad=True), torch.randn(3, requires_grad=True)
    out = linear(x, w, bias)
    assert out.shape == (0, 3)
    out.sum().backward()
    assert x.grad.shape == (0, 5) and torch.all(w.grad == 0) and torch.all(bias.grad == 0)
    # K = 0: the output is the bias; grad_bias still sums the rows
    x, w = torch.randn(4, 0, requires_grad=True), torch.randn(3, 0, requires_grad=True)
    bias = torch.randn(3, requires_grad=True)
    out = linear(x, w, bias)
    assert torch.equal(out, bias.detach().expand(4, 3))
    out.sum().backward()
    assert torch.equal(bias.grad, torch.full((3,), 4.0)) and w.grad.shape == (3, 0)
    assert torch.equal(matmul(torch.randn(2, 3, 0), torch.randn(0, 6)), torch.zeros(2, 3, 6))
    # N = 0: empty output; grad_a is zeros
    a, b = torch.randn(4, 5, requires_grad=True), torch.randn(5, 0, requires_grad=True)
    out = matmul(a, b)
    assert out.shape == (4, 0)
    out.sum().backward()
    assert torch.equal(a.grad, torch.zeros(4, 5))
    # empty leading dims and an empty batch
    assert matmul(torch.randn(2, 0, 4), torch.randn(4, 3)).shape == (2, 0, 3)
    assert matmul(torch.randn(0, 2, 4), torch.randn(0, 4, 3)).shape == (0, 2, 3)


def test_one_dim_x_in_linear_like_torch():
    x, w, bias = _rand(8, seed=1), _rand(3, 8, seed=2), _rand(3, seed=3)
    out = linear(x, w, bias)
    assert out.shape == (3,)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias))


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: matmul(torch.randn(3, 4), torch.randn(5, 6)),
            ValueError,
            r"b: expected shape \[K, N\] with K = 4 \(a's last dim\), got \(5, 6\)",
        ),
        (lambda: matmul(torch.randn(3, 4), torch.randn(4, 6).half()), TypeError, "b: expected the dtype of a"),
        (
            lambda: matmul(torch.randn(3, 4).long(), torch.randn(4, 6).long()),
            TypeError,
            "a: expected dtype bfloat16, float16 or float32",
        ),
        (lambda: matmul(torch.randn(3, 4), torch.randint(0, 3, (4, 6))), TypeError, "b: expected dtype"),
        (lambda: matmul(torch.randn(4), torch.randn(4, 6)), ValueError, r"a: expected shape \[..., M, K\]"),
        (lambda: matmul(torch.randn(3, 4), torch.randn(4)), ValueError, r"b: expected shape \[K, N\] or \[B, K, N\]"),
        (lambda: matmul(torch.randn(3, 4), torch.randn(1, 1, 4, 6)), ValueError, r"b: expected shape \[K, N\] or"),
        (lambda: matmul(torch.randn(3, 4), torch.randn(2, 4, 6)), ValueError, r"a: expected shape \[B, M, K\]"),
        (lambda: matmul(torch.randn(2, 3, 4), torch.randn(3, 4, 6)), ValueError, "with B = 2 and K = 4"),
        (lambda: matmul([[1.0]], torch.randn(1, 1)), TypeError, "a: expected a torch.Tensor"),
        (
            lambda: linear(torch.randn(3, 4), torch.randn(5, 6)),
            ValueError,
            r"weight: expected shape \[N, K\] with K = 4 \(x's last dim\), got \(5, 6\)",
        ),
        (lambda: linear(torch.randn(3, 4), torch.randn(4)), ValueError, r"weight: expected shape \[N, K\]"),
        (
            lambda: linear(torch.randn(3, 4), torch.randn(5, 4), torch.randn(4)),
            ValueError,
            r"bias: expected shape \(5,\)",
        ),
        (
            lambda: linear(torch.randn(3, 4), torch.randn(5, 4), torch.randn(5).double()),
            TypeError,
            "bias: expected the dtype of x",
        ),
        (
            lambda: linear(torch.randn(3, 4).bfloat16(), torch.randn(5, 4)),
            TypeError,
            r"weight: expected the dtype of x \(torch.bfloat16\)",
        ),
        (lambda: linear(torch.randn(3, 4).int(), torch.randn(5, 4).int()), TypeError, "x: expected dtype"),
        (lambda: linear(torch.tensor(1.0), torch.randn(5, 4)), ValueError, r"x: expected shape \[..., K\]"),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_device_mismatch_is_named():
    with pytest.raises(ValueError, match="b: expected device cpu"):
        matmul(torch.randn(3, 4), torch.randn(4, 5, device="meta"))
    with pytest.raises(ValueError, match="weight: expected device cpu"):
        linear(torch.randn(3, 4), torch.randn(5, 4, device="meta"))
    with pytest.raises(ValueError, match="bias: expected device cpu"):
        linear(torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, device="meta"))


# ---------------------------------------------------------------------------
# torch.library integration
# ---------------------------------------------------------------------------


def test_opcheck_custom_ops():
    a, b, bias = _rand(6, 8, seed=1), _rand(8, 5, seed=2), _rand(5, seed=3)
    w_t = _rand(5, 8, seed=4).T  # column-major b, as linear passes it
    bb, a3 = _rand(2, 8, 5, seed=5), _rand(2, 6, 8, seed=6)
    for args in ((a, b, None), (a, w_t, bias), (a3, bb, None)):
        leaves = tuple(None if t is None else t.clone().requires_grad_(True) for t in args)
        torch.library.opcheck(torch.ops.rlk.matmul_fwd.default, leaves)
    g = _rand(6, 5, seed=7)
    for need in ((True, True, True), (True, False, False), (False, True, False), (False, False, True)):
        torch.library.opcheck(torch.ops.rlk.matmul_bwd.default, (g, a, w_t, *need, "reference"))
    torch.library.opcheck(
        torch.ops.rlk.matmul_bwd.default, (_rand(2, 6, 5, seed=8), a3, bb, True, True, False, "reference")
    )


def test_torch_compile_fullgraph_matches_eager():
    x, w, bias = _rand(2, 5, 16, seed=1), _rand(12, 16, seed=2), _rand(12, seed=3)
    w2, bb = _rand(12, 7, seed=4), _rand(2, 16, 7, seed=5)

    def loss_fn(x, w, bias, w2, bb):
        h = linear(x, w, bias)
        return (matmul(h, w2) * 0.5).sum() + matmul(x, bb).square().sum()

    assert_compiled_matches_eager(loss_fn, (x, w, bias, w2, bb), backend="aot_eager")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_backend_compile_opcheck_and_values(dtype):
    """On the GPU rlk picks a non-reference backend; opcheck, inductor fullgraph == eager bit for bit,
    and values and gradients against float64 torch under the contract."""
    import rlk

    x = _rand(3, 50, 256, seed=1, dtype=dtype, device="cuda")
    w = (_rand(384, 256, seed=2, dtype=torch.float32, device="cuda") / 16).to(dtype)
    bias = _rand(384, seed=3, dtype=dtype, device="cuda")
    assert rlk.explain("matmul", x, w).backend != "reference"
    torch.library.opcheck(
        torch.ops.rlk.matmul_fwd.default,
        tuple(t.detach().clone().requires_grad_(True) for t in (x.reshape(150, 256), w.T, bias)),
    )

    def fn(x, w, bias):
        return linear(x, w, bias)

    g = _rand(3, 50, 384, seed=4, dtype=dtype, device="cuda")
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, bias)]
        out = f(*leaves)
        out.backward(g)
        results.append([out.detach()] + [t.grad for t in leaves])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)
    leaves64 = [t.detach().double().requires_grad_(True) for t in (x, w, bias)]
    truth = torch.nn.functional.linear(*leaves64)
    truth.backward(g.double())
    _check_value(dtype, "out", results[0][0], truth, error_scale(x.reshape(-1, 256), w.T, bias))
    for name, grad, leaf64 in zip(("grad_x", "grad_weight", "grad_bias"), results[0][1:], leaves64):
        _check_grad(dtype, name, grad, leaf64.grad)
