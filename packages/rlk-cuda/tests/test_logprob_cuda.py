"""CUDA selected_logprob primitives against the reference run in fp64 (contract tolerances), bitwise
batch invariance, and the public op running on the cuda backend. Needs a GPU (marker ``gpu``). The same
tests run on the rocm backend from packages/rlk-rocm/tests/test_logprob_rocm.py (``BACKEND``).

Each contract check prints ``RATIO <test> <output> <dtype> <worst/allowed>`` (``pytest -s``), the
numbers behind the proposed contract values.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import rlk
from rlk.core import contract, dispatch
from rlk.reference import logprob as ref

# The backend under test. packages/rlk-rocm/tests loads this file with BACKEND = "rocm" set before it runs
# (_shared_tests.py there), so the same tests cover rlk-rocm.
BACKEND = globals().get("BACKEND", "cuda")
pytest.importorskip(f"rlk_{BACKEND}", reason=f"rlk-{BACKEND} is not installed (bash ci/build_{BACKEND}.sh)")

pytestmark = pytest.mark.gpu
if BACKEND == "rocm":
    # On an NVIDIA GPU (a CUDA torch) these are skipped: rlk-rocm serves AMD GPUs.
    pytestmark = [pytestmark, pytest.mark.rocm]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IGNORE = -100


def _native():
    return importlib.import_module(f"rlk_{BACKEND}.logprob")


def make_inputs(
    n: int, v: int, dtype: torch.dtype, seed: int = 0, scale: float = 3.0, extreme: bool = False, on_gpu: bool = False
):
    """logits ~ scale * N(0, 1) (row 0 with -inf entries when V >= 3, row 2 at +-1e4 with ``extreme``),
    targets with row 1 ignored (N >= 3), inv_temperature in [0.5, 2], upstream gradients ~ N(0, 1).
    ``on_gpu``: drawn by a CUDA generator (large batches)."""
    g = torch.Generator(device="cuda" if on_gpu else "cpu").manual_seed(seed)
    x = torch.randn(n, v, generator=g, device=g.device) * scale
    targets = torch.randint(0, v, (n,), generator=g, device=g.device)
    if n >= 3:
        targets[1] = IGNORE
    if v >= 3:
        x[0, 0::3] = -torch.inf
        targets[0] = 1
    if extreme and n >= 3 and v >= 2:
        x[2, 0::2] = 1e4
        x[2, 1::2] = -1e4
    inv_t = torch.rand(n, generator=g, device=g.device) * 1.5 + 0.5
    grad_lp, grad_ent = torch.randn(2, n, generator=g, device=g.device)
    dev = {"device": "cuda"}
    return x.to(dtype).to(**dev), targets.to(**dev), inv_t.to(**dev), grad_lp.to(**dev), grad_ent.to(**dev)


def run(impl, x, targets, inv_t, grad_lp, grad_ent, entropy: bool = True):
    """Forward and backward of ``impl`` (a module with the two primitives); fp64 outputs for fp64 x."""
    n = x.shape[0]
    sdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    lp, ent, lse = (torch.empty(n, dtype=sdt, device=x.device) for _ in range(3))
    impl.selected_logprob_fwd(x, targets, inv_t.to(sdt), IGNORE, lp, ent if entropy else None, lse)
    grad = torch.empty_like(x)
    impl.selected_logprob_bwd(
        x,
        targets,
        inv_t.to(sdt),
        lse,
        ent if entropy else None,
        grad_lp.to(sdt),
        grad_ent.to(sdt) if entropy else None,
        IGNORE,
        grad,
    )
    out = {"logprob": lp, "lse": lse, "grad": grad}
    if entropy:
        out["entropy"] = ent
    return out


def check_row_outputs(name: str, e, got: dict, truth: dict, valid) -> torch.Tensor:
    """The per-row outputs in ``got`` (logprob, entropy, lse) against ``truth`` under contract entry ``e``, lse
    on the rows not ignored (``valid``) only, each ratio printed; returns the per-row scale of the contract."""
    scale = contract.row_scale(truth["logprob"], truth["lse"])
    for key in ("logprob", "entropy", "lse"):
        if key not in got:
            continue
        keep = valid if key == "lse" else torch.ones_like(valid)
        dev = contract.compare_outputs(e, key, got[key][keep], truth[key][keep], scale[keep])
        print(f"RATIO {name} {key} {e.dtype} {dev.ratio:.3g}")
        assert dev.ok, dev
    return scale


def check_against_reference(name: str, x, targets, inv_t, grad_lp, grad_ent, entropy: bool = True) -> None:
    got = run(_native(), x, targets, inv_t, grad_lp, grad_ent, entropy)
    truth = run(ref, x.double(), targets, inv_t, grad_lp, grad_ent, entropy)
    e = contract.entry("selected_logprob", x.dtype)
    valid = targets != IGNORE
    scale = check_row_outputs(name, e, got, truth, valid)
    assert bool((got["logprob"][~valid] == 0).all())
    if entropy:
        assert bool((got["entropy"][~valid] == 0).all())
    max_scale = float(scale[valid].max()) if bool(valid.any()) else 1.0
    dev = contract.compare_grad(e, "grad_logits", got["grad"], truth["grad"], max_scale)
    print(f"RATIO {name} grad_logits {e.dtype} {dev.ratio:.3g}")
    assert dev.ok, dev
    assert got["grad"].dtype == x.dtype
    assert bool((got["grad"][~valid] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "v"), [(1, 1), (5, 7), (37, 1000), (19, 4099), (8, 32000), (4, 151936), (3, 128256)])
def test_matches_reference(dtype, n, v):
    check_against_reference(f"shape{n}x{v}", *make_inputs(n, v, dtype, seed=n + v))


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_entropy_and_extreme_logits(dtype):
    check_against_reference("no_entropy", *make_inputs(33, 2053, dtype, seed=3), entropy=False)
    check_against_reference("extreme", *make_inputs(9, 3000, dtype, seed=4, extreme=True))


# Logits far from 0 (the offset) with an O(1) spread, where entropy = lse - E_p[z] would subtract two numbers
# of size |z|. float16 cannot hold the 1e6 and 3e38 offsets (6e4 stands in for them); bfloat16 stops at 1e6: the
# 16-bit kernels' fp32 exponent offset round(m * log2(e)) bounds the |z| they take (near 1e9).
LARGE_LOGITS = [
    (torch.float32, 30.0, 0.05),
    (torch.float32, 1e6, 1.0),
    (torch.float32, 3e38, 1.0),
    (torch.bfloat16, 30.0, 0.05),
    (torch.bfloat16, 1e6, 1.0),
    (torch.float16, 30.0, 0.05),
    (torch.float16, 6e4, 1.0),
]


def large_logit_inputs(n: int, v: int, dtype: torch.dtype, offset: float, temperature: float, seed: int = 8):
    """``offset + N(0, 1)`` logits on a 1/64 grid, so that ``z = x * (1 / T)`` is exact in fp32 for T = 1 and
    0.05 (``1 / 0.05`` rounds to 20) and the fp64 reference sees the kernels' z; row 0 has -inf entries (not its
    target), row 1 is one-hot-like (its target ``20 / T`` above the other logits), row 2 is ignored."""
    g = torch.Generator().manual_seed(seed)
    x = offset + torch.round(torch.randn(n, v, generator=g) * 64) / 64
    targets = torch.randint(0, v, (n,), generator=g)
    x[0, 0::3] = -torch.inf
    targets[0], targets[2] = 1, IGNORE
    x[1] = offset - 20 * temperature
    x[1, targets[1]] = offset
    inv_t = torch.full((n,), 1.0 / temperature)
    grad_lp, grad_ent = torch.randn(2, n, generator=g)
    dev = {"device": "cuda"}
    return x.to(dtype).to(**dev), targets.to(**dev), inv_t.to(**dev), grad_lp.to(**dev), grad_ent.to(**dev)


def check_entropy_of_large_logits(name: str, e, entropy: torch.Tensor, truth: torch.Tensor) -> None:
    """Entropy finite and >= 0, and (z being exact) within the contract's atol / rtol on the entropy's own scale
    ``1 + |H|``: no error of the size of ``|z| * 2^-24``, which the contract's row scale would allow."""
    assert bool(torch.isfinite(entropy).all()) and bool((entropy >= 0).all()), entropy.min()
    dev = contract.compare_outputs(e, "entropy", entropy, truth, 1.0 + truth.abs())
    print(f"RATIO {name} entropy_own_scale {e.dtype} {dev.ratio:.3g}")
    assert dev.ok, dev


@pytest.mark.parametrize(("dtype", "offset", "temperature"), LARGE_LOGITS)
def test_entropy_of_large_logits(dtype, offset, temperature):
    """The entropy is accumulated relative to the running max (log s - b / s; the 16-bit kernels: the exponent
    times its exp): a logit offset of 30 / 0.05 = 600 (one-hot-like rows below 0), 1e6 (errors of ulp(1e6)) or
    3e38 (z * exp(z - m) summed to inf: entropy -inf) costs it no accuracy; the gradient stays within the
    contract."""
    args = large_logit_inputs(37, 32003, dtype, offset, temperature)
    check_against_reference("large_logits", *args)
    x, targets, inv_t, grad_lp, grad_ent = args
    got = run(_native(), x, targets, inv_t, grad_lp, grad_ent)
    truth = run(ref, x.double(), targets, inv_t, grad_lp, grad_ent)
    check_entropy_of_large_logits(
        "large_logits", contract.entry("selected_logprob", dtype), got["entropy"], truth["entropy"]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_confident_rows_use_the_rounded_z(dtype):
    """A target about 30 above every other scaled logit: logprob <= 0 and the target's gradient
    g_lp * (1 - p_y) >= 0 for g_lp > 0. Both need z = x * inv_t rounded once (the ABI's one fp32 multiply)
    in the forward and the backward: an FMA-contracted x * inv_t - lse gives p_y = exp(+half an ulp) > 1,
    a gradient of the wrong sign, on about a third of these rows."""
    n, v = 64, 4099
    g = torch.Generator().manual_seed(12)
    x = torch.randn(n, v, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    x[torch.arange(n), targets] = 60 + torch.rand(n, generator=g)
    inv_t = torch.rand(n, generator=g) * 1.5 + 0.5
    grad_lp = torch.rand(n, generator=g) + 0.5
    x, targets, inv_t, grad_lp = x.to(dtype).cuda(), targets.cuda(), inv_t.cuda(), grad_lp.cuda()
    out = run(_native(), x, targets, inv_t, grad_lp, grad_lp, entropy=False)
    assert bool((out["logprob"] <= 0).all()), out["logprob"].max()
    g_target = out["grad"][torch.arange(n, device="cuda"), targets].float()
    assert bool((g_target >= 0).all()), g_target.min()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [1031, 8192, 10007])
def test_unaligned_rows_take_the_same_path_bitwise(dtype, v):
    """A batch whose rows start at odd offsets (element-wise loads) gives the bits of aligned rows. V = 8192:
    the contiguous rows take the all-aligned 16-bit kernels, the shifted ones the per-row-checked kernels;
    V = 1031 and 10007 (odd): rows of both tensors are misaligned, 10007 long enough for the main loop's
    element-wise loads, not only the tail."""
    x, targets, inv_t, grad_lp, grad_ent = make_inputs(6, v, dtype, seed=5)
    storage = torch.empty(6 * v + 1, dtype=dtype, device="cuda")
    shifted = storage[1:].view(6, v)
    shifted.copy_(x)
    a = run(_native(), x, targets, inv_t, grad_lp, grad_ent)
    b = run(_native(), shifted, targets, inv_t, grad_lp, grad_ent)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariance(dtype):
    """A probe row's outputs and gradient are bitwise the same alone and inside batches of 7, 133 and 4096
    rows, at any position."""
    v = 151936
    x, targets, inv_t, grad_lp, grad_ent = make_inputs(4096, v, dtype, seed=6, on_gpu=True)
    probe = 5
    alone = run(
        _native(),
        x[probe : probe + 1].clone(),
        targets[probe : probe + 1].clone(),
        inv_t[probe : probe + 1].clone(),
        grad_lp[probe : probe + 1].clone(),
        grad_ent[probe : probe + 1].clone(),
    )
    for batch, position in ((7, 3), (133, 100), (4096, 4000)):
        rows = torch.arange(batch, device="cuda")
        rows[position], rows[probe] = probe, rows[position]
        inside = run(_native(), x[rows].contiguous(), targets[rows], inv_t[rows], grad_lp[rows], grad_ent[rows])
        for key in alone:
            assert torch.equal(alone[key][0], inside[key][position]), (key, batch)
    again = run(_native(), x[:133], targets[:133], inv_t[:133], grad_lp[:133], grad_ent[:133])
    first = run(_native(), x[:133], targets[:133], inv_t[:133], grad_lp[:133], grad_ent[:133])
    for key in again:
        assert torch.equal(again[key], first[key]), key  # deterministic run to run


def test_offsets_past_2_31_elements():
    """Rows whose first element lies past 2^31 elements (int64 offsets): the last rows, an ignored one among
    them, give in the big batch the bits they give alone."""
    v = 151936
    n = (1 << 31) // v + 3
    assert (n - 2) * v > 1 << 31
    g = torch.Generator(device="cuda").manual_seed(10)
    x = torch.randn(n, v, generator=g, device="cuda", dtype=torch.bfloat16) * 3
    targets = torch.randint(0, v, (n,), generator=g, device="cuda")
    targets[-2] = IGNORE
    inv_t = torch.rand(n, generator=g, device="cuda") * 1.5 + 0.5
    grad_lp, grad_ent = torch.randn(2, n, generator=g, device="cuda")
    big = run(_native(), x, targets, inv_t, grad_lp, grad_ent)
    tail = slice(n - 3, n)
    alone = run(
        _native(),
        x[tail].clone(),
        targets[tail].clone(),
        inv_t[tail].clone(),
        grad_lp[tail].clone(),
        grad_ent[tail].clone(),
    )
    for key in alone:
        assert torch.equal(big[key][tail], alone[key]), key
    assert bool((big["grad"][-2] == 0).all()) and bool(big["grad"][-1].abs().sum() > 0)


def test_runs_on_the_callers_stream():
    x, targets, inv_t, grad_lp, grad_ent = make_inputs(64, 50000, torch.bfloat16, seed=7)
    expected = run(_native(), x, targets, inv_t, grad_lp, grad_ent)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = run(_native(), x, targets, inv_t, grad_lp, grad_ent)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


@pytest.mark.multi_gpu
def test_runs_on_the_tensors_device():
    """Tensors on cuda:1 while cuda:0 is current (torch exports a tensor through DLPack only from its own device)."""
    args = make_inputs(16, 3000, torch.float32, seed=8)
    torch.cuda.set_device(0)
    expected = run(_native(), *args)
    got = run(_native(), *(a.to("cuda:1") for a in args))
    assert torch.cuda.current_device() == 0
    for key in expected:
        assert got[key].device == torch.device("cuda:1")
        assert torch.equal(expected[key], got[key].to("cuda:0")), key


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_op_on_backend(dtype):
    x, targets, inv_t, _, _ = make_inputs(2 * 9, 5000, dtype, seed=9)
    x = x.view(2, 9, 5000)
    targets = targets.view(2, 9)
    temperature = (1.0 / inv_t).view(2, 9)
    c = torch.randn(2, 2, 9, device="cuda")

    def loss(backend: str, logits):
        with rlk.use_backend(backend):
            lp, ent = rlk.selected_logprob(logits, targets, temperature=temperature, return_entropy=True)
        return lp, ent, (c[0] * lp + c[1] * ent).sum()

    xc = x.clone().requires_grad_(True)
    lp, ent, total = loss(BACKEND, xc)
    total.backward()
    x64 = x.double().requires_grad_(True)
    ref_lp, ref_ent, ref_total = loss("reference", x64)
    ref_total.backward()
    e = contract.entry("selected_logprob", dtype)
    lse = torch.logsumexp(x.double() / temperature.double()[..., None], -1)
    scale = contract.row_scale(ref_lp.detach(), lse).reshape(-1)
    assert contract.compare_outputs(e, "logprob", lp.reshape(-1), ref_lp.detach().reshape(-1), scale).ok
    assert contract.compare_outputs(e, "entropy", ent.reshape(-1), ref_ent.detach().reshape(-1), scale).ok
    assert contract.compare_grad(e, "grad_logits", xc.grad, x64.grad, float(scale.max())).ok
    assert dispatch.decide("selected_logprob", x.device, dtype).backend == BACKEND
