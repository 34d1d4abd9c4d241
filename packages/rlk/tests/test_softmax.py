"""The public softmax ops on the reference backend: math against fp64 torch, autograd, torch.library
integration, shapes and bad input. Tolerances come from the contract."""

from __future__ import annotations

import pytest
import torch

from rlk.core import contract
from rlk.ops.softmax import log_softmax, softmax

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPS = [(softmax, torch.softmax), (log_softmax, torch.log_softmax)]


def _x(shape, dtype=torch.float32, seed=0, scale=3.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _scale(ref: torch.Tensor) -> torch.Tensor:
    """The contract's per-element scale: ``1 + |ref|``."""
    return 1.0 + ref.abs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, truth", OPS, ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_matches_fp64_torch(op, truth, dtype, dim):
    x = _x((5, 37, 3), dtype)
    y = op(x, dim)
    assert y.dtype == dtype and y.shape == x.shape
    ref = truth(x.double(), dim)
    dev = contract.compare_outputs(
        contract.entry("softmax", dtype), "out", y.reshape(-1), ref.reshape(-1), _scale(ref).reshape(-1)
    )
    assert dev.ok, dev


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, truth", OPS, ids=["softmax", "log_softmax"])
def test_gradient_matches_fp64_autograd(op, truth, dtype):
    x = _x((9, 300), dtype, seed=1)
    g = torch.randn(9, 300, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    (op(xr, -1).double() * g).sum().backward()
    x64 = x.double().requires_grad_(True)
    ref = truth(x64, -1)
    (ref * g).sum().backward()
    assert xr.grad.dtype == dtype
    dev = contract.compare_grad(
        contract.entry("softmax", dtype), "grad_x", xr.grad, x64.grad, float(_scale(ref.detach()).max())
    )
    assert dev.ok, dev


def test_fp64_gradcheck_any_dim():
    x = torch.randn(3, 6, 4, dtype=torch.float64, requires_grad=True)
    for dim in (0, 1, -1):
        assert torch.autograd.gradcheck(lambda t, d=dim: softmax(t, d), (x,))
        assert torch.autograd.gradcheck(lambda t, d=dim: log_softmax(t, d), (x,))


def test_minus_inf_entries_and_extreme_values():
    x = _x((4, 50))
    x[0, ::3] = -torch.inf
    x[1] *= 1e4 / 3
    x[2] = -torch.inf  # no distribution: NaN, as torch gives
    for op, truth in OPS:
        y, ref = op(x, -1), truth(x.double(), -1)
        assert torch.isnan(y[2]).all() and torch.isnan(ref[2]).all()
        dev = contract.compare_outputs(
            contract.entry("softmax", torch.float32),
            "out",
            y[[0, 1, 3]].reshape(-1),
            ref[[0, 1, 3]].reshape(-1),
            _scale(ref[[0, 1, 3]]).reshape(-1),
        )
        assert dev.ok, dev
    assert torch.all(softmax(x, -1)[0, ::3] == 0) and torch.all(log_softmax(x, -1)[0, ::3] == -torch.inf)


def test_non_contiguous_input_and_0d():
    wide = _x((40, 12)).T  # [12, 40], non-contiguous
    assert torch.equal(softmax(wide, -1), softmax(wide.contiguous(), -1))
    assert torch.equal(log_softmax(wide, 0), log_softmax(wide.contiguous(), 0))
    assert softmax(torch.tensor(3.0), 0).item() == 1.0 and log_softmax(torch.tensor(3.0), -1).item() == 0.0


def test_empty():
    for shape, dim in (((0, 5), -1), ((3, 0), -1), ((3, 0), 0)):
        x = torch.randn(*shape, requires_grad=True)
        y = softmax(x, dim)
        assert y.shape == x.shape
        y.sum().backward()
        assert x.grad.shape == x.shape


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: softmax([1.0, 2.0]), TypeError, "x: expected a torch.Tensor, got list"),
        (lambda: softmax(torch.arange(5)), TypeError, "x: expected dtype bfloat16, float16 or float32"),
        (lambda: log_softmax(torch.randn(2, 3), 2), IndexError, r"dim: out of range for a 2-d tensor"),
        (lambda: softmax(torch.randn(2, 3), 1.0), TypeError, "dim: expected an int, got float"),
        (lambda: softmax(torch.tensor(1.0), 1), IndexError, "dim: out of range for a 0-d tensor"),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_opcheck_custom_ops():
    x = _x((6, 40)).requires_grad_(True)
    for log in (False, True):
        torch.library.opcheck(torch.ops.rlk.softmax_fwd.default, (x, log))
        y = torch.ops.rlk.softmax_fwd(x.detach(), log)
        torch.library.opcheck(torch.ops.rlk.softmax_bwd.default, (torch.randn(6, 40), y, log, "reference"))


def test_torch_compile_fullgraph_matches_eager():
    x0 = _x((4, 7, 33), seed=3)

    def fn(x):
        return (softmax(x, 1) * 2 + log_softmax(x, -1)).sum()

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        x = x0.clone().requires_grad_(True)
        loss = f(x)
        loss.backward()
        results.append((loss.detach(), x.grad))
    torch.testing.assert_close(results[1][0], results[0][0])
    assert torch.equal(results[1][1], results[0][1])
