"""The public log-prob ops on the reference backend: math, autograd, torch.library
integration, shapes and bad input. Ground truth is an independent fp64
formula (log_softmax + gather); tolerances come from the contract."""

from __future__ import annotations

import pytest
import torch
from compile_check import assert_compiled_matches_eager

import rlk
from rlk.core import contract
from rlk.reference import logprob as reference_logprob

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _truth(logits: torch.Tensor, targets: torch.Tensor, temperature, ignore_index=-100):
    """fp64 logprob, entropy and lse from plain PyTorch ops (not rlk's reference)."""
    if isinstance(temperature, torch.Tensor):
        temperature = torch.broadcast_to(temperature, targets.shape).double()[..., None]
    z = logits.double() / temperature
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    valid = targets != ignore_index
    lp = logp.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    ent = -(torch.where(p > 0, p * logp, 0.0)).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0), torch.logsumexp(z, -1)


def _case(n=37, v=1000, dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * scale).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = -100
    return logits, targets


def _check(op, dtype, lp, ent, logits, targets, temperature):
    ref_lp, ref_ent, lse = _truth(logits, targets, temperature)
    e = contract.entry(op, dtype)
    scale = contract.row_scale(ref_lp, lse).reshape(-1)
    assert contract.compare_outputs(e, "logprob", lp.reshape(-1), ref_lp.reshape(-1), scale).ok
    assert contract.compare_outputs(e, "entropy", ent.reshape(-1), ref_ent.reshape(-1), scale).ok
    return scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_selected_logprob_matches_log_softmax(dtype):
    logits, targets = _case(dtype=dtype)
    temperature = 0.7
    lp, ent = rlk.selected_logprob(logits, targets, temperature=temperature, return_entropy=True)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == targets.shape
    _check("selected_logprob", dtype, lp, ent, logits, targets, temperature)
    assert torch.all(lp[targets == -100] == 0) and torch.all(ent[targets == -100] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_selected_logprob_gradient_matches_autograd_of_log_softmax(dtype):
    logits, targets = _case(dtype=dtype)
    temperature = torch.rand(37, 1, generator=torch.Generator().manual_seed(1))[:, 0] + 0.5
    c1, c2 = torch.randn(2, 37, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x = logits.clone().requires_grad_(True)
    lp, ent = rlk.selected_logprob(x, targets, temperature=temperature, return_entropy=True)
    (c1.float() * lp + c2.float() * ent).sum().backward()
    x64 = logits.double().requires_grad_(True)
    ref_lp, ref_ent, lse = _truth(x64, targets, temperature)
    (c1 * ref_lp + c2 * ref_ent).sum().backward()
    e = contract.entry("selected_logprob", dtype)
    scale = contract.row_scale(ref_lp.detach(), lse.detach())
    assert x.grad.dtype == dtype
    assert contract.compare_grad(e, "grad_logits", x.grad, x64.grad, float(scale.max())).ok
    assert torch.all(x.grad[targets == -100] == 0)


def test_extreme_and_minus_inf_logits():
    logits, targets = _case(n=9, v=300)
    logits[0] *= 1e4 / 3
    logits[1, :100] = -torch.inf
    targets[1] = 150  # a finite target in a row with -inf entries
    logits[2, 7] = -torch.inf
    targets[2] = 7  # the target itself is -inf: logprob -inf, entropy finite
    x = logits.clone().requires_grad_(True)
    lp, ent = rlk.selected_logprob(x, targets, return_entropy=True)
    assert lp[2] == -torch.inf and torch.isfinite(ent).all() and torch.isfinite(lp[[0, 1, 3]]).all()
    _check("selected_logprob", torch.float32, lp, ent, logits, targets, 1.0)
    (lp[[0, 1, 3, 4]].sum() + ent.sum()).backward()
    assert torch.isfinite(x.grad).all()


# Logits far from 0 (the offset) with an O(1) spread: entropy = lse - E_p[z] would subtract two numbers of
# size |z|. float16 cannot hold the 1e6 and 3e38 offsets (6e4 stands in for them).
LARGE_LOGITS = [
    (torch.float32, 30.0, 0.05),
    (torch.float32, 1e6, 1.0),
    (torch.float32, 3e38, 1.0),
    (torch.bfloat16, 30.0, 0.05),
    (torch.bfloat16, 1e6, 1.0),
    (torch.bfloat16, 3e38, 1.0),
    (torch.float16, 30.0, 0.05),
    (torch.float16, 6e4, 1.0),
]


def _large_logits(offset, temperature, dtype, n=24, v=1000, seed=8):
    """``offset + N(0, 1)`` logits on a 1/64 grid, so that ``z = x * (1 / T)`` is exact in fp32 for T = 1 and 0.05
    (``1 / 0.05`` rounds to 20): the fp64 truth sees the kernels' z. Row 0 has -inf entries (not its target); row 1
    is one-hot-like, its target ``20 / T`` above the other logits (entropy ~4e-5: 999 terms ``e^-20 * 20``)."""
    g = torch.Generator().manual_seed(seed)
    x = offset + torch.round(torch.randn(n, v, generator=g) * 64) / 64
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = -100
    x[0, 0::3] = -torch.inf
    targets[0] = 1
    x[1] = offset - 20 * temperature
    x[1, targets[1]] = offset
    return x.to(dtype), targets


def _check_entropy_of_large_logits(op, dtype, ent, ref_ent):
    """entropy finite and >= 0, and (z being exact) within the contract's atol / rtol on the entropy's own scale
    ``1 + |H|``: no error of the size of ``|z| * 2^-24``, which the contract's row scale would allow."""
    assert torch.isfinite(ent).all() and bool((ent >= 0).all()), ent.min()
    dev = contract.compare_outputs(contract.entry(op, dtype), "entropy", ent, ref_ent, 1.0 + ref_ent.abs())
    assert dev.ok, dev


@pytest.mark.parametrize(("dtype", "offset", "temperature"), LARGE_LOGITS)
def test_entropy_of_large_logits_is_accurate_and_never_negative(monkeypatch, dtype, offset, temperature):
    """The online entropy is accumulated relative to the running max (log s - b / s), so neither a logit
    offset of 30 / 0.05 = 600 (one-hot-like rows came out below 0), 1e6 (an error of ulp(1e6)) nor 3e38 (the
    sum of z * exp(z - m) overflowed: entropy -inf) costs it accuracy; the gradient stays within the contract.
    Vocab chunks of 96 columns: the state is moved to a larger max many times per row."""
    monkeypatch.setattr(reference_logprob, "VOCAB_CHUNK", 96)
    logits, targets = _large_logits(offset, temperature, dtype)
    x = logits.clone().requires_grad_(True)
    lp, ent = rlk.selected_logprob(x, targets, temperature=temperature, return_entropy=True)
    scale = _check("selected_logprob", dtype, lp, ent, logits, targets, temperature)
    _check_entropy_of_large_logits("selected_logprob", dtype, ent, _truth(logits, targets, temperature)[1])
    c1, c2 = torch.randn(2, targets.shape[0], generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (c1.float() * lp + c2.float() * ent).sum().backward()
    x64 = logits.double().requires_grad_(True)  # the fp64 op (autograd of _truth gives NaN next to -inf logits)
    ref_lp, ref_ent = rlk.selected_logprob(x64, targets, temperature=temperature, return_entropy=True)
    (c1 * ref_lp + c2 * ref_ent).sum().backward()
    e = contract.entry("selected_logprob", dtype)
    assert contract.compare_grad(e, "grad_logits", x.grad, x64.grad, float(scale.max())).ok


def _huge_logits(kind: str, op: str, n: int = 4, v: int = 7):
    """``(x, weight, targets)``: logits (``op == "selected_logprob"``) or hidden states and a head whose logits are
    all equal to 1e6, 3e38 or -3e38 (``"equal_1e6"``, ...) or ``1e5 +`` multiples of 1/8 in [-2, 2] (``"offset_1e5"``),
    every one exact in fp32 (and in the head's dot products)."""
    g = torch.Generator().manual_seed(11)
    targets = torch.randint(0, v, (n,), generator=g)
    if kind == "offset_1e5":
        spread = torch.randint(-16, 17, (v,), generator=g) / 8
        if op == "selected_logprob":
            return 1e5 + spread.expand(n, v).clone(), None, targets
        hidden = torch.zeros(n, 2)
        hidden[:, 0], hidden[:, 1] = 1000.0, 1.0
        return hidden, torch.stack([torch.full((v,), 100.0), spread], dim=1), targets
    value = {"equal_1e6": 1e6, "equal_3e38": 3e38, "equal_-3e38": -3e38}[kind]
    if op == "selected_logprob":
        return torch.full((n, v), value), None, targets
    return torch.full((n, 1), value / 2**64), torch.full((v, 1), 2.0**64), targets  # powers of two: exact products


# every backend of the op: the reference on this machine's device; Triton (the interpreter on the CPU) and rlk-cuda on
# a GPU (the tests below pick the device by what is visible)
ON_GPU = torch.cuda.is_available()
BACKENDS = [
    "reference",
    pytest.param("triton", marks=pytest.mark.gpu if ON_GPU else pytest.mark.triton_interpreter),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def _served(backend: str, op: str, device: torch.device, dtype: torch.dtype) -> None:
    """Skip where ``backend`` does not run ``op`` here (rlk-cuda's linear_logprob: 16-bit only)."""
    reason = rlk.core.dispatch.why_not(backend, rlk.core.abi.OPS[op], device, dtype)
    if reason is not None:
        pytest.skip(f"{backend} does not run {op} here: {reason}")


@pytest.mark.parametrize("kind", ["equal_1e6", "equal_3e38", "equal_-3e38", "offset_1e5"])
@pytest.mark.parametrize("op", ["selected_logprob", "linear_logprob"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_logprob_of_huge_logits_is_accurate_to_its_own_size(backend, op, kind):
    """The log-prob is computed relative to the row's max, ``(z_y - m) - log s``: with logits of 1e6 (or 3e38) in
    every column, or offset by 1e5, it is within the contract's atol / rtol of the fp64 truth on its own scale
    ``1 + |logprob|``. ``z_y - lse`` rounded lse at the magnitude of z: -1.9375 for -log 7 = -1.9459 at 1e6, 0 at
    3e38, errors of 3e-3 at 1e5 (which the row scale ``1 + |lse| + |z_y|`` hid)."""
    device = torch.device("cuda" if ON_GPU else "cpu")
    _served(backend, op, device, torch.float32)
    x, weight, targets = _huge_logits(kind, op)
    logits = x if weight is None else x.double() @ weight.double().T
    z = logits.double()
    truth = (z - z.amax(-1, keepdim=True)).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    x, targets = x.to(device), targets.to(device)
    weight = None if weight is None else weight.to(device)
    with rlk.use_backend(backend):
        if weight is None:
            lp, ent = rlk.selected_logprob(x, targets, return_entropy=True)
        else:
            lp, ent = rlk.linear_logprob(x, weight, targets, return_entropy=True)
    e = contract.entry(op, torch.float32)
    dev = contract.compare_outputs(e, "logprob", lp, truth, 1.0 + truth.abs())
    assert dev.ok, dev
    true_ent = -(z.softmax(-1) * (z - z.amax(-1, keepdim=True)).log_softmax(-1)).sum(-1)
    assert contract.compare_outputs(e, "entropy", ent, true_ent, 1.0 + true_ent.abs()).ok
    assert bool((lp <= 0).all())


@pytest.mark.parametrize(("offset", "temperature"), [(30.0, 0.05), (1e6, 1.0)])
def test_linear_logprob_entropy_of_large_logits(monkeypatch, offset, temperature):
    """linear_logprob with an offset column (hidden[..., 0] * weight[:, 0] = offset) and multiples of 1/4 in
    [-0.5, 0.5] elsewhere: every logit is ``offset`` plus a multiple of 1/16, which the fp32 dot products compute
    exactly (as z = x * 20), so the fp64 truth sees the same z. Vocab chunks of 96 columns, as above."""
    monkeypatch.setattr(reference_logprob, "VOCAB_CHUNK", 96)
    g = torch.Generator().manual_seed(10)
    hidden = torch.randint(-2, 3, (2, 9, 16), generator=g) / 4
    weight = torch.randint(-2, 3, (700, 16), generator=g) / 4
    hidden[..., 0], weight[:, 0] = (1000.0, offset / 1000) if offset > 1000 else (offset, 1.0)
    targets = torch.randint(0, 700, (2, 9), generator=g)
    targets[1, -2:] = -100
    lp, ent = rlk.linear_logprob(hidden, weight, targets, temperature=temperature, return_entropy=True)
    _check("linear_logprob", torch.float32, lp, ent, hidden @ weight.T, targets, temperature)
    ref_ent = _truth(hidden.double() @ weight.double().T, targets, temperature)[1]
    _check_entropy_of_large_logits("linear_logprob", torch.float32, ent.reshape(-1), ref_ent.reshape(-1))


def test_linear_logprob_matches_materialized_logits():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, 32, generator=g)
    weight = torch.randn(700, 32, generator=g) / 4
    targets = torch.randint(0, 700, (2, 9), generator=g)
    targets[1, -3:] = -100
    temperature = torch.tensor([[0.6], [1.3]])
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = rlk.linear_logprob(h, w, targets, temperature=temperature, return_entropy=True)
    assert lp.shape == ent.shape == targets.shape
    _check("linear_logprob", torch.float32, lp, ent, hidden @ weight.T, targets, temperature)
    c = torch.randn(2, 2, 9, generator=g)
    (c[0] * lp + c[1] * ent).sum().backward()
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref_lp, ref_ent, lse = _truth(h64 @ w64.T, targets, temperature)
    (c[0].double() * ref_lp + c[1].double() * ref_ent).sum().backward()
    e = contract.entry("linear_logprob", torch.float32)
    scale = float(contract.row_scale(ref_lp.detach(), lse.detach()).max())
    assert contract.compare_grad(e, "grad_hidden", h.grad, h64.grad, scale).ok
    assert contract.compare_grad(e, "grad_weight", w.grad, w64.grad, scale).ok


def test_fp64_gradcheck_both_ops():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 50, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (6,), generator=g)
    targets[2] = -100
    t = torch.rand(6, generator=g, dtype=torch.float64) + 0.5
    assert torch.autograd.gradcheck(
        lambda x: rlk.selected_logprob(x, targets, temperature=t, return_entropy=True), (logits,)
    )
    hidden = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda h, w: rlk.linear_logprob(h, w, targets, temperature=t, return_entropy=True), (hidden, weight)
    )


def test_only_entropy_used_and_only_one_input_needs_grad():
    logits, targets = _case(n=4, v=20)
    x = logits.clone().requires_grad_(True)
    _, ent = rlk.selected_logprob(x, targets, return_entropy=True)
    ent.sum().backward()
    x64 = logits.double().requires_grad_(True)
    _truth(x64, targets, 1.0)[1].sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    hidden, weight = torch.randn(4, 8), torch.randn(20, 8).requires_grad_(True)
    rlk.linear_logprob(hidden, weight, targets).sum().backward()
    assert weight.grad is not None and hidden.grad is None


def test_non_contiguous_and_int32_targets():
    logits, targets = _case(n=12, v=64)
    wide = torch.randn(64, 12).T  # non-contiguous view
    expected = rlk.selected_logprob(wide.contiguous(), targets)
    assert torch.equal(rlk.selected_logprob(wide, targets.to(torch.int32)), expected)
    hidden = torch.randn(16, 12)[::2]
    weight = torch.randn(12, 64).T
    ref = rlk.linear_logprob(hidden.contiguous(), weight.contiguous(), targets[:8])
    assert torch.equal(rlk.linear_logprob(hidden, weight, targets[:8]), ref)


def test_empty_batch():
    lp, ent = rlk.selected_logprob(
        torch.randn(0, 5, requires_grad=True), torch.zeros(0, dtype=torch.long), return_entropy=True
    )
    assert lp.shape == ent.shape == (0,)
    hidden = torch.randn(2, 0, 4, requires_grad=True)
    weight = torch.randn(5, 4, requires_grad=True)
    lp = rlk.linear_logprob(hidden, weight, torch.zeros(2, 0, dtype=torch.long))
    assert lp.shape == (2, 0)
    lp.sum().backward()
    assert hidden.grad.shape == hidden.shape and torch.all(weight.grad == 0)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: rlk.selected_logprob(torch.randn(3, 5), torch.zeros(4, dtype=torch.long)),
            ValueError,
            r"targets: expected shape \(3,\)",
        ),
        (
            lambda: rlk.selected_logprob(torch.randn(3, 5), torch.zeros(3)),
            TypeError,
            "targets: expected dtype int32 or int64, got torch.float32",
        ),
        (
            lambda: rlk.selected_logprob(torch.randn(3, 5).long(), torch.zeros(3, dtype=torch.long)),
            TypeError,
            "logits: expected dtype",
        ),
        (lambda: rlk.selected_logprob(torch.randn(3, 0), torch.zeros(3, dtype=torch.long)), ValueError, "V >= 1"),
        (
            lambda: rlk.selected_logprob(torch.randn(3, 5), torch.tensor([0, 5, 1])),
            ValueError,
            r"targets: values must lie in \[0, 5\) or equal ignore_index=-100; found 5 at flat position 1",
        ),
        (
            lambda: rlk.selected_logprob(torch.randn(3, 5), torch.tensor([0, -1, 1])),
            ValueError,
            "found -1 at flat position 1",
        ),
        (
            lambda: rlk.selected_logprob(torch.randn(3, 5), torch.zeros(3, dtype=torch.long), temperature=0.0),
            ValueError,
            "temperature: must be a finite number > 0, got 0.0",
        ),
        (
            lambda: rlk.selected_logprob(
                torch.randn(3, 5), torch.zeros(3, dtype=torch.long), temperature=torch.tensor([1.0, -2.0, 1.0])
            ),
            ValueError,
            "temperature: must be finite and > 0; found -2.0 at flat position 1",
        ),
        (
            lambda: rlk.selected_logprob(
                torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), temperature=torch.ones(2)
            ),
            ValueError,
            r"temperature: shape \(2,\) does not broadcast",
        ),
        (
            lambda: rlk.selected_logprob(torch.randn(3, 5), torch.zeros(3, dtype=torch.long), temperature="hot"),
            TypeError,
            "temperature: expected a float or a tensor",
        ),
        (
            lambda: rlk.linear_logprob(torch.randn(3, 4), torch.randn(5, 6), torch.zeros(3, dtype=torch.long)),
            ValueError,
            r"weight: expected shape \[V, H\] with V >= 1 and H = 4",
        ),
        (
            lambda: rlk.linear_logprob(torch.randn(3, 4), torch.randn(5, 4).half(), torch.zeros(3, dtype=torch.long)),
            TypeError,
            "weight: expected the dtype of hidden",
        ),
        (
            lambda: rlk.linear_logprob(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long)),
            ValueError,
            r"targets: expected shape \(3,\) \(hidden without its last dim\)",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_value_checks_can_be_switched_off(monkeypatch):
    logits, targets, temperature = torch.randn(3, 5), torch.tensor([0, 2, 1]), torch.full((3,), 0.5)
    checked = rlk.selected_logprob(logits, targets, temperature=temperature)
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")
    assert torch.equal(rlk.selected_logprob(logits, targets, temperature=temperature), checked)
    rlk.selected_logprob(logits, targets, temperature=-temperature)  # not checked: no error
    monkeypatch.setenv("RLK_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match="targets: values must lie"):
        rlk.selected_logprob(logits, torch.tensor([0, 7, 1]))


def test_device_mismatch_is_named():
    meta_targets = torch.zeros(3, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="targets: expected device cpu"):
        rlk.selected_logprob(torch.randn(3, 5), meta_targets)
    with pytest.raises(ValueError, match="weight: expected device cpu"):
        rlk.linear_logprob(torch.randn(3, 4), torch.randn(5, 4, device="meta"), torch.zeros(3, dtype=torch.long))


def test_opcheck_all_custom_ops():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 40, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (6,), generator=g)
    targets[1] = -100
    inv_t = torch.rand(6, generator=g) + 0.5
    for with_entropy in (False, True):
        torch.library.opcheck(torch.ops.rlk.selected_logprob_fwd.default, (logits, targets, inv_t, -100, with_entropy))
    hidden = torch.randn(6, 8, generator=g, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, requires_grad=True)
    for with_entropy in (False, True):
        torch.library.opcheck(
            torch.ops.rlk.linear_logprob_fwd.default, (hidden, weight, targets, inv_t, -100, with_entropy)
        )
    lse = torch.logsumexp(logits.detach() * inv_t[:, None], -1)
    ent = torch.rand(6, generator=g)
    grad = torch.randn(6, generator=g)
    torch.library.opcheck(
        torch.ops.rlk.selected_logprob_bwd.default,
        (logits.detach(), targets, inv_t, lse, ent, grad, grad, -100, "reference"),
    )
    torch.library.opcheck(
        torch.ops.rlk.linear_logprob_bwd.default,
        (hidden.detach(), weight.detach(), targets, inv_t, lse, ent, grad, grad, -100, True, True, "reference"),
    )


def test_torch_compile_fullgraph_matches_eager():
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(2, 5, 16, generator=g)
    weight = torch.randn(64, 16, generator=g)
    targets = torch.randint(0, 64, (2, 5), generator=g)
    temperature = torch.tensor([[0.8], [1.2]])

    def loss_fn(h, w):
        lp, ent = rlk.linear_logprob(h, w, targets, temperature=temperature, return_entropy=True)
        logits = h @ w.T
        lp2 = rlk.selected_logprob(logits, targets, temperature=temperature)
        return (lp + 0.1 * ent + lp2).sum()

    assert_compiled_matches_eager(loss_fn, (hidden, weight), backend="aot_eager")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compile_and_opcheck_on_the_gpu_backend(dtype):
    """The GPU path (the best backend rlk picks there) under opcheck and inductor fullgraph."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, 11, 64, generator=g).to("cuda", dtype)
    weight = (torch.randn(1000, 64, generator=g) / 8).to("cuda", dtype)
    targets = torch.randint(0, 1000, (3, 11), generator=g).cuda()
    targets[0, :4] = -100
    assert rlk.explain("linear_logprob", hidden, weight, targets).backend != "reference"
    inv_t = torch.full((33,), 1 / 0.7, device="cuda")
    torch.library.opcheck(
        torch.ops.rlk.linear_logprob_fwd.default,
        (hidden.reshape(33, 64).requires_grad_(), weight.requires_grad_(), targets.reshape(-1), inv_t, -100, True),
    )

    logits = (hidden.float() @ weight.float().T).to(dtype)

    def loss_fn(h, w, x):
        lp, ent = rlk.linear_logprob(h, w, targets, temperature=0.7, return_entropy=True)
        return (lp + 0.1 * ent).sum() + rlk.selected_logprob(x, targets, return_entropy=True)[1].sum()

    assert_compiled_matches_eager(loss_fn, (hidden, weight, logits))
