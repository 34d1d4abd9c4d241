"""The Hopper linear_logprob kernels (``csrc/linear_logprob_wgmma.cu``: TMA + wgmma) on an H100 / H200, beyond the
shared suite of ``test_linear_logprob_cuda.py`` (which runs every test on both kernel pairs): the forward
against the reference run in fp64 (contract tolerances) and against the mma.sync forward, bitwise batch
invariance, awkward N / V / H, ignore_index, temperatures, entropy on / off; the backward against the mma.sync
backward; and the ``RLK_CUDA_LINEAR_FWD`` / ``RLK_CUDA_LINEAR_BWD`` switches. Needs a GPU (marker ``gpu``).

Where the wgmma kernels cannot run (a GPU other than compute capability 9.0, or a build without sm_90a), this
module collects no test (``__test__`` below), unless ``RLK_REQUIRE_WGMMA=1``: then every test fails saying why,
so a Hopper run cannot quietly turn into a run of nothing. Without any GPU the root conftest deselects them
(marker ``gpu``), as every GPU test.

Each contract check prints ``RATIO <test> <output> <dtype> <worst/allowed>`` (``pytest -s``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("rlk_cuda", reason="rlk-cuda is not installed (bash ci/build_cuda.sh)")

from test_linear_logprob_cuda import IGNORE, REQUIRE_WGMMA, hopper_module, hopper_problem, make_inputs, probe_placements  # noqa: E402  (the sibling test module's helpers)

from rlk.core import contract
from rlk.reference import logprob as ref  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
PROBLEM = hopper_problem("wgmma_problem")
# Collect nothing where the kernel cannot run, unless it is required (pytest honours a module's __test__).
__test__ = PROBLEM is None or REQUIRE_WGMMA


def _ck():
    return hopper_module(PROBLEM, "the wgmma forward")


def forward(fn, hidden, weight, targets, inv_t, with_entropy: bool = True, ignore_index: int = IGNORE):
    """One forward through ``fn`` (a linear_logprob_fwd-like function): {"logprob", "lse"[, "entropy"]}."""
    n = hidden.shape[0]
    sdt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    lp, ent, lse = (torch.empty(n, dtype=sdt, device=hidden.device) for _ in range(3))
    fn(hidden, weight, targets, inv_t.to(sdt), ignore_index, lp, ent if with_entropy else None, lse)
    out = {"logprob": lp, "lse": lse}
    if with_entropy:
        out["entropy"] = ent
    return out


def check(name: str, hidden, weight, targets, inv_t, with_entropy: bool = True, ignore_index: int = IGNORE) -> None:
    """wgmma forward against the fp64 reference (contract) and against the mma.sync forward (same contract,
    mma.sync standing in for the truth: the two differ by fp32 summation order only)."""
    ck = _ck()
    got = forward(ck.linear_logprob_fwd_wgmma, hidden, weight, targets, inv_t, with_entropy, ignore_index)
    mma = forward(ck.linear_logprob_fwd_mma, hidden, weight, targets, inv_t, with_entropy, ignore_index)
    truth = forward(
        ref.linear_logprob_fwd, hidden.double(), weight.double(), targets, inv_t, with_entropy, ignore_index
    )
    e = contract.entry("linear_logprob", hidden.dtype)
    valid = targets != ignore_index
    scale = contract.row_scale(truth["logprob"], truth["lse"])
    for key in got:
        keep = valid if key == "lse" else torch.ones_like(valid)
        for other_name, other in (("reference", truth), ("mma", mma)):
            dev = contract.compare_outputs(e, key, got[key][keep], other[key][keep], scale[keep])
            print(f"RATIO {name} {key} {e.dtype} vs {other_name} {dev.ratio:.3g}")
            assert dev.ok, (key, other_name, dev)
        assert bool(torch.isfinite(got[key][keep]).all()), key
        assert bool((got[key][~valid] == 0).all()), key


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "v", "h"),
    [
        (1, 1000, 64),
        (7, 1000, 64),
        (133, 1000, 64),
        (3, 5, 64),
        (7, 32003, 64),
        (133, 32003, 64),
        (1, 32003, 4096),
        (7, 1000, 4096),
        (133, 8200, 4096),
        (300, 9000, 256),
        (129, 4097, 128),
        (256, 4352, 192),
    ],
)
def test_matches_reference_and_mma(dtype, n, v, h):
    """N below / above / at multiples of 128 (the row tile), V around the 256-column vocab tile and the 4096-column
    split (5, 1000, 4097, 4352 = 17 tiles of 256, 8200, 32003), H one k step (64), 2, 3, 4 and 64 of them."""
    check(f"shape{n}x{v}x{h}", *make_inputs(n, v, h, dtype, seed=n + v + h)[:4])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_entropy_on_and_off(dtype, with_entropy):
    check(f"entropy_{with_entropy}", *make_inputs(37, 9000, 128, dtype, seed=1)[:4], with_entropy=with_entropy)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hidden_size_not_a_multiple_of_8(dtype):
    """H = 36 and 100: the primitive pads to 40 / 104 (the TMA box of 64 columns then overhangs H: zero fill)."""
    for h in (36, 100):
        check(f"h{h}", *make_inputs(11, 1000, h, dtype, seed=h)[:4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_logits(dtype):
    check("extreme", *make_inputs(37, 3000, 128, dtype, seed=3, extreme=True)[:4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_temperatures(dtype):
    """Per-row inverse temperatures from 0.05 to 20 (very flat and very peaked softmaxes)."""
    hidden, weight, targets, _, _, _ = make_inputs(64, 5000, 128, dtype, seed=10)
    inv_t = torch.logspace(-1.3, 1.3, 64, device="cuda", dtype=torch.float32)
    check("temperatures", hidden, weight, targets, inv_t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ignore_index(dtype):
    """Every other row ignored, with ignore_index -100 and with a non-negative ignore_index (7, also a valid
    column: rows targeting 7 are ignored, not scored)."""
    hidden, weight, targets, inv_t, _, _ = make_inputs(50, 3000, 64, dtype, seed=11)
    targets = targets.clone()
    targets[::2] = IGNORE
    check("ignore_-100", hidden, weight, targets, inv_t)
    targets[::2] = 7
    targets[1] = 8  # make_inputs ignored row 1 with -100: out of range (not ignored) once ignore_index is 7
    check("ignore_7", hidden, weight, targets, inv_t, ignore_index=7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_confident_rows_use_the_rounded_z(dtype):
    """A target far above every other logit: logprob <= 0 needs the same rounded z in the lse and z_target."""
    ck = _ck()
    n, v, h = 64, 4099, 64
    hidden, weight, _, inv_t, _, _ = make_inputs(n, v, h, dtype, seed=12)
    targets = torch.arange(n, device="cuda") * 7 % v
    weight = weight.clone()
    weight[targets] = (hidden.float() * (40.0 / (hidden.float().norm(dim=1, keepdim=True) ** 2))).to(dtype)
    out = forward(ck.linear_logprob_fwd_wgmma, hidden, weight, targets, inv_t, with_entropy=False)
    assert bool((out["logprob"] <= 0).all()), out["logprob"].max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariance(dtype):
    """A probe row's logprob, entropy and lse are bitwise the same alone and inside batches of 7, 133 and 1024
    rows at the first, a middle and the last position (Qwen's V and H)."""
    ck = _ck()
    v, h = 151936, 4096
    hidden, weight, targets, inv_t, _, _ = make_inputs(1024, v, h, dtype, seed=6)
    probe = 5

    def rows_of(index):
        return hidden[index].contiguous(), weight, targets[index], inv_t[index]

    alone = forward(ck.linear_logprob_fwd_wgmma, *rows_of(torch.tensor([probe], device="cuda")))
    for batch, position, index in probe_placements(probe):
        inside = forward(ck.linear_logprob_fwd_wgmma, *rows_of(index))
        for key in alone:
            assert torch.equal(alone[key][0], inside[key][position]), (key, batch, position)


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic(dtype):
    ck = _ck()
    args = make_inputs(300, 9000, 256, dtype, seed=7)[:4]
    first = forward(ck.linear_logprob_fwd_wgmma, *args)
    again = forward(ck.linear_logprob_fwd_wgmma, *args)
    for key in first:
        assert torch.equal(first[key], again[key]), key


def test_unaligned_views_give_the_same_bits():
    """hidden / weight starting one element into an allocation (copied to aligned buffers by the primitive)."""
    ck = _ck()
    hidden, weight, targets, inv_t, _, _ = make_inputs(9, 1500, 64, torch.bfloat16, seed=5)

    def shifted(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = buf[1:].view(t.shape)
        view.copy_(t)
        return view

    a = forward(ck.linear_logprob_fwd_wgmma, hidden, weight, targets, inv_t)
    b = forward(ck.linear_logprob_fwd_wgmma, shifted(hidden), shifted(weight), targets, inv_t)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_runs_on_the_callers_stream():
    ck = _ck()
    args = make_inputs(64, 5000, 128, torch.bfloat16, seed=8)[:4]
    expected = forward(ck.linear_logprob_fwd_wgmma, *args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = forward(ck.linear_logprob_fwd_wgmma, *args)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_environment_switch(monkeypatch):
    """The primitives follow RLK_CUDA_LINEAR_FWD / RLK_CUDA_LINEAR_BWD: unset -> the Hopper kernels (they can run
    here), "mma" -> the mma.sync bits, "wgmma" -> the Hopper bits; any other value is refused."""
    from test_linear_logprob_cuda import run

    ck = _ck()
    args = make_inputs(133, 9000, 256, torch.bfloat16, seed=13)

    class Pair:  # the primitives on one fixed kernel pair
        def __init__(self, name):
            self.linear_logprob_fwd = getattr(ck, f"linear_logprob_fwd_{name}")
            self.linear_logprob_bwd = getattr(ck, f"linear_logprob_bwd_{name}")

    fixed = {name: run(Pair(name), *args) for name in ("mma", "wgmma")}
    for value, expected in ((None, "wgmma"), ("mma", "mma"), ("wgmma", "wgmma")):
        for env in (ck.FORWARD_ENV, ck.BACKWARD_ENV):
            if value is None:
                monkeypatch.delenv(env, raising=False)
            else:
                monkeypatch.setenv(env, value)
        assert ck.forward_kernel(args[0].device) == ck.backward_kernel(args[0].device) == expected
        got = run(ck, *args)
        for key in got:
            assert torch.equal(got[key], fixed[expected][key]), (value, key)
    for env in (ck.FORWARD_ENV, ck.BACKWARD_ENV):
        monkeypatch.setenv(env, "wgmmma")
        with pytest.raises(ValueError, match=env):
            (ck.forward_kernel if env == ck.FORWARD_ENV else ck.backward_kernel)(args[0].device)
        monkeypatch.delenv(env)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "v", "h"), [(3, 5, 64), (133, 8200, 256), (300, 4352, 192), (129, 32003, 128)])
def test_backward_close_to_mma(dtype, n, v, h):
    """The Hopper backward's gradients against the mma.sync backward's (the two differ by fp32 summation order
    only), under the contract's gradient tolerance scaled like the reference comparison, and finite."""
    from test_linear_logprob_cuda import run

    ck = _ck()
    args = make_inputs(n, v, h, dtype, seed=n + v)

    class Pair:
        def __init__(self, name):
            self.linear_logprob_fwd = ck.linear_logprob_fwd_mma  # the same forward for both
            self.linear_logprob_bwd = getattr(ck, f"linear_logprob_bwd_{name}")

    mma, wg = run(Pair("mma"), *args), run(Pair("wgmma"), *args)
    e = contract.entry("linear_logprob", dtype)
    for key in ("grad_hidden", "grad_weight"):
        assert bool(torch.isfinite(wg[key].float()).all()), key
        dev = contract.compare_grad(e, key, wg[key], mma[key], 1.0 + float(mma["lse"].abs().max()))
        print(f"RATIO bwd{n}x{v}x{h} {key} {e.dtype} vs mma {dev.ratio:.3g}")
        assert dev.ok, (key, dev)
