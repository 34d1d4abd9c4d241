"""The Hopper ``fused_linear_kl`` primitives (``rlk_cuda.distill``) on an H100 / H200: the loss and both gradients of
the three divergences against the reference run in fp64 (contract tolerances) on awkward shapes, the fused forward's
gradients against the recomputing backward bit for bit, a row's loss and ``grad_hidden`` bitwise the same in any
batch at V = 151936, a deterministic ``grad_weight``, dispatch, and the public op through autograd. Needs a GPU
(marker ``gpu``).

Where the Hopper kernels cannot run this module collects no test, unless ``RLK_REQUIRE_WGMMA=1`` (then every test
fails saying why), like ``test_linear_logprob_wgmma.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("rlk_cuda", reason="rlk-cuda is not installed (bash ci/build_cuda.sh)")

from test_linear_logprob_cuda import IGNORE, REQUIRE_WGMMA, hopper_module, hopper_problem, probe_placements  # noqa: E402  (the sibling test module's helpers)

import rlk  # noqa: E402
from rlk.core import contract, dispatch
from rlk.reference import distill as ref  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
DIVERGENCES = ["forward_kl", "reverse_kl", "jsd"]
BETA = 0.3
PROBLEM = hopper_problem("problem", "distill")
__test__ = PROBLEM is None or REQUIRE_WGMMA


def _ck():
    return hopper_module(PROBLEM, "the Hopper fused_linear_kl kernels", "distill")


def make_inputs(n, v, hs, ht, dtype, seed=0, extreme=False):
    """Student / teacher hidden states and heads (logits of std ~2), targets with row 1 ignored, per-row inv_t in
    [0.5, 2], per-row gradient coefficients; ``extreme``: rows 2 (student) and 3 (teacher) reach logits ~1e4."""
    g = torch.Generator().manual_seed(seed)
    sh = torch.randn(n, hs, generator=g)
    sw = torch.randn(v, hs, generator=g) * (2 / hs**0.5)
    th = torch.randn(n, ht, generator=g)
    tw = torch.randn(v, ht, generator=g) * (2 / ht**0.5)
    targets = torch.randint(0, v, (n,), generator=g)
    if n >= 3:
        targets[1] = IGNORE
    if extreme and n >= 4:
        sh[2] *= 3000
        th[3] *= 3000
    inv_t = torch.rand(n, generator=g) * 1.5 + 0.5
    coef = torch.randn(n, generator=g)
    return ([t.to(dtype).cuda() for t in (sh, sw, th, tw)], targets.cuda(), inv_t.cuda(), coef.cuda())


def run_fwd(impl, data, targets, inv_t, divergence, coef=None):
    """``impl.fused_linear_kl_fwd``: ``(loss, stats, grad_hidden, grad_weight)`` (gradients None without ``coef``)."""
    n = data[0].shape[0]
    dt = torch.float64 if data[0].dtype == torch.float64 else torch.float32
    loss, stats = torch.empty(n, dtype=dt, device="cuda"), torch.empty(3, n, dtype=dt, device="cuda")
    gh = torch.empty_like(data[0]) if coef is not None else None
    gw = torch.empty_like(data[1]) if coef is not None else None
    impl.fused_linear_kl_fwd(
        *data,
        targets,
        inv_t.to(dt),
        IGNORE,
        divergence,
        BETA,
        loss,
        stats,
        None if coef is None else coef.to(dt),
        gh,
        gw,
    )
    return loss, stats, gh, gw


def run_bwd(impl, data, targets, inv_t, stats, grad_loss, divergence):
    gh, gw = torch.empty_like(data[0]), torch.empty_like(data[1])
    impl.fused_linear_kl_bwd(
        *data, targets, inv_t.to(stats.dtype), stats, grad_loss.to(stats.dtype), IGNORE, divergence, BETA, gh, gw
    )
    return gh, gw


def check(dtype, loss, grads, truth_loss, truth_stats, truth_grads, targets):
    """The per-row loss and the gradients under the contract; ignored rows exactly 0."""
    e = contract.entry("fused_linear_kl", dtype)
    scale = contract.divergence_scale(truth_stats[0], truth_stats[1])
    valid = targets != IGNORE
    dev = contract.compare_outputs(e, "loss", loss, truth_loss, scale)
    print(f"RATIO loss {dtype} {dev}")
    assert dev.ok, dev
    assert bool((loss[~valid] == 0).all())
    max_scale = float(scale[valid].max())
    for name, got, want in zip(("grad_hidden", "grad_weight"), grads, truth_grads):
        assert got.dtype == dtype
        dev = contract.compare_grad(e, name, got, want, max_scale)
        print(f"RATIO {name} {dtype} {dev}")
        assert dev.ok, dev
    assert bool((grads[0][~valid] == 0).all())


def _zero_ignored(data, targets):
    """The student's hidden rows of ignored targets zeroed, as the op layer passes them when grad_weight is wanted."""
    sh = torch.where((targets != IGNORE)[:, None], data[0], 0)
    return [sh, *data[1:]]


# ----------------------------------------------------------------------------------------------
# values and gradients
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize(
    "shape",
    [
        (37, 150, 24, 40),  # one ragged row tile, one vocab chunk narrower than a GEMM tile, Hs != Ht
        (300, 9000, 136, 72),  # three row tiles, three chunks (the last 808 columns), ragged K steps
        (129, 4100, 30, 44),  # Hs % 8 != 0 (padded copies), a last chunk of 4 columns
    ],
)
def test_matches_reference(shape, divergence, dtype):
    """The fused forward (gradient coefficients ``coef``) and the recomputing backward (upstream ``coef ** 2``)
    against the fp64 reference, with an ignored row, per-row temperatures and rows of logits ~1e4."""
    ck = _ck()
    n, v, hs, ht = shape
    data, targets, inv_t, coef = make_inputs(n, v, hs, ht, dtype, extreme=True)
    data = _zero_ignored(data, targets)
    loss, stats, gh, gw = run_fwd(ck, data, targets, inv_t, divergence, coef)
    f64 = [t.double() for t in data]
    t_loss, t_stats, t_gh, t_gw = run_fwd(ref, f64, targets, inv_t, divergence, coef)
    check(dtype, loss, (gh, gw), t_loss, t_stats, (t_gh, t_gw), targets)
    upstream = coef * coef
    bgh, bgw = run_bwd(ck, data, targets, inv_t, stats, upstream, divergence)
    t_bgh, t_bgw = run_bwd(ref, f64, targets, inv_t, t_stats, upstream, divergence)
    check(dtype, loss, (bgh, bgw), t_loss, t_stats, (t_bgh, t_bgw), targets)
    # the fused forward's gradients are the backward's with the same coefficients, bit for bit
    fgh, fgw = run_bwd(ck, data, targets, inv_t, stats, coef, divergence)
    assert torch.equal(fgh, gh) and torch.equal(fgw, gw)


def test_without_targets_and_minus_inf_teacher_logits():
    """``targets = None`` (every row counts) and teacher logits of -inf over whole chunks and scattered columns:
    finite results within the contract."""
    ck = _ck()
    data, targets, inv_t, coef = make_inputs(40, 9000, 32, 32, torch.bfloat16)
    data[2][:, 0] = 1.0
    banned = torch.cat([torch.arange(4200), torch.arange(5000, 9000, 7)]).cuda()
    tw = data[3].clone()
    tw[banned] = 0
    tw[banned, 0] = -math.inf
    data[3] = tw
    for divergence in ("forward_kl", "jsd"):
        loss, stats, gh, gw = run_fwd(ck, data, None, inv_t, divergence, coef)
        assert bool(torch.isfinite(loss).all() and torch.isfinite(gh).all() and torch.isfinite(gw).all())
        assert bool((loss > 0).all())
        t_loss, t_stats, t_gh, t_gw = run_fwd(ref, [t.double() for t in data], None, inv_t, divergence, coef)
        check(torch.bfloat16, loss, (gh, gw), t_loss, t_stats, (t_gh, t_gw), torch.zeros_like(targets))


# ----------------------------------------------------------------------------------------------
# invariance and determinism
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_batch_invariant_at_full_vocab(divergence):
    """V = 151936 bf16: row 5's loss, stats and ``grad_hidden`` (coefficient 1: the ``sum`` reduction) are the same
    bits alone, in batches of 7, 133 and 1024 at the first, middle and last position; ``grad_weight`` is
    deterministic run to run."""
    ck = _ck()
    probe = 5
    data, targets, inv_t, _ = make_inputs(1024, 151936, 128, 64, torch.bfloat16, seed=3)
    targets = targets.clone()
    targets[probe] = 7
    ones = torch.ones(1024, device="cuda")
    alone = run_fwd(
        ck,
        [data[0][probe : probe + 1], data[1], data[2][probe : probe + 1], data[3]],
        targets[probe : probe + 1],
        inv_t[probe : probe + 1],
        divergence,
        ones[:1],
    )
    for batch, position, index in probe_placements(probe):
        sub = [data[0][index], data[1], data[2][index], data[3]]
        got = run_fwd(ck, sub, targets[index], inv_t[index], divergence, ones[:batch])
        assert torch.equal(got[0][position], alone[0][0]), (batch, position)
        assert torch.equal(got[1][:, position], alone[1][:, 0]), (batch, position)
        assert torch.equal(got[2][position], alone[2][0]), (batch, position)
    first = run_fwd(ck, data, targets, inv_t, divergence, ones)
    again = run_fwd(ck, data, targets, inv_t, divergence, ones)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


# ----------------------------------------------------------------------------------------------
# dispatch and the public op
# ----------------------------------------------------------------------------------------------


def test_dispatch_and_public_op():
    """16-bit inputs run on cuda (fp32 falls through); ``rlk.fused_linear_kl`` with ``mean`` and ``none`` through
    autograd on this backend against the fp64 reference."""
    device = torch.device("cuda", torch.cuda.current_device())
    assert dispatch.decide("fused_linear_kl", device, torch.bfloat16).backend == "cuda"
    assert dispatch.decide("fused_linear_kl", device, torch.float32).backend != "cuda"
    data, targets, inv_t, _ = make_inputs(200, 5000, 64, 96, torch.bfloat16, seed=4)
    temperature = 1.0 / inv_t
    e = contract.entry("fused_linear_kl", torch.bfloat16)
    _, t_stats, _, _ = run_fwd(ref, [t.double() for t in data], targets, inv_t, "reverse_kl")
    scale = contract.divergence_scale(t_stats[0], t_stats[1])
    max_scale = float(scale[targets != IGNORE].max())
    for reduction in ("mean", "none"):
        results = []
        for dtype, backend in ((torch.bfloat16, "cuda"), (torch.float64, "reference")):
            sh = data[0].detach().to(dtype).requires_grad_()
            sw = data[1].detach().to(dtype).requires_grad_()
            with dispatch.use_backend(backend):
                loss = rlk.fused_linear_kl(
                    sh,
                    sw,
                    data[2].to(dtype),
                    data[3].to(dtype),
                    targets,
                    divergence="reverse_kl",
                    temperature=temperature,
                    reduction=reduction,
                )
                loss.sum().backward()
            results.append((loss.detach(), sh.grad, sw.grad))
        (loss, gh, gw), (t_loss, t_gh, t_gw) = results
        assert loss.dtype == torch.float32
        if reduction == "mean":  # one "row": the mean, against the mean scale
            loss, t_loss, row_scale = loss.reshape(1), t_loss.reshape(1), scale.mean().reshape(1)
        else:
            row_scale = scale
        dev = contract.compare_outputs(e, "loss", loss, t_loss, row_scale)
        assert dev.ok, (reduction, dev)
        for name, got, want in (("grad_hidden", gh, t_gh), ("grad_weight", gw, t_gw)):
            dev = contract.compare_grad(e, name, got, want, max_scale)
            assert dev.ok, (reduction, name, dev)
