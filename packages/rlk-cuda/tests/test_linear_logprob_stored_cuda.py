"""The Hopper stored-logits pair (``linear_logprob_stored_fwd`` / ``_bwd``: ``fused_linear_policy_loss``'s one-pass
mode on rlk-cuda) on an H100 / H200: the forward gives the plain Hopper forward's bits and stores the logits it
reduces (against the fp64 reference); the backward from those logits against the recomputing backward and the fp64
reference (contract), with fp32 weight-gradient sums over row chunks, bitwise batch-invariant ``grad_hidden`` rows
and a deterministic ``grad_weight``; and ``fused_linear_policy_loss(mode="one_pass")`` on this backend against its
lean mode. Needs a GPU (marker ``gpu``).

Where the Hopper kernels cannot run this module collects no test, unless ``RLK_REQUIRE_WGMMA=1`` (then every test
fails saying why), like ``test_linear_logprob_wgmma.py``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("rlk_cuda", reason="rlk-cuda is not installed (bash ci/build_cuda.sh)")

from test_linear_logprob_cuda import IGNORE, REQUIRE_WGMMA, hopper_module, hopper_problem, make_inputs, probe_placements  # noqa: E402  (the sibling test module's helpers)

import rlk  # noqa: E402
from rlk.core import contract
from rlk.reference import logprob as ref  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
PROBLEM = hopper_problem("stored_problem")
__test__ = PROBLEM is None or REQUIRE_WGMMA


def _ck():
    return hopper_module(PROBLEM, "the stored Hopper pair")


def _forward(ck, hidden, weight, targets, inv_t, with_entropy=True, stored=True):
    """``{"logprob", "lse"[, "entropy"][, "logits"]}`` from the stored forward (or the plain one)."""
    n, v = hidden.shape[0], weight.shape[0]
    lp, ent, lse = (torch.empty(n, device="cuda") for _ in range(3))
    out = {"logprob": lp, "lse": lse}
    if with_entropy:
        out["entropy"] = ent
    if stored:
        out["logits"] = torch.full((n, v), float("nan"), device="cuda")
        ck.linear_logprob_stored_fwd(
            hidden, weight, targets, inv_t, IGNORE, lp, ent if with_entropy else None, lse, out["logits"]
        )
    else:
        ck.linear_logprob_fwd_wgmma(hidden, weight, targets, inv_t, IGNORE, lp, ent if with_entropy else None, lse)
    return out


def _stored_grads(ck, hidden, weight, targets, inv_t, grad_lp, grad_ent, fwd, weight_dtype=None):
    logits = fwd["logits"].clone()
    gh = torch.empty_like(hidden)
    gw = torch.empty(weight.shape, dtype=weight_dtype or weight.dtype, device="cuda")
    ck.linear_logprob_stored_bwd(
        hidden,
        weight,
        targets,
        inv_t,
        fwd["lse"],
        fwd.get("entropy"),
        grad_lp,
        grad_ent if "entropy" in fwd else None,
        IGNORE,
        logits,
        gh,
        gw,
        False,
    )
    return gh, gw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "v", "h"),
    [(1, 1000, 64), (133, 8200, 256), (300, 4352, 192), (129, 32003, 128), (7, 37, 100), (64, 151936, 4096)],
)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_stored_forward_is_the_forward_and_stores_its_logits(dtype, n, v, h, with_entropy):
    """logprob / entropy / lse bitwise the plain Hopper forward's (odd V, H not a multiple of 8, one and several
    splits); the stored z within the contract of the fp64 reference's z, every column written."""
    ck = _ck()
    hidden, weight, targets, inv_t, _, _ = make_inputs(n, v, h, dtype, seed=n + v + h)
    got = _forward(ck, hidden, weight, targets, inv_t, with_entropy)
    plain = _forward(ck, hidden, weight, targets, inv_t, with_entropy, stored=False)
    for key in plain:
        assert torch.equal(got[key], plain[key]), key
    truth = (hidden.double() @ weight.double().T) * inv_t.double()[:, None]
    scale = (hidden.double().abs() @ weight.double().abs().T) * inv_t.double()[:, None]
    assert bool(torch.isfinite(got["logits"]).all())  # every column written (the buffer started as NaN)
    dev = contract.compare_outputs(
        contract.entry("matmul", dtype), "logits", got["logits"].flatten(), truth.flatten(), scale.flatten()
    )
    assert dev.ok, dev


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "v", "h"), [(3, 5, 64), (133, 8200, 256), (300, 4352, 192), (129, 32003, 128), (37, 1001, 36)]
)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_stored_backward_matches_the_recomputing_backward_and_fp64(dtype, n, v, h, with_entropy):
    """grad_hidden / grad_weight from the stored logits against the recomputing Hopper backward and the fp64
    reference, under the contract's gradient tolerance (V not a multiple of 4: a padded copy; H = 36: padded)."""
    ck = _ck()
    hidden, weight, targets, inv_t, grad_lp, grad_ent = make_inputs(n, v, h, dtype, seed=n + v)
    fwd = _forward(ck, hidden, weight, targets, inv_t, with_entropy)
    gh, gw = _stored_grads(ck, hidden, weight, targets, inv_t, grad_lp, grad_ent, fwd)
    lean_h, lean_w = torch.empty_like(hidden), torch.empty_like(weight)
    ck.linear_logprob_bwd_wgmma(
        hidden,
        weight,
        targets,
        inv_t,
        fwd["lse"],
        fwd.get("entropy"),
        grad_lp,
        grad_ent if with_entropy else None,
        IGNORE,
        lean_h,
        lean_w,
    )
    th, tw = (
        torch.empty(hidden.shape, dtype=torch.float64, device="cuda"),
        torch.empty(weight.shape, dtype=torch.float64, device="cuda"),
    )
    lp64, ent64, lse64 = (torch.empty(n, dtype=torch.float64, device="cuda") for _ in range(3))
    ref.linear_logprob_fwd(hidden.double(), weight.double(), targets, inv_t.double(), IGNORE, lp64, ent64, lse64)
    ref.linear_logprob_bwd(
        hidden.double(),
        weight.double(),
        targets,
        inv_t.double(),
        lse64,
        ent64 if with_entropy else None,
        grad_lp.double(),
        grad_ent.double() if with_entropy else None,
        IGNORE,
        th,
        tw,
    )
    e = contract.entry("linear_logprob", dtype)
    scale = 1.0 + float(lse64.abs().max())
    for key, got, lean, truth in (("grad_hidden", gh, lean_h, th), ("grad_weight", gw, lean_w, tw)):
        assert got.dtype == dtype and bool(torch.isfinite(got.float()).all()), key
        for name, other in (("recomputing", lean), ("fp64", truth)):
            dev = contract.compare_grad(e, key, got, other, scale)
            print(f"RATIO stored_bwd{n}x{v}x{h} {key} {e.dtype} vs {name} {dev.ratio:.3g}")
            assert dev.ok, (key, name, dev)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp32_weight_sums_over_row_chunks(dtype):
    """grad_weight into fp32 over two row chunks (the second with accumulate) is the sum of the two chunks'
    products under the contract, and equals one fp32 call over all rows within it; accumulate into a 16-bit
    grad_weight is refused."""
    ck = _ck()
    n, v, h = 200, 9000, 256
    hidden, weight, targets, inv_t, grad_lp, grad_ent = make_inputs(n, v, h, dtype, seed=21)
    fwd = _forward(ck, hidden, weight, targets, inv_t, with_entropy=False)
    summed = torch.empty(weight.shape, dtype=torch.float32, device="cuda")
    for k, rows in enumerate((slice(0, 77), slice(77, n))):
        part = {key: value[rows] for key, value in fwd.items()}
        logits = part["logits"].clone()
        ck.linear_logprob_stored_bwd(
            hidden[rows].contiguous(),
            weight,
            targets[rows],
            inv_t[rows],
            part["lse"],
            None,
            grad_lp[rows],
            None,
            IGNORE,
            logits,
            None,
            summed,
            k > 0,
        )
    _, whole = _stored_grads(ck, hidden, weight, targets, inv_t, grad_lp, grad_ent, fwd, torch.float32)
    e = contract.entry("linear_logprob", dtype)
    dev = contract.compare_grad(e, "grad_weight", summed, whole.double(), 1.0 + float(fwd["lse"].abs().max()))
    assert dev.ok, dev
    with pytest.raises(ValueError, match="accumulate"):
        ck.linear_logprob_stored_bwd(
            hidden,
            weight,
            targets,
            inv_t,
            fwd["lse"],
            None,
            grad_lp,
            None,
            IGNORE,
            fwd["logits"].clone(),
            None,
            torch.empty_like(weight),
            True,
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_backward_rows_are_batch_invariant_and_weights_deterministic(dtype):
    """A probe row's grad_hidden is bitwise the same alone and inside batches of 7, 133 and 1024 rows at the first,
    a middle and the last position (Qwen's V, H = 1024); grad_weight is bitwise the same run to run."""
    ck = _ck()
    v, h = 151936, 1024
    hidden, weight, targets, inv_t, grad_lp, grad_ent = make_inputs(1024, v, h, dtype, seed=6)
    probe = 5

    def grad_hidden_of(index):
        args = (hidden[index].contiguous(), weight, targets[index], inv_t[index])
        fwd = _forward(ck, *args, with_entropy=True)
        return _stored_grads(ck, *args, grad_lp[index], grad_ent[index], fwd)

    alone, _ = grad_hidden_of(torch.tensor([probe], device="cuda"))
    for batch, position, index in probe_placements(probe):
        inside, _ = grad_hidden_of(index)
        assert torch.equal(alone[0], inside[position]), (batch, position)
    everything = torch.arange(300, device="cuda")
    assert torch.equal(grad_hidden_of(everything)[1], grad_hidden_of(everything)[1])


def test_fused_linear_policy_loss_one_pass_on_cuda_is_the_lean_mode():
    """``fused_linear_policy_loss(mode="one_pass")`` with rlk-cuda serving the log-probs (the automatic choice on
    this GPU; the policy loss itself falls through to triton): the loss and metrics bitwise its lean mode's (the
    same forward kernel), the gradients within the contract; ``auto`` is lean on this backend (not in
    ONE_PASS_BACKENDS)."""
    _ck()
    torch.manual_seed(0)
    b, t, h, v = 4, 300, 512, 32003
    hidden = torch.randn(b, t, h, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda") * h**-0.5).to(torch.bfloat16)
    targets = torch.randint(0, v, (b, t), device="cuda")
    mask = torch.rand(b, t, device="cuda") > 0.2
    old = torch.randn(b, t, device="cuda") * 0.1 - 3
    adv = torch.randn(b, t, device="cuda")

    def run(mode):
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, metrics = rlk.fused_linear_policy_loss(hh, ww, targets, old, adv, mask, mode=mode, chunk_tokens=512)
        loss.backward()
        return loss.detach(), metrics, hh.grad, ww.grad

    probe = hidden.clone().requires_grad_()
    decision = rlk.ops.linear_policy_loss.decide_mode(probe, weight, targets, mode="auto")
    assert decision.mode == "lean" and decision.backend == "cuda", decision
    decision = rlk.ops.linear_policy_loss.decide_mode(probe, weight, targets, mode="one_pass")
    assert decision.mode == "one_pass" and decision.backend == "cuda", decision
    one, lean = run("one_pass"), run("lean")
    assert torch.equal(one[0], lean[0])
    assert set(one[1]) == set(lean[1]) and all(torch.equal(one[1][k], lean[1][k]) for k in one[1])
    e = contract.entry("linear_logprob", torch.bfloat16)
    for k, name in ((2, "grad_hidden"), (3, "grad_weight")):
        dev = contract.compare_grad(e, name, one[k], lean[k].double(), 10.0)
        assert dev.ok, (name, dev)
