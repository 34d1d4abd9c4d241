"""``rlk.fused_linear_kl`` on the reference backend: math against an independent fp64 formula and its autograd
(materialized logits, ``log_softmax``), every divergence, temperature, ignore_index and reduction, the fused
gradient's scaling, argument errors, empty batches, NaN-free masked rows, extreme and -inf logits, memory
bounded by the tiles, torch.library integration. Tolerances come from the contract (``rlk.core.contract``)."""

from __future__ import annotations

import math

import pytest
import torch
from compile_check import assert_compiled_matches_eager
from torch.utils._python_dispatch import TorchDispatchMode

import rlk
from rlk.core import abi, contract, dispatch
from rlk.reference import distill as reference_distill

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DIVERGENCES = ["forward_kl", "reverse_kl", "jsd"]
REDUCTIONS = ["mean", "sum", "none"]
IGNORE = -100


def _plain(hs, ws, ht, wt, targets, divergence, beta=0.5, temperature=1.0, reduction="mean", ignore_index=IGNORE):
    """The divergence from materialized fp64 logits with plain torch ops (not rlk's reference); also the lse."""
    lead = hs.shape[:-1]
    if isinstance(temperature, torch.Tensor):
        temperature = torch.broadcast_to(temperature.double(), lead)[..., None]
    zq = (hs.double() @ ws.double().T) / temperature
    zp = (ht.double() @ wt.double().T) / temperature
    log_q, log_p = torch.log_softmax(zq, -1), torch.log_softmax(zp, -1)
    q, p = log_q.exp(), log_p.exp()
    if divergence == "jsd" and beta in (0.0, 1.0):
        divergence = "forward_kl" if beta == 0.0 else "reverse_kl"
    if divergence == "forward_kl":
        rows = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
    elif divergence == "reverse_kl":
        rows = torch.where(q > 0, q * (log_q - log_p), 0.0).sum(-1)
    else:
        log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1 - beta))
        rows = beta * torch.where(p > 0, p * (log_p - log_m), 0.0).sum(-1) + (1 - beta) * torch.where(
            q > 0, q * (log_q - log_m), 0.0
        ).sum(-1)
    valid = torch.ones(lead, dtype=torch.bool) if targets is None else targets != ignore_index
    rows = torch.where(valid, rows, 0.0)
    if reduction == "sum":
        loss = rows.sum()
    elif reduction == "mean":
        loss = rows.sum() / valid.sum().clamp(min=1)
    else:
        loss = rows
    return loss, torch.logsumexp(zq, -1).detach(), torch.logsumexp(zp, -1).detach(), valid


def _case(lead=(2, 9), hs=24, ht=40, v=150, dtype=torch.float32, seed=0, logit_std=3.0):
    """Student and teacher of different hidden sizes, logits of std ``logit_std``; a few rows ignored."""
    g = torch.Generator().manual_seed(seed)
    student_hidden = torch.randn(*lead, hs, generator=g)
    student_weight = torch.randn(v, hs, generator=g) * (logit_std / hs**0.5)
    teacher_hidden = torch.randn(*lead, ht, generator=g)
    teacher_weight = torch.randn(v, ht, generator=g) * (logit_std / ht**0.5)
    targets = torch.randint(0, v, lead, generator=g)
    targets.view(-1)[::5] = IGNORE
    return [t.to(dtype) for t in (student_hidden, student_weight, teacher_hidden, teacher_weight)] + [targets]


def _cotangent(loss: torch.Tensor, seed: int = 1) -> torch.Tensor:
    return torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check(dtype, loss, grads, inputs, targets, divergence, beta, temperature, reduction):
    """``loss`` and the (student_hidden, student_weight) gradients of ``sum(cotangent * loss)`` against the fp64
    plain formula's autograd, under the contract."""
    hs, ws, ht, wt = (t.double().requires_grad_(i < 2) for i, t in enumerate(inputs))
    ref, lse_q, lse_p, valid = _plain(hs, ws, ht, wt, targets, divergence, beta, temperature, reduction)
    (_cotangent(ref) * ref).sum().backward()
    e = contract.entry("fused_linear_kl", dtype)
    scale = contract.divergence_scale(lse_q, lse_p)
    if reduction == "none":
        dev = contract.compare_outputs(e, "loss", loss.reshape(-1), ref.detach().reshape(-1), scale.reshape(-1))
    else:
        reduced = torch.where(valid, scale, 0.0).sum()
        if reduction == "mean":
            reduced = reduced / valid.sum().clamp(min=1)
        dev = contract.compare_outputs(e, "loss", loss.reshape(1), ref.detach().reshape(1), reduced.reshape(1))
    assert dev.ok, dev
    max_scale = float(scale[valid].max()) if bool(valid.any()) else 1.0
    for name, got, want in (("grad_hidden", grads[0], hs.grad), ("grad_weight", grads[1], ws.grad)):
        assert got.dtype == dtype and got.shape == want.shape
        dev = contract.compare_grad(e, name, got, want, max_scale)
        assert dev.ok, dev
    return ref.detach()


def _run(inputs, targets, **kwargs):
    hs, ws = (t.clone().requires_grad_(True) for t in inputs[:2])
    loss = rlk.fused_linear_kl(hs, ws, *inputs[2:], targets, **kwargs)
    (_cotangent(loss).to(loss.dtype) * loss).sum().backward()
    return loss, (hs.grad, ws.grad)


# ---------------------------------------------------------------------------
# values and gradients against the plain formula
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_plain_formula_and_its_autograd(dtype, divergence, reduction):
    *inputs, targets = _case(dtype=dtype)
    temperature = torch.tensor([[0.7], [1.6]])  # one per sequence of [2, 9]
    loss, grads = _run(inputs, targets, divergence=divergence, beta=0.3, temperature=temperature, reduction=reduction)
    assert loss.dtype == torch.float32 and loss.shape == (targets.shape if reduction == "none" else ())
    _check(dtype, loss, grads, inputs, targets, divergence, 0.3, temperature, reduction)
    assert bool((grads[0][targets == IGNORE] == 0).all())
    if reduction == "none":
        assert bool((loss[targets == IGNORE] == 0).all()) and bool((loss[targets != IGNORE] > 0).all())


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_fp64_matches_autograd_tightly_and_passes_gradcheck(divergence):
    """The gradient formulas (forward: q - p; reverse: q ((log q - log p) - KL); jsd: (1 - beta) q ((log q - log m)
    - KL(q || m))), checked in fp64 against autograd of the plain formula to 1e-10 and by gradcheck."""
    *inputs, targets = _case(lead=(7,), hs=6, ht=5, v=40, dtype=torch.float64, seed=3)
    t = torch.rand(7, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.5
    for reduction in REDUCTIONS:
        loss, grads = _run(inputs, targets, divergence=divergence, beta=0.3, temperature=t, reduction=reduction)
        hs, ws = (x.clone().requires_grad_(True) for x in inputs[:2])
        ref = _plain(hs, ws, *inputs[2:], targets, divergence, 0.3, t, reduction)[0]
        (_cotangent(ref) * ref).sum().backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grads[0], hs.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grads[1], ws.grad, rtol=1e-10, atol=1e-12)
        hs, ws = (x.clone().requires_grad_(True) for x in inputs[:2])
        assert torch.autograd.gradcheck(
            lambda h, w, reduction=reduction: rlk.fused_linear_kl(
                h, w, *inputs[2:], targets, divergence=divergence, beta=0.3, temperature=t, reduction=reduction
            ),
            (hs, ws),
            fast_mode=True,
        )


def test_targets_none_counts_every_row_and_int32_targets_work():
    *inputs, targets = _case()
    everything = rlk.fused_linear_kl(*inputs, None, reduction="none")
    assert bool((everything > 0).all())
    masked = rlk.fused_linear_kl(*inputs, targets.to(torch.int32), reduction="none")
    assert torch.equal(masked, torch.where(targets != IGNORE, everything, 0.0))
    mean = rlk.fused_linear_kl(*inputs, None)
    torch.testing.assert_close(mean, everything.sum() / everything.numel())
    torch.testing.assert_close(rlk.fused_linear_kl(*inputs, targets), masked.sum() / (targets != IGNORE).sum())


def test_custom_ignore_index():
    *inputs, targets = _case()
    targets = torch.where(targets == IGNORE, 7, targets.clamp(max=6))
    loss = rlk.fused_linear_kl(*inputs, targets, ignore_index=7, reduction="none")
    assert bool((loss[targets == 7] == 0).all()) and bool((loss[targets != 7] > 0).all())


# ---------------------------------------------------------------------------
# conventions: beta, temperature, symmetry
# ---------------------------------------------------------------------------


def test_jsd_beta_ends_are_the_kls():
    """``beta = 0``: forward KL, ``beta = 1``: reverse KL (bit for bit: the same computation); in between the JSD
    goes to 0 at both ends (it is ~ beta KL(p || q) near 0 and ~ (1 - beta) KL(q || p) near 1)."""
    *inputs, targets = _case(dtype=torch.float64, logit_std=1.0)
    kl = {
        d: rlk.fused_linear_kl(*inputs, targets, divergence=d, reduction="none") for d in ("forward_kl", "reverse_kl")
    }
    assert torch.equal(
        rlk.fused_linear_kl(*inputs, targets, divergence="jsd", beta=0.0, reduction="none"), kl["forward_kl"]
    )
    assert torch.equal(
        rlk.fused_linear_kl(*inputs, targets, divergence="jsd", beta=1, reduction="none"), kl["reverse_kl"]
    )
    small = 1e-9  # the next terms are ~ small * chi^2(p || q) (chi^2(q || p) near 1): moderate logits keep it small
    near0 = rlk.fused_linear_kl(*inputs, targets, divergence="jsd", beta=small, reduction="none")
    near1 = rlk.fused_linear_kl(*inputs, targets, divergence="jsd", beta=1 - small, reduction="none")
    torch.testing.assert_close(near0 / small, kl["forward_kl"], rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(near1 / small, kl["reverse_kl"], rtol=1e-4, atol=1e-9)


def test_jsd_half_is_symmetric_and_kls_swap():
    """Swapping student and teacher: JSD(beta=0.5) stays, forward and reverse KL exchange (values)."""
    sh, sw, th, tw, targets = _case(ht=24)
    for d, swapped in (("jsd", "jsd"), ("forward_kl", "reverse_kl")):
        a = rlk.fused_linear_kl(sh, sw, th, tw, targets, divergence=d, reduction="none")
        b = rlk.fused_linear_kl(th, tw, sh, sw, targets, divergence=swapped, reduction="none")
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_temperature_divides_both_logits():
    """T folded into both heads gives the same divergence; a per-row tensor equals row-by-row floats."""
    sh, sw, th, tw, targets = _case(lead=(6,), dtype=torch.float64)
    for d in DIVERGENCES:
        with_t = rlk.fused_linear_kl(sh, sw, th, tw, targets, divergence=d, temperature=2.0, reduction="none")
        folded = rlk.fused_linear_kl(sh, sw / 2, th, tw / 2, targets, divergence=d, reduction="none")
        torch.testing.assert_close(with_t, folded, rtol=1e-12, atol=1e-14)
        t = torch.tensor([0.5, 1.0, 2.0, 3.0, 0.7, 1.3], dtype=torch.float64)
        per_row = rlk.fused_linear_kl(sh, sw, th, tw, targets, divergence=d, temperature=t, reduction="none")
        one_by_one = torch.stack(
            [
                rlk.fused_linear_kl(
                    sh[i : i + 1],
                    sw,
                    th[i : i + 1],
                    tw,
                    targets[i : i + 1],
                    divergence=d,
                    temperature=float(t[i]),
                    reduction="none",
                )[0]
                for i in range(6)
            ]
        )
        torch.testing.assert_close(per_row, one_by_one, rtol=1e-12, atol=1e-14)


def test_identical_student_and_teacher_give_zero():
    sh, sw, _, _, targets = _case(lead=(9,))
    for d in DIVERGENCES:
        loss = rlk.fused_linear_kl(sh, sw, sh, sw, targets, divergence=d, reduction="none")
        assert float(loss.abs().max()) < 1e-5, (d, loss)


# ---------------------------------------------------------------------------
# the fused gradient (mean / sum): made in the forward, scaled in the backward
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_gradient_scales_with_the_upstream_gradient(dtype, reduction):
    """The forward computes the gradients of the scalar loss; the backward multiplies them by the upstream
    gradient (x4: exact in every dtype, so bit for bit), and a second backward (retain_graph) sees them intact."""
    *inputs, targets = _case(dtype=dtype)
    grads = []
    for factor in (1.0, 4.0):
        hs, ws = (t.clone().requires_grad_(True) for t in inputs[:2])
        loss = rlk.fused_linear_kl(hs, ws, *inputs[2:], targets, divergence="jsd", reduction=reduction)
        (factor * loss).backward(retain_graph=True)
        grads.append((hs.grad.clone(), ws.grad.clone()))
        (factor * loss).backward()
        assert torch.equal(hs.grad, 2 * grads[-1][0]) and torch.equal(ws.grad, 2 * grads[-1][1])
    assert torch.equal(grads[1][0], 4 * grads[0][0]) and torch.equal(grads[1][1], 4 * grads[0][1])


def test_sum_gradients_equal_the_recomputed_backward():
    """The forward's fused gradient (coefficient 1 per row) and the recomputing backward of reduction='none' with
    an upstream gradient of ones are the same computation: equal bit for bit."""
    *inputs, targets = _case()
    for d in DIVERGENCES:
        grads = []
        for reduction in ("sum", "none"):
            hs, ws = (t.clone().requires_grad_(True) for t in inputs[:2])
            rlk.fused_linear_kl(hs, ws, *inputs[2:], targets, divergence=d, reduction=reduction).sum().backward()
            grads.append((hs.grad, ws.grad))
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_only_the_needed_gradient_and_no_grad_mode():
    *inputs, targets = _case()
    ws = inputs[1].clone().requires_grad_(True)
    rlk.fused_linear_kl(inputs[0], ws, *inputs[2:], targets).backward()
    hs = inputs[0].clone().requires_grad_(True)
    rlk.fused_linear_kl(hs, inputs[1], *inputs[2:], targets).backward()
    both = [t.clone().requires_grad_(True) for t in inputs[:2]]
    rlk.fused_linear_kl(*both, *inputs[2:], targets).backward()
    assert torch.equal(ws.grad, both[1].grad) and torch.equal(hs.grad, both[0].grad)
    with torch.no_grad():
        loss = rlk.fused_linear_kl(inputs[0].requires_grad_(True), *inputs[1:], targets)
    assert not loss.requires_grad
    inputs[0].requires_grad_(False)


def test_teacher_is_frozen():
    """A teacher tensor that requires grad is refused with the argument's name; detached or under no_grad it runs."""
    sh, sw, th, tw, targets = _case()
    for name in ("teacher_hidden", "teacher_weight"):
        args = {"teacher_hidden": th, "teacher_weight": tw}
        args[name] = args[name].clone().requires_grad_(True)
        with pytest.raises(ValueError, match=f"{name}: requires grad, but rlk.fused_linear_kl treats the teacher"):
            rlk.fused_linear_kl(sh, sw, args["teacher_hidden"], args["teacher_weight"], targets)
        with torch.no_grad():
            rlk.fused_linear_kl(sh, sw, args["teacher_hidden"], args["teacher_weight"], targets)
        rlk.fused_linear_kl(sh, sw, args["teacher_hidden"].detach(), args["teacher_weight"].detach(), targets)


# ---------------------------------------------------------------------------
# masked rows, empty batches, extreme and -inf logits
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_nan_in_ignored_rows_never_reaches_the_results(divergence, reduction):
    """Padding rows full of NaN (student and teacher) are ignored: finite loss, zero gradient rows, and the
    weight gradient equals the one without those rows."""
    *inputs, targets = _case()
    dirty = [t.clone() for t in inputs]
    ignored = targets == IGNORE
    dirty[0][ignored] = math.nan
    dirty[2][ignored] = math.nan
    loss, (gh, gw) = _run(dirty, targets, divergence=divergence, reduction=reduction)
    clean_loss, (clean_gh, clean_gw) = _run(inputs, targets, divergence=divergence, reduction=reduction)
    assert bool(torch.isfinite(loss).all()) and bool(torch.isfinite(gh).all()) and bool(torch.isfinite(gw).all())
    assert bool((gh[ignored] == 0).all())
    assert torch.equal(loss, clean_loss) and torch.equal(gh, clean_gh) and torch.equal(gw, clean_gw)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_row_ignored(reduction):
    """The mean over no rows is 0 (not NaN), and so are the gradients."""
    *inputs, targets = _case()
    loss, (gh, gw) = _run(inputs, torch.full_like(targets, IGNORE), divergence="jsd", reduction=reduction)
    assert bool((loss == 0).all()) and bool((gh == 0).all()) and bool((gw == 0).all())


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_empty_batch(lead, reduction):
    hs = torch.randn(*lead, 4, requires_grad=True)
    ws = torch.randn(5, 4, requires_grad=True)
    loss = rlk.fused_linear_kl(
        hs, ws, torch.randn(*lead, 3), torch.randn(5, 3), torch.zeros(lead, dtype=torch.long), reduction=reduction
    )
    assert loss.shape == (lead if reduction == "none" else ())
    assert bool((loss == 0).all())
    loss.sum().backward()
    assert hs.grad.shape == hs.shape and ws.grad is not None and bool((ws.grad == 0).all())


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_extreme_logits(monkeypatch, divergence):
    """Rows whose student or teacher logits reach +-1e4 (probabilities underflow to 0 next to a log of -2e4):
    no overflow, no NaN, and within the contract (whose row scale grows with |lse|). Vocab chunks of 32 columns,
    so the running maxes move many times per row."""
    monkeypatch.setattr(reference_distill, "VOCAB_CHUNK", 32)
    *inputs, targets = _case(lead=(12,))
    inputs[0][0] *= 3000  # student logits ~ +-1e4
    inputs[2][1] *= 3000  # teacher logits ~ +-1e4
    inputs[0][2] *= 3000
    inputs[2][2] *= 3000  # both
    targets[:3] = 0
    loss, grads = _run(inputs, targets, divergence=divergence, reduction="none")
    assert bool(torch.isfinite(loss).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    ref = _check(torch.float32, loss, grads, inputs, targets, divergence, 0.5, 1.0, "none")
    assert float(ref[:3].min()) > 0.5  # the extreme rows do diverge


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_minus_inf_teacher_logits(divergence):
    """Teacher logits of -inf (a banned token: p = 0, log p = -inf) give a finite forward KL and JSD and finite
    gradients, no 0 * inf. (KL(q || p) is then +inf, as it should be.)"""
    sh, sw, th, tw, targets = _case(lead=(9,), dtype=torch.float64)
    th[:, 0] = 1.0
    tw[:7] = 0.0
    tw[:7, 0] = -math.inf  # teacher logits of the first 7 tokens: -inf in every row
    loss, grads = _run([sh, sw, th, tw], targets, divergence=divergence, reduction="none")
    assert bool(torch.isfinite(loss).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    _check(
        torch.float32, loss.float(), [g.float() for g in grads], [sh, sw, th, tw], targets, divergence, 0.5, 1.0, "none"
    )
    reverse = rlk.fused_linear_kl(sh, sw, th, tw, targets, divergence="reverse_kl", reduction="none")
    assert bool((reverse[targets != IGNORE] == math.inf).all())


# ---------------------------------------------------------------------------
# memory: the reference never builds anything of size [N, V]
# ---------------------------------------------------------------------------


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_reference_memory_is_bounded_by_its_tiles(monkeypatch, divergence):
    """With 8-row x 32-column tiles, no tensor the reference primitives create (forward, fused gradient, recomputing
    backward) is larger than the inputs and gradients: nothing of size N x V = 40 x 200."""
    monkeypatch.setattr(reference_distill, "ROW_CHUNK", 8)
    monkeypatch.setattr(reference_distill, "VOCAB_CHUNK", 32)
    n, v, h = 40, 200, 16
    sh, sw, th, tw, targets = _case(lead=(n,), hs=h, ht=h, v=v)
    dt = torch.float32
    loss, stats = torch.empty(n, dtype=dt), torch.empty(3, n, dtype=dt)
    gh, gw = torch.empty_like(sh), torch.empty_like(sw)
    inv_t, coef = torch.ones(n), torch.ones(n)
    with _LargestTensor() as mode:
        reference_distill.fused_linear_kl_fwd(
            sh, sw, th, tw, targets, inv_t, IGNORE, divergence, 0.5, loss, stats, coef, gh, gw
        )
        reference_distill.fused_linear_kl_bwd(
            sh, sw, th, tw, targets, inv_t, stats, coef, IGNORE, divergence, 0.5, gh, gw
        )
    assert mode.largest <= max(v * h, 8 * 32), mode.largest
    assert v * h < n * v


# ---------------------------------------------------------------------------
# bad arguments: each error names the argument
# ---------------------------------------------------------------------------


def _args(**changes):
    sh, sw, th, tw, targets = _case(lead=(3,), hs=4, ht=5, v=6)
    args = {"student_hidden": sh, "student_weight": sw, "teacher_hidden": th, "teacher_weight": tw, "targets": targets}
    kwargs = {k: changes.pop(k) for k in list(changes) if k not in args}
    args.update(changes)
    return lambda: rlk.fused_linear_kl(*args.values(), **kwargs)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (_args(student_hidden=torch.ones(3, 4, dtype=torch.long)), TypeError, "student_hidden: expected dtype"),
        (_args(student_hidden=[1.0]), TypeError, "student_hidden: expected a torch.Tensor"),
        (_args(teacher_weight=torch.ones(6, 5, dtype=torch.int32)), TypeError, "teacher_weight: expected dtype"),
        (_args(student_hidden=torch.randn(3, 0)), ValueError, r"student_hidden: expected shape \[..., Hs\]"),
        (
            _args(student_weight=torch.randn(6, 5)),
            ValueError,
            r"student_weight: expected shape \[V, Hs\] with V >= 1 and Hs = 4",
        ),
        (_args(student_weight=torch.randn(0, 4)), ValueError, r"student_weight: expected shape \[V, Hs\]"),
        (
            _args(teacher_hidden=torch.randn(2, 5)),
            ValueError,
            r"teacher_hidden: expected shape \[3, Ht\] \(student_hidden's leading shape\)",
        ),
        (_args(teacher_weight=torch.randn(7, 5)), ValueError, r"teacher_weight: expected shape \[V, Ht\] = \[6, 5\]"),
        (_args(teacher_weight=torch.randn(6, 4)), ValueError, r"teacher_weight: expected shape \[V, Ht\] = \[6, 5\]"),
        (
            _args(teacher_hidden=torch.randn(3, 5).double()),
            TypeError,
            r"teacher_hidden: expected the dtype of student_hidden \(torch.float32\)",
        ),
        (_args(student_weight=torch.randn(6, 4).half()), TypeError, "student_weight: expected the dtype"),
        (_args(teacher_weight=torch.randn(6, 5, device="meta")), ValueError, "teacher_weight: expected device cpu"),
        (_args(targets=torch.zeros(4, dtype=torch.long)), ValueError, r"targets: expected shape \(3,\)"),
        (_args(targets=torch.zeros(3)), TypeError, "targets: expected dtype int32 or int64"),
        (_args(divergence="kl"), ValueError, "divergence: expected one of 'forward_kl', 'reverse_kl', 'jsd'"),
        (_args(reduction="batchmean"), ValueError, "reduction: expected one of 'mean', 'sum', 'none'"),
        (_args(beta=1.5), ValueError, r"beta: must be a finite number in \[0, 1\]"),
        (_args(beta=-0.1), ValueError, r"beta: must be a finite number in \[0, 1\]"),
        (_args(beta=float("nan")), ValueError, "beta: must be a finite number"),
        (_args(beta="half"), TypeError, "beta: expected a number"),
        (_args(ignore_index=1.5), TypeError, "ignore_index: expected an integer"),
        (_args(temperature=0.0), ValueError, "temperature: must be a finite number > 0"),
        (
            _args(temperature=torch.tensor([1.0, -1.0, 1.0])),
            ValueError,
            "temperature: must be finite and > 0; found -1.0 at flat position 1",
        ),
        (_args(temperature=torch.ones(2)), ValueError, r"temperature: shape \(2,\) does not broadcast"),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ---------------------------------------------------------------------------
# torch.library integration
# ---------------------------------------------------------------------------


def test_opcheck_custom_ops():
    sh, sw, th, tw, targets = _case(lead=(6,), hs=8, ht=5, v=40)
    inv_t = torch.rand(6, generator=torch.Generator().manual_seed(5)) + 0.5
    for divergence, reduction, tg in (
        ("forward_kl", "mean", targets),
        ("reverse_kl", "none", None),
        ("jsd", "sum", None),
        ("jsd", "none", targets),
    ):
        torch.library.opcheck(
            torch.ops.rlk.fused_linear_kl_fwd.default,
            (
                sh.clone().requires_grad_(),
                sw.clone().requires_grad_(),
                th,
                tw,
                tg,
                inv_t,
                IGNORE,
                divergence,
                0.3,
                reduction,
                True,
                True,
                True,
            ),
        )
    stats = torch.empty(3, 6)
    loss = torch.empty(6)
    reference_distill.fused_linear_kl_fwd(
        sh, sw, th, tw, targets, inv_t, IGNORE, "jsd", 0.3, loss, stats, None, None, None
    )
    torch.library.opcheck(
        torch.ops.rlk.fused_linear_kl_bwd.default,
        (sh, sw, th, tw, targets, inv_t, stats, torch.randn(6), IGNORE, "jsd", 0.3, True, True, "reference"),
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph_matches_eager(reduction):
    sh, sw, th, tw, targets = _case(lead=(2, 5), hs=16, ht=12, v=64)
    temperature = torch.tensor([[0.8], [1.2]])

    def loss_fn(h, w):
        loss = rlk.fused_linear_kl(
            h, w, th, tw, targets, divergence="jsd", beta=0.4, temperature=temperature, reduction=reduction
        )
        return loss.sum() * 1.5

    assert_compiled_matches_eager(loss_fn, (sh, sw), backend="aot_eager")


def _gpu_backends() -> list[str]:
    """The GPU backends that serve this op on the current GPU (cuda: rlk-cuda's Hopper kernels; triton)."""
    device = torch.device("cuda", torch.cuda.current_device())
    op = abi.OPS["fused_linear_kl"]
    return [name for name in ("cuda", "triton") if dispatch.why_not(name, op, device, torch.bfloat16) is None]


@pytest.mark.gpu
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_gpu_backend_under_compile_and_opcheck(divergence):
    """On a GPU, each GPU backend that serves the op (rlk-cuda on Hopper, Triton) under opcheck and inductor
    fullgraph; rlk picks the first of them."""
    g = torch.Generator().manual_seed(7)
    sh = torch.randn(3, 11, 64, generator=g).to("cuda", torch.bfloat16)
    sw = (torch.randn(1000, 64, generator=g) / 8).to("cuda", torch.bfloat16)
    th = torch.randn(3, 11, 96, generator=g).to("cuda", torch.bfloat16)
    tw = (torch.randn(1000, 96, generator=g) / 8).to("cuda", torch.bfloat16)
    targets = torch.randint(0, 1000, (3, 11), generator=g).cuda()
    targets[0, :4] = IGNORE
    backends = _gpu_backends()
    assert "triton" in backends and rlk.explain("fused_linear_kl", sh).backend == backends[0]
    inv_t = torch.full((33,), 1 / 0.7, device="cuda")
    for backend in backends:
        with dispatch.use_backend(backend):
            torch.library.opcheck(
                torch.ops.rlk.fused_linear_kl_fwd.default,
                (
                    sh.reshape(33, 64).requires_grad_(),
                    sw.requires_grad_(),
                    th.reshape(33, 96),
                    tw,
                    targets.reshape(-1),
                    inv_t,
                    IGNORE,
                    divergence,
                    0.5,
                    "mean",
                    True,
                    True,
                    False,
                ),
            )

            def loss_fn(h, w):
                return rlk.fused_linear_kl(h, w, th, tw, targets, divergence=divergence, temperature=0.7)

            assert_compiled_matches_eager(loss_fn, (sh, sw))
