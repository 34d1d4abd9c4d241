"""CUDA linear_logprob primitives (tensor-core path, float16 / bfloat16) against the reference run in fp64
(contract tolerances), bitwise batch invariance, deterministic grad_weight, and dispatch (cuda for 16-bit,
float32 falls through). Needs a GPU (marker ``gpu``). The same tests run on the rocm backend (the same kernel
bodies, linear_logprob.cuh, over the MFMA core) from packages/rlk-rocm/tests/test_linear_logprob_rocm.py
(``BACKEND``).

On cuda every test runs once per kernel pair (fixture ``kernel``): the mma.sync kernels everywhere, and the Hopper
(wgmma) kernels where they can run (compute capability 9.0, sm_90a built), or everywhere with
``RLK_REQUIRE_WGMMA=1`` (then they fail saying why where they cannot run). ``-k "not wgmma"`` selects the mma.sync
runs alone (the kernel bodies rlk-rocm shares). On rocm the one kernel pair is ``mfma``.

Each contract check prints ``RATIO <test> <output> <dtype> <worst/allowed>`` (``pytest -s``).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

import rlk
from rlk.core import contract, dispatch
from rlk.reference import logprob as ref

# The backend under test. packages/rlk-rocm/tests loads this file with BACKEND = "rocm" set before it runs
# (_shared_tests.py there), so the same tests cover rlk-rocm's linear_logprob.
BACKEND = globals().get("BACKEND", "cuda")
pytest.importorskip(f"rlk_{BACKEND}", reason=f"rlk-{BACKEND} is not installed (bash ci/build_{BACKEND}.sh)")

if BACKEND == "cuda":
    from test_logprob_cuda import check_entropy_of_large_logits, check_row_outputs  # noqa: E402  (sibling's helpers)
else:  # the sibling file as rlk-rocm runs it (importing test_logprob_cuda itself would ask for rlk_cuda)
    from _shared_tests import load_cuda_tests  # noqa: E402  (packages/rlk-rocm/tests)

    _sibling = load_cuda_tests("test_logprob_cuda", BACKEND)
    check_entropy_of_large_logits = _sibling.check_entropy_of_large_logits
    check_row_outputs = _sibling.check_row_outputs

pytestmark = pytest.mark.gpu
if BACKEND == "rocm":
    # Deselected on any torch that is not a ROCm build (conftest): rlk-rocm serves AMD GPUs.
    pytestmark = [pytestmark, pytest.mark.rocm]

DTYPES = [torch.float16, torch.bfloat16]
IGNORE = -100
ENTROPY_MODES = ["off", "fwd_only", "fwd_and_grad"]


#: RLK_REQUIRE_WGMMA=1: the Hopper-only test modules fail (instead of collecting nothing) where their kernels
#: cannot run.
REQUIRE_WGMMA = os.environ.get("RLK_REQUIRE_WGMMA") == "1"


def hopper_problem(check: str, module: str = "logprob") -> str | None:
    """``rlk_cuda.<module>.<check>`` (``logprob.wgmma_problem``, ``logprob.stored_problem``, ``distill.problem``) on
    the current GPU: why the Hopper kernels cannot run, or None (also without a GPU: the ``gpu`` marker deselects
    everything then)."""
    if not torch.cuda.is_available():
        return None
    ck = importlib.import_module(f"rlk_cuda.{module}")
    return getattr(ck, check)(torch.device("cuda", torch.cuda.current_device()))


def hopper_module(problem: str | None, what: str, module: str = "logprob"):
    """``rlk_cuda.<module>`` for a test of a Hopper-only module; fails saying why where ``problem`` is not None (the
    module is collected there only under RLK_REQUIRE_WGMMA=1)."""
    if problem is not None:
        pytest.fail(f"RLK_REQUIRE_WGMMA=1 but {what} cannot run here: {problem}", pytrace=False)
    return importlib.import_module(f"rlk_cuda.{module}")


def probe_placements(probe: int, batches=(7, 133, 1024), device: str = "cuda"):
    """``(batch, position, index)`` for each batch size and the first, middle and last position: ``index`` takes
    rows ``0 .. batch - 1`` with the probe row swapped into ``position`` (every batch is larger than ``probe``)."""
    for batch in batches:
        for position in (0, batch // 2, batch - 1):
            index = torch.arange(batch, device=device)
            other = int(index[position])
            index[position] = probe
            index[probe] = other
            yield batch, position, index


def _cuda():
    """The primitives' module of the backend under test (rlk_cuda.logprob, or rlk_rocm.logprob)."""
    return importlib.import_module(f"rlk_{BACKEND}.logprob")


def wgmma_problem_here() -> str | None:
    """Why the Hopper kernels cannot run on the current GPU, or None (None too without a GPU: the ``gpu`` marker
    deselects every test then)."""
    if not torch.cuda.is_available():
        return None
    return _cuda().wgmma_problem(torch.device("cuda", torch.cuda.current_device()))


REQUIRE_WGMMA = os.environ.get("RLK_REQUIRE_WGMMA") == "1"
if BACKEND == "cuda":
    KERNELS = ["mma"] + (["wgmma"] if REQUIRE_WGMMA or wgmma_problem_here() is None else [])
else:
    KERNELS = ["mfma"]  # rlk-rocm: one kernel pair, linear_logprob.cuh over the MFMA core


@pytest.fixture(autouse=True, params=KERNELS)
def kernel(request, monkeypatch) -> str:
    """Runs the test with the primitives on one kernel pair (RLK_CUDA_LINEAR_FWD / RLK_CUDA_LINEAR_BWD)."""
    if BACKEND != "cuda":
        return request.param
    ck = _cuda()
    if request.param == "wgmma" and wgmma_problem_here() is not None:
        pytest.fail(f"RLK_REQUIRE_WGMMA=1 but the wgmma kernels cannot run here: {wgmma_problem_here()}", pytrace=False)
    monkeypatch.setenv(ck.FORWARD_ENV, request.param)
    monkeypatch.setenv(ck.BACKWARD_ENV, request.param)
    device = torch.device("cuda", torch.cuda.current_device())
    assert (ck.forward_kernel(device), ck.backward_kernel(device)) == (request.param, request.param)
    return request.param


def make_inputs(n: int, v: int, h: int, dtype: torch.dtype, seed: int = 0, extreme: bool = False):
    """hidden ~ N(0, 1), weight ~ N(0, 1) / sqrt(H) (logits ~ N(0, 1), times 3), targets with row 1 ignored
    (N >= 3), inv_temperature in [0.5, 2], upstream gradients ~ N(0, 1); with ``extreme`` hidden row 2 is
    scaled x200 (logits in the hundreds: a peaked softmax). Drawn on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, device="cuda")
    weight = torch.randn(v, h, generator=g, device="cuda") * (3.0 / h**0.5)
    if extreme and n >= 3:
        hidden[2] *= 200
    targets = torch.randint(0, v, (n,), generator=g, device="cuda")
    if n >= 3:
        targets[1] = IGNORE
    inv_t = torch.rand(n, generator=g, device="cuda") * 1.5 + 0.5
    grad_lp, grad_ent = torch.randn(2, n, generator=g, device="cuda")
    return hidden.to(dtype), weight.to(dtype), targets, inv_t, grad_lp, grad_ent


def run(
    impl,
    hidden,
    weight,
    targets,
    inv_t,
    grad_lp,
    grad_ent,
    entropy_mode: str = "fwd_and_grad",
    want_hidden: bool = True,
    want_weight: bool = True,
):
    """Forward and backward of ``impl`` (a module with the two primitives); fp64 statistics for fp64 inputs."""
    n = hidden.shape[0]
    sdt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    with_entropy = entropy_mode != "off"
    grad_entropy = grad_ent.to(sdt) if entropy_mode == "fwd_and_grad" else None
    lp, ent, lse = (torch.empty(n, dtype=sdt, device=hidden.device) for _ in range(3))
    impl.linear_logprob_fwd(hidden, weight, targets, inv_t.to(sdt), IGNORE, lp, ent if with_entropy else None, lse)
    gh = torch.empty_like(hidden) if want_hidden else None
    gw = torch.empty_like(weight) if want_weight else None
    impl.linear_logprob_bwd(
        hidden,
        weight,
        targets,
        inv_t.to(sdt),
        lse,
        ent if with_entropy else None,
        grad_lp.to(sdt),
        grad_entropy,
        IGNORE,
        gh,
        gw,
    )
    out = {"logprob": lp, "lse": lse}
    if with_entropy:
        out["entropy"] = ent
    if want_hidden:
        out["grad_hidden"] = gh
    if want_weight:
        out["grad_weight"] = gw
    return out


def check_against_reference(
    name: str,
    hidden,
    weight,
    targets,
    inv_t,
    grad_lp,
    grad_ent,
    entropy_mode: str = "fwd_and_grad",
    want_hidden: bool = True,
    want_weight: bool = True,
) -> None:
    got = run(_cuda(), hidden, weight, targets, inv_t, grad_lp, grad_ent, entropy_mode, want_hidden, want_weight)
    truth = run(
        ref, hidden.double(), weight.double(), targets, inv_t, grad_lp, grad_ent, entropy_mode, want_hidden, want_weight
    )
    e = contract.entry("linear_logprob", hidden.dtype)
    valid = targets != IGNORE
    scale = check_row_outputs(name, e, got, truth, valid)
    for key in ("logprob", "entropy", "lse"):
        if key in got:
            assert bool((got[key][~valid] == 0).all()), key
    max_scale = float(scale[valid].max()) if bool(valid.any()) else 1.0
    for key in ("grad_hidden", "grad_weight"):
        if key not in got:
            continue
        assert got[key].dtype == hidden.dtype
        dev = contract.compare_grad(e, key, got[key], truth[key], max_scale)
        print(f"RATIO {name} {key} {e.dtype} {dev.ratio:.3g}")
        assert dev.ok, dev
    if want_hidden:
        assert bool((got["grad_hidden"][~valid] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "v", "h"),
    [
        (1, 1000, 64),
        (7, 1000, 64),
        (133, 1000, 64),
        (7, 32003, 64),
        (133, 32003, 64),
        (1, 32003, 4096),
        (7, 1000, 4096),
        (133, 8200, 4096),
        (3, 5, 64),
    ],
)
def test_matches_reference(dtype, n, v, h):
    """V not a multiple of 128 (1000, 8200, 32003: ragged last tile, split and chunk), N not a multiple of 128,
    H one K step (64) or 64 of them (4096)."""
    check_against_reference(f"shape{n}x{v}x{h}", *make_inputs(n, v, h, dtype, seed=n + v + h))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("entropy_mode", ENTROPY_MODES)
def test_entropy_modes(dtype, entropy_mode):
    check_against_reference(f"entropy_{entropy_mode}", *make_inputs(37, 9000, 128, dtype, seed=1), entropy_mode)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("want_hidden", "want_weight"), [(True, False), (False, True), (False, False)])
def test_optional_gradients(dtype, want_hidden, want_weight):
    """A gradient output left None is not computed; the other one is still right."""
    check_against_reference(
        f"grads_{want_hidden}_{want_weight}",
        *make_inputs(19, 5000, 64, dtype, seed=2),
        want_hidden=want_hidden,
        want_weight=want_weight,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_logits(dtype):
    check_against_reference("extreme", *make_inputs(37, 3000, 128, dtype, seed=3, extreme=True))


@pytest.mark.parametrize(("offset", "temperature"), [(30.0, 0.05), (1e5, 1.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_entropy_of_large_logits(dtype, offset, temperature):
    """An offset column (hidden[:, 0] * weight[:, 0] = offset) and multiples of 1/4 in [-0.5, 0.5] elsewhere:
    every logit is ``offset`` plus a multiple of 1/16, which the fp32 accumulation computes exactly (as z = x * 20),
    so the fp64 reference sees the kernels' z (1e5, not 1e6: 3 bits to spare in the tensor cores' fp32
    accumulation). The entropy (relative to the running max, merged over the lanes,
    warps and 3 vocab splits of a row) is >= 0 and accurate on its own scale; one-hot-like rows at T = 0.05."""
    n, v, h = 133, 9000, 64
    _, _, targets, inv_t, grad_lp, grad_ent = make_inputs(n, v, h, dtype, seed=13)
    g = torch.Generator(device="cuda").manual_seed(13)
    hidden = torch.randint(-2, 3, (n, h), generator=g, device="cuda") / 4
    weight = torch.randint(-2, 3, (v, h), generator=g, device="cuda") / 4
    hidden[:, 0], weight[:, 0] = (1000.0, offset / 1000) if offset > 1000 else (offset, 1.0)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    inv_t = torch.full_like(inv_t, 1.0 / temperature)
    args = (hidden, weight, targets, inv_t, grad_lp, grad_ent)
    check_against_reference("large_logits", *args)
    got = run(_cuda(), *args, want_weight=False)
    truth = run(ref, hidden.double(), weight.double(), targets, inv_t, grad_lp, grad_ent, want_weight=False)
    check_entropy_of_large_logits(
        "large_logits", contract.entry("linear_logprob", dtype), got["entropy"], truth["entropy"]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_hidden_size_not_a_multiple_of_8(dtype):
    """H = 36: the primitive pads hidden / weight with zero columns (the kernels need H % 8 == 0)."""
    check_against_reference("h36", *make_inputs(11, 1000, 36, dtype, seed=4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_views_give_the_same_bits(dtype):
    """hidden / weight / gradient buffers starting one element into an allocation (copied to aligned buffers by
    the primitive) give the bits of aligned inputs."""
    hidden, weight, targets, inv_t, grad_lp, grad_ent = make_inputs(9, 1500, 64, dtype, seed=5)

    def shifted(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = buf[1:].view(t.shape)
        view.copy_(t)
        return view

    a = run(_cuda(), hidden, weight, targets, inv_t, grad_lp, grad_ent)
    b = run(_cuda(), shifted(hidden), shifted(weight), targets, inv_t, grad_lp, grad_ent)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("dtype", DTYPES)
def test_confident_rows_use_the_rounded_z(dtype):
    """A target far above every other logit: logprob <= 0 needs z = x * inv_t rounded once, the same z in the
    forward's lse and its z_target."""
    n, v, h = 64, 4099, 64
    hidden, weight, targets, inv_t, grad_lp, _ = make_inputs(n, v, h, dtype, seed=12)
    targets = torch.arange(n, device="cuda") * 7 % v
    weight = weight.clone()
    weight[targets] = (hidden.float() * (40.0 / (hidden.float().norm(dim=1, keepdim=True) ** 2))).to(dtype)
    out = run(_cuda(), hidden, weight, targets, inv_t, grad_lp.abs() + 0.5, grad_lp, "off", want_weight=False)
    assert bool((out["logprob"] <= 0).all()), out["logprob"].max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariance(dtype):
    """A probe row's logprob, entropy, lse and grad_hidden row are bitwise the same alone and inside batches of
    7, 133 and 1024 rows at the first, a middle and the last position (Qwen's V and H)."""
    v, h = 151936, 4096
    hidden, weight, targets, inv_t, grad_lp, grad_ent = make_inputs(1024, v, h, dtype, seed=6)
    probe = 5

    def rows_of(index):
        return (hidden[index].contiguous(), weight, targets[index], inv_t[index], grad_lp[index], grad_ent[index])

    alone = run(_cuda(), *rows_of(torch.tensor([probe], device="cuda")), want_weight=False)
    for batch, position, index in probe_placements(probe):
        inside = run(_cuda(), *rows_of(index), want_weight=False)
        for key in alone:
            assert torch.equal(alone[key][0], inside[key][position]), (key, batch, position)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_weight_is_deterministic(dtype):
    """grad_weight (a sum over rows) is bitwise the same run to run; so is everything else."""
    args = make_inputs(300, 9000, 256, dtype, seed=7)
    first = run(_cuda(), *args)
    again = run(_cuda(), *args)
    for key in first:
        assert torch.equal(first[key], again[key]), key


def test_runs_on_the_callers_stream():
    args = make_inputs(64, 5000, 128, torch.bfloat16, seed=8)
    expected = run(_cuda(), *args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = run(_cuda(), *args)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_dispatch_takes_16_bit_and_declines_float32():
    device = torch.device("cuda", torch.cuda.current_device())
    for dtype in DTYPES:
        assert dispatch.decide("linear_logprob", device, dtype).backend == BACKEND
    decision = dispatch.decide("linear_logprob", device, torch.float32)
    assert decision.backend != BACKEND
    assert any(name == BACKEND and "float32" in reason for name, reason in decision.skipped), str(decision)


@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES])
def test_public_op(dtype):
    """rlk.linear_logprob with autograd (the backend under test for 16-bit, the next one for float32) against the
    reference."""
    hidden, weight, targets, inv_t, _, _ = make_inputs(2 * 9, 3000, 64, dtype, seed=9)
    hidden = hidden.view(2, 9, 64)
    targets = targets.view(2, 9)
    temperature = (1.0 / inv_t).view(2, 9)
    c = torch.randn(2, 2, 9, device="cuda")

    def loss(h, w):
        lp, ent = rlk.linear_logprob(h, w, targets, temperature=temperature, return_entropy=True)
        return lp, ent, (c[0] * lp + c[1] * ent).sum()

    hc, wc = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent, total = loss(hc, wc)
    total.backward()
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    with rlk.use_backend("reference"):
        ref_lp, ref_ent, ref_total = loss(h64, w64)
    ref_total.backward()
    e = contract.entry("linear_logprob", dtype)
    lse = torch.logsumexp((h64.detach() @ w64.detach().T) / temperature.double()[..., None], -1)
    scale = contract.row_scale(ref_lp.detach(), lse).reshape(-1)
    assert contract.compare_outputs(e, "logprob", lp.reshape(-1), ref_lp.detach().reshape(-1), scale).ok
    assert contract.compare_outputs(e, "entropy", ent.reshape(-1), ref_ent.detach().reshape(-1), scale).ok
    assert contract.compare_grad(e, "grad_hidden", hc.grad, h64.grad, float(scale.max())).ok
    assert contract.compare_grad(e, "grad_weight", wc.grad, w64.grad, float(scale.max())).ok
    backend = dispatch.decide("linear_logprob", hidden.device, dtype).backend
    assert (backend == BACKEND) == (dtype != torch.float32), backend
