"""CUDA rms_norm primitives against the reference run in fp64 (contract tolerances), bitwise batch
invariance, determinism of the weight gradient, and the public op on the cuda backend. Needs a GPU. The same
tests run on the rocm backend from packages/rlk-rocm/tests/test_norm_rocm.py (``BACKEND``).

Each contract check prints ``RATIO <test> <output> <dtype> <worst/allowed>`` (``pytest -s``).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import rlk
from rlk.core import contract, dispatch
from rlk.ops.norm import output_dtype, rms_norm
from rlk.reference import norm as ref

# The backend under test. packages/rlk-rocm/tests loads this file with BACKEND = "rocm" set before it runs
# (_shared_tests.py there), so the same tests cover rlk-rocm.
BACKEND = globals().get("BACKEND", "cuda")
pytest.importorskip(f"rlk_{BACKEND}", reason=f"rlk-{BACKEND} is not installed (bash ci/build_{BACKEND}.sh)")

pytestmark = pytest.mark.gpu
if BACKEND == "rocm":
    # On an NVIDIA GPU (a CUDA torch) these are skipped: rlk-rocm serves AMD GPUs.
    pytestmark = [pytestmark, pytest.mark.rocm]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


def _native():
    return importlib.import_module(f"rlk_{BACKEND}.norm")


def make_inputs(
    n: int,
    h: int,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None,
    gemma: bool,
    residual: bool,
    seed: int = 0,
    on_gpu: bool = False,
):
    """x, residual ~ N(0, 1) (row 0 scaled by 100, row 1 by 1e-3 when N >= 2), weight ~ 1 + 0.1 N(0, 1)
    (0.1 N(0, 1) for Gemma), grad_y ~ N(0, 1) in y's dtype, grad_residual ~ N(0, 1) (when fused)."""
    weight_dtype = weight_dtype or dtype
    g = torch.Generator(device="cuda" if on_gpu else "cpu").manual_seed(seed)
    x = torch.randn(n, h, generator=g, device=g.device)
    if n >= 2:
        x[0] *= 100
        x[1] *= 1e-3
    w = torch.randn(h, generator=g, device=g.device) * 0.1 + (0.0 if gemma else 1.0)
    r = torch.randn(n, h, generator=g, device=g.device) if residual else None
    gy = torch.randn(n, h, generator=g, device=g.device)
    gres = torch.randn(n, h, generator=g, device=g.device) if residual else None
    ydt = output_dtype(dtype, weight_dtype, gemma)

    def to(t, dt):
        return None if t is None else t.to(dt).to("cuda")

    return to(x, dtype), to(w, weight_dtype), to(r, dtype), to(gy, ydt), to(gres, dtype)


def run(impl, x, w, r, gy, gres, gemma: bool, want_dw: bool = True, eps: float = EPS):
    """Forward and backward of ``impl``; the backward takes the forward's s and rstd."""
    n, h = x.shape
    sdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.empty(n, h, dtype=gy.dtype, device=x.device)
    s = torch.empty_like(x) if r is not None else None
    rstd = torch.empty(n, dtype=sdt, device=x.device)
    impl.rms_norm_fwd(x, w, r, eps, gemma, y, s, rstd)
    s_in = s if r is not None else x
    gin = torch.empty_like(x)
    gw = torch.empty_like(w) if want_dw else None
    impl.rms_norm_bwd(gy, s_in, w, rstd, gemma, gres, gin, gw)
    out = {"y": y, "rstd": rstd, "grad_input": gin}
    if s is not None:
        out["s"] = s
    if gw is not None:
        out["grad_weight"] = gw
    return out


def check_against_reference(name, x, w, r, gy, gres, gemma: bool) -> None:
    got = run(_native(), x, w, r, gy, gres, gemma)
    # Ground truth: the fp64 reference on the same values. The backward's input s is the kernel's s
    # (rounded to x.dtype), which is what the backward receives.
    s = got.get("s", x)
    truth_fwd = run(ref, x.double(), w.double(), None if r is None else r.double(), gy.double(), None, gemma)
    truth_bwd = run(ref, s.double(), w.double(), None, gy.double(), None if gres is None else gres.double(), gemma)
    e = contract.entry("rms_norm", x.dtype)
    checks = [("y", got["y"], truth_fwd["y"]), ("rstd", got["rstd"], truth_fwd["rstd"])]
    if r is not None:
        checks.append(("s", got["s"], truth_fwd["s"]))
    for key, value, truth in checks:
        dev = contract.compare_outputs(e, key, value.reshape(-1), truth.reshape(-1), 1.0 + truth.abs().reshape(-1))
        print(f"RATIO {name} {key} {e.dtype} {dev.ratio:.3g}")
        assert dev.ok, dev
    for key in ("grad_input", "grad_weight"):
        scale = 1.0
        if key == "grad_input" and x.shape[-1] == 1:
            # H = 1: grad_s = rstd * g_n * (1 - n^2) with n^2 = s^2 / (s^2 + eps) ~ 1, a cancellation whose fp32
            # rounding no kernel avoids (the true gradient is ~eps / s^2 of its terms); judge the error against
            # the size of the cancelling terms, rstd * |g_n|.
            terms = truth_bwd["rstd"].reshape(-1, 1) * gy.double().abs() * (w.double().abs() + (1.0 if gemma else 0.0))
            scale = max(1.0, float(torch.linalg.vector_norm(terms) / torch.linalg.vector_norm(truth_bwd[key])))
        dev = contract.compare_grad(e, key, got[key], truth_bwd[key], scale)
        print(f"RATIO {name} {key} {e.dtype} {dev.ratio:.3g}")
        assert dev.ok, dev
    assert got["y"].dtype == gy.dtype and got["grad_weight"].dtype == w.dtype and got["grad_input"].dtype == x.dtype


CASES = [  # (x dtype, weight dtype or None for x's, gemma, residual)
    (dt, wdt, gemma, res)
    for dt in DTYPES
    for wdt in ((None,) if dt == torch.float32 else (None, torch.float32))
    for gemma in (False, True)
    for res in (False, True)
]


def _case_id(case) -> str:
    dt, wdt, gemma, res = case
    w = "" if wdt is None else "-w32"
    return f"{str(dt).removeprefix('torch.')}{w}{'-gemma' if gemma else ''}{'-res' if res else ''}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize(("n", "h"), [(1, 1), (37, 7), (33, 64), (300, 4096), (17, 5120), (5, 20000)])
def test_matches_reference(case, n, h):
    dt, wdt, gemma, res = case
    check_against_reference(
        f"{_case_id(case)}-{n}x{h}", *make_inputs(n, h, dt, wdt, gemma, res, seed=n + h), gemma=gemma
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [1031, 4096])
def test_unaligned_rows_give_the_same_bits(dtype, h):
    """Rows starting one element into an allocation give the bits of aligned rows. H = 1031: both tensors'
    rows are misaligned (odd H); H = 4096: the aligned tensor takes the kernels' aligned variant, the shifted
    one the element-wise variant."""
    x, w, r, gy, gres = make_inputs(6, h, dtype, None, False, True, seed=3)

    def shifted(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
        view = buf[1:].view(t.shape)
        view.copy_(t)
        return view

    a = run(_native(), x, w, r, gy, gres, False)
    b = run(_native(), shifted(x), w, shifted(r), shifted(gy), shifted(gres), False)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [4096, 20000])
def test_batch_invariance(dtype, h):
    """A probe row's y, s, rstd and grad_input are bitwise the same alone and inside batches of 7, 133 and
    4096 rows, at any position; grad_weight is deterministic run to run."""
    x, w, r, gy, gres = make_inputs(4096, h, dtype, None, False, True, seed=4, on_gpu=True)
    probe = 5
    one = slice(probe, probe + 1)
    alone = run(_native(), x[one].clone(), w, r[one].clone(), gy[one].clone(), gres[one].clone(), False)
    for batch, position in ((7, 3), (133, 100), (4096, 4000)):
        rows = torch.arange(batch, device="cuda")
        rows[position], rows[probe] = probe, rows[position]
        inside = run(
            _native(),
            x[rows].contiguous(),
            w,
            r[rows].contiguous(),
            gy[rows].contiguous(),
            gres[rows].contiguous(),
            False,
        )
        for key in ("y", "s", "rstd", "grad_input"):
            assert torch.equal(alone[key][0], inside[key][position]), (key, batch)
    first = run(_native(), x, w, r, gy, gres, False)
    again = run(_native(), x, w, r, gy, gres, False)
    for key in first:
        assert torch.equal(first[key], again[key]), key


def test_without_grad_weight():
    x, w, r, gy, gres = make_inputs(50, 2048, torch.bfloat16, None, True, True, seed=5)
    full = run(_native(), x, w, r, gy, gres, True)
    part = run(_native(), x, w, r, gy, gres, True, want_dw=False)
    assert "grad_weight" not in part
    assert torch.equal(full["grad_input"], part["grad_input"])


def test_runs_on_the_callers_stream():
    args = make_inputs(2048, 4096, torch.bfloat16, None, False, True, seed=6)
    expected = run(_native(), *args, False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = run(_native(), *args, False)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_offsets_past_2_31_elements():
    """Rows whose first element lies past 2^31 elements (int64 offsets): the last rows' y, s, rstd and
    grad_input in the big batch are the bits they give alone."""
    h = 8192
    n = (1 << 31) // h + 3
    assert (n - 2) * h > 1 << 31
    g = torch.Generator(device="cuda").manual_seed(11)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    x, r, gy, gres = randn(n, h), randn(n, h), randn(n, h), randn(n, h)
    w = randn(h) * 0.1 + 1.0
    big = run(_native(), x, w, r, gy, gres, False)
    tail = slice(n - 3, n)
    alone = run(_native(), x[tail].clone(), w, r[tail].clone(), gy[tail].clone(), gres[tail].clone(), False)
    for key in ("y", "s", "rstd", "grad_input"):
        assert torch.equal(big[key][tail], alone[key]), key


@pytest.mark.multi_gpu
def test_runs_on_the_tensors_device():
    """Tensors on cuda:1 while cuda:0 is current (torch exports a tensor through DLPack only from its own device)."""
    args = make_inputs(16, 3000, torch.bfloat16, torch.float32, False, True, seed=8)
    torch.cuda.set_device(0)
    expected = run(_native(), *args, False)
    got = run(_native(), *(None if a is None else a.to("cuda:1") for a in args), False)
    assert torch.cuda.current_device() == 0
    for key in expected:
        assert got[key].device == torch.device("cuda:1")
        assert torch.equal(expected[key], got[key].to("cuda:0")), key


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_public_op_on_backend(case):
    dt, wdt, gemma, res = case
    x, w, r, gy, gres = make_inputs(2 * 11, 768, dt, wdt, gemma, res, seed=7)
    x, gy = x.view(2, 11, 768), gy.view(2, 11, 768)
    r = None if r is None else r.view(2, 11, 768)

    def forward(backend: str, tensors):
        with rlk.use_backend(backend):
            out = rms_norm(tensors[0], tensors[1], EPS, residual=tensors[2], gemma=gemma)
        y, s = out if res else (out, None)
        loss = (y.double() * gy.double()).sum()
        if s is not None:
            loss = loss + (s.double() * gres.view(2, 11, 768).double()).sum()
        return y, loss

    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (x, w, r)]
    y, loss = forward(BACKEND, leaves)
    loss.backward()
    leaves64 = [t.double().requires_grad_(True) if t is not None else None for t in (x, w, r)]
    y64, loss64 = forward("reference", leaves64)
    loss64.backward()
    e = contract.entry("rms_norm", dt)
    assert contract.compare_outputs(
        e, "y", y.reshape(-1), y64.detach().reshape(-1), 1.0 + y64.detach().abs().reshape(-1)
    ).ok
    for got, truth, name in zip(leaves, leaves64, ("x", "weight", "residual")):
        if got is not None:
            dev = contract.compare_grad(e, f"grad_{name}", got.grad, truth.grad, 1.0)
            assert dev.ok, dev
    assert dispatch.decide("rms_norm", x.device, dt).backend == BACKEND
