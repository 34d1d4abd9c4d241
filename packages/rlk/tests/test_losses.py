"""The public loss ops (``value_loss``, ``dpo_loss``) and the aggregation helper on the reference backend.

Ground truth: independent fp64 re-derivations, in plain PyTorch below, of the formulas the frameworks
use (verl's and OpenRLHF's PPO critic loss, TRL's DPO variants with their defaults), and of the
aggregation modes of RL_MATH.md. Tolerances come from the contract (``rlk.core.contract``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import rlk
from rlk.core import abi, contract
from rlk.reference import aggregation

AGGS = abi.AGG_MODES
F32 = torch.float32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------
# independent re-derivations (fp64)
# ---------------------------------------------------------------------------


def _agg_truth(loss, mask, agg, global_tokens=None, global_seqs=None, loss_scale=None):
    """RL_MATH.md "Aggregation", written out per mode (no rlk code)."""
    m = mask.double()
    tok = (loss * m).sum(-1)  # sum_t L*m per sequence (masked positions already zeroed)
    n = m.sum(-1)
    has = (n > 0).double()
    n_tok = global_tokens if global_tokens is not None else max(float(n.sum()), 1.0)
    n_seq = global_seqs if global_seqs is not None else max(float(has.sum()), 1.0)
    if agg == "token-mean":
        return tok.sum() / n_tok
    if agg == "token-sum":
        return tok.sum()
    if agg == "seq-mean-token-sum":
        return (has * tok).sum() / n_seq
    if agg == "seq-mean-token-mean":
        return (has * tok / n.clamp(min=1)).sum() / n_seq
    if agg == "seq-mean-token-sum-norm":
        return (has * tok).sum() / n_seq / loss_scale
    raise AssertionError(agg)


def _verl_value_loss(values, old_values, returns, mask, clip, agg, **norms):
    """verl's critic loss: clip_by_value around the old values, elementwise max, 0.5 * agg, clip fraction."""
    v, v_old, ret = values.double(), old_values.double(), returns.double()
    l1 = (v - ret) ** 2
    if clip is None:
        per_token, frac = l1, torch.zeros((), dtype=torch.float64)
    else:
        v_clipped = torch.max(torch.min(v, v_old + clip), v_old - clip)
        l2 = (v_clipped - ret) ** 2
        per_token = torch.max(l1, l2)
        frac = ((l2 > l1) & mask).sum() / mask.sum().clamp(min=1)
    per_token = torch.where(mask, per_token, 0.0)
    loss = 0.5 * _agg_truth(per_token, mask, agg, **norms)
    v_mean = torch.where(mask, v, 0.0).sum() / mask.sum().clamp(min=1)
    return loss, frac.double(), v_mean


def _openrlhf_value_loss(values, old_values, returns, mask, clip):
    """OpenRLHF's ValueLoss: old + clamp(v - old, +-eps), max of squares, per-sequence masked mean, batch mean, 0.5x."""
    v, v_old, ret, m = values.double(), old_values.double(), returns.double(), mask.double()
    if clip is None:
        per_token = (v - ret) ** 2
    else:
        v_clipped = v_old + (v - v_old).clamp(-clip, clip)
        per_token = torch.max((v_clipped - ret) ** 2, (v - ret) ** 2)
    per_seq = (per_token * m).sum(-1) / m.sum(-1)
    return 0.5 * per_seq.mean()


def _trl_dpo(lc, lr, lc_ref, lr_ref, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, len_c=None, len_r=None):
    """TRL's DPO losses and rewards (ipo on length-averaged log-probs); also returns x and dl/dx."""
    lc, lr, lc_ref, lr_ref = (t.double() for t in (lc, lr, lc_ref, lr_ref))
    if loss_type == "ipo":
        lc, lc_ref = lc / len_c.double(), lc_ref / len_c.double()
        lr, lr_ref = lr / len_r.double(), lr_ref / len_r.double()
    logits = ((lc - lr) - (lc_ref - lr_ref)).detach().requires_grad_(True)
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = (-F.logsigmoid(beta * logits) * (1 - eps) + F.logsigmoid(-beta * logits) * eps) / (1 - 2 * eps)
    (dl_dx,) = torch.autograd.grad(losses.sum(), logits)
    rewards_c, rewards_r = beta * (lc - lc_ref), beta * (lr - lr_ref)
    return losses.detach(), rewards_c.detach(), rewards_r.detach(), dl_dx, (lc, lr, lc_ref, lr_ref)


# ---------------------------------------------------------------------------
# inputs and contract checks
# ---------------------------------------------------------------------------


def _value_inputs(b=6, t=23, seed=0, dtype=F32, empty_row=True):
    g = _gen(seed)
    values = torch.randn(b, t, generator=g)
    old_values = values + 0.6 * torch.randn(b, t, generator=g)
    returns = torch.randn(b, t, generator=g) * 1.5
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if empty_row and b >= 3:
        mask[2] = False
    return values.to(dtype), old_values.to(dtype), returns.to(dtype), mask


def _check_value(loss, metrics, truth, values, mask, dtype=F32):
    e = contract.entry("value_loss", dtype)
    ref_loss, ref_frac, ref_mean = truth
    one = torch.ones(1, dtype=torch.float64)
    v_abs = torch.where(mask, values.double().abs(), 0.0).sum() / mask.sum().clamp(min=1)
    for name, got, ref, scale in (
        ("loss", loss, ref_loss, 1 + ref_loss.abs()),
        ("vf_clip_fraction", metrics["vf_clip_fraction"], ref_frac, one),
        ("values_mean", metrics["values_mean"], ref_mean, 1 + v_abs),
    ):
        assert got.dtype == F32 and got.shape == ()
        dev = contract.compare_outputs(e, name, got.reshape(1), ref.reshape(1), scale.reshape(1))
        assert dev.ok, dev


def _check_value_grad(grad, ref_grad):
    dev = contract.compare_grad(contract.entry("value_loss", F32), "grad_values", grad, ref_grad, 1.0)
    assert dev.ok, dev


# ---------------------------------------------------------------------------
# value_loss
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [0.5, 0.2, None])
@pytest.mark.parametrize("agg", AGGS)
def test_value_loss_matches_verl(agg, clip):
    values, old_values, returns, mask = _value_inputs()
    norms = {"loss_scale": 32} if agg == "seq-mean-token-sum-norm" else {}
    v = values.clone().requires_grad_(True)
    loss, metrics = rlk.value_loss(v, old_values, returns, mask, clip=clip, agg=agg, **norms)
    loss.backward()
    v64 = values.double().requires_grad_(True)
    truth = _verl_value_loss(v64, old_values, returns, mask, clip, agg, **norms)
    truth[0].backward()
    _check_value(loss, metrics, tuple(t.detach() for t in truth), values, mask)
    _check_value_grad(v.grad, v64.grad)
    assert bool((v.grad[~mask] == 0).all())
    if clip is not None:
        assert 0 < float(metrics["vf_clip_fraction"]) < 1  # the case exercises both branches


def test_value_loss_defaults_are_verls():
    """clip 0.5, token-mean: verl's defaults (cliprange_value 0.5, loss_agg_mode token-mean)."""
    values, old_values, returns, mask = _value_inputs(seed=1)
    loss, _ = rlk.value_loss(values, old_values, returns, mask)
    truth = _verl_value_loss(values, old_values, returns, mask, 0.5, "token-mean")
    assert contract.compare_outputs(
        contract.entry("value_loss", F32), "loss", loss.reshape(1), truth[0].reshape(1), 1 + truth[0].abs().reshape(1)
    ).ok


@pytest.mark.parametrize("clip", [0.5, None])
def test_value_loss_matches_openrlhf(clip):
    """OpenRLHF's ValueLoss is seq-mean-token-mean (all rows non-empty)."""
    values, old_values, returns, mask = _value_inputs(seed=2, empty_row=False)
    v = values.clone().requires_grad_(True)
    loss, _ = rlk.value_loss(v, old_values, returns, mask, clip=clip, agg="seq-mean-token-mean")
    loss.backward()
    v64 = values.double().requires_grad_(True)
    ref = _openrlhf_value_loss(v64, old_values, returns, mask, clip)
    ref.backward()
    e = contract.entry("value_loss", F32)
    assert contract.compare_outputs(
        e, "loss", loss.reshape(1), ref.detach().reshape(1), 1 + ref.detach().abs().reshape(1)
    ).ok
    _check_value_grad(v.grad, v64.grad)


def test_value_loss_without_old_values_when_unclipped():
    values, old_values, returns, mask = _value_inputs(seed=3)
    with_old = rlk.value_loss(values, old_values, returns, mask, clip=None)
    without = rlk.value_loss(values, None, returns, mask, clip=None)
    assert torch.equal(with_old[0], without[0])
    assert float(without[1]["vf_clip_fraction"]) == 0.0


@pytest.mark.parametrize("agg", AGGS)
def test_value_loss_micro_batches_add_up_with_global_normalizers(agg):
    """Split the step into micro-batches: losses add up to the full-batch loss, gradients are equal."""
    values, old_values, returns, mask = _value_inputs(b=9, t=17, seed=4)
    n_tok, n_seq = int(mask.sum()), int(mask.any(-1).sum())
    norms = {"global_tokens": n_tok, "global_seqs": n_seq}
    if agg == "seq-mean-token-sum-norm":
        norms["loss_scale"] = 17
    v = values.clone().requires_grad_(True)
    full, _ = rlk.value_loss(v, old_values, returns, mask, agg=agg, **norms)
    (full_grad,) = torch.autograd.grad(full, v)
    total = torch.zeros((), dtype=torch.float64)
    grads = []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 9)):
        part = v[rows].detach().requires_grad_(True)
        loss, _ = rlk.value_loss(part, old_values[rows], returns[rows], mask[rows], agg=agg, **norms)
        total = total + loss.double()
        grads.append(torch.autograd.grad(loss, part)[0])
    e = contract.entry("value_loss", F32)
    assert contract.compare_outputs(
        e, "loss", total.reshape(1), full.double().reshape(1), 1 + full.double().abs().reshape(1)
    ).ok
    _check_value_grad(torch.cat(grads), full_grad.double())
    # without global normalizers the local micro-batch is the whole batch: the sum differs for the mean modes
    if agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        local = sum(
            float(rlk.value_loss(values[r], old_values[r], returns[r], mask[r], agg=agg)[0])
            for r in (slice(0, 2), slice(2, 3), slice(3, 9))
        )
        assert abs(local - float(full.detach())) > 1e-3


def test_value_loss_tensor_normalizers():
    values, old_values, returns, mask = _value_inputs(seed=5)
    as_int = rlk.value_loss(values, old_values, returns, mask, agg="token-mean", global_tokens=100)[0]
    as_tensor = rlk.value_loss(values, old_values, returns, mask, agg="token-mean", global_tokens=torch.tensor(100))[0]
    assert torch.equal(as_int, as_tensor)
    norm_int = rlk.value_loss(
        values, old_values, returns, mask, agg="seq-mean-token-sum-norm", global_seqs=8, loss_scale=64
    )[0]
    norm_tensor = rlk.value_loss(
        values,
        old_values,
        returns,
        mask,
        agg="seq-mean-token-sum-norm",
        global_seqs=torch.tensor([8.0]),
        loss_scale=torch.tensor(64),
    )[0]
    torch.testing.assert_close(norm_int, norm_tensor, rtol=1e-6, atol=0)


@pytest.mark.parametrize("agg", AGGS)
def test_value_loss_empty_mask_is_zero(agg):
    values, old_values, returns, _ = _value_inputs(seed=6)
    mask = torch.zeros_like(values, dtype=torch.bool)
    values[0, 0] = math.nan  # masked out: must not matter
    norms = {"loss_scale": 4.0} if agg == "seq-mean-token-sum-norm" else {}
    v = values.clone().requires_grad_(True)
    loss, metrics = rlk.value_loss(v, old_values, returns, mask, agg=agg, **norms)
    loss.backward()
    assert float(loss.detach()) == 0.0 and all(float(m) == 0.0 for m in metrics.values())
    assert bool((v.grad == 0).all())


def test_value_loss_masked_garbage_does_not_leak():
    values, old_values, returns, mask = _value_inputs(seed=7)
    clean = rlk.value_loss(values.clone().requires_grad_(True), old_values, returns, mask)
    dirty = [t.clone() for t in (values, old_values, returns)]
    for t, fill in zip(dirty, (math.inf, math.nan, -math.inf)):
        t[~mask] = fill
    v = dirty[0].requires_grad_(True)
    loss, metrics = rlk.value_loss(v, dirty[1], dirty[2], mask)
    loss.backward()
    assert torch.equal(loss, clean[0])
    assert all(torch.equal(metrics[k], clean[1][k]) for k in metrics)
    assert bool(torch.isfinite(v.grad).all()) and bool((v.grad[~mask] == 0).all())


@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dirty", ["values", "old_values", "returns"])
@pytest.mark.parametrize("clip, agg", [(0.2, "token-mean"), (None, "seq-mean-token-mean"), (0.5, "token-sum")])
def test_value_loss_masked_garbage_in_each_input(dirty, fill, clip, agg):
    """NaN / inf at the masked positions of any one input: loss, metrics and gradient are bitwise those
    of the same call with 0 there (the gradient is 0 at masked positions, as documented)."""
    inputs = dict(zip(("values", "old_values", "returns"), _value_inputs(seed=9)[:3]))
    mask = _value_inputs(seed=9)[3]
    mask[0, 3:6] = False  # interior holes, as multi-turn masks have
    outs = []
    for value in (0.0, fill):
        x = {k: torch.where(mask, t, value) if k == dirty else torch.where(mask, t, 0.0) for k, t in inputs.items()}
        v = x["values"].requires_grad_(True)
        loss, metrics = rlk.value_loss(v, x["old_values"], x["returns"], mask, clip=clip, agg=agg)
        loss.backward()
        outs.append((loss.detach(), metrics, v.grad))
    (loss0, metrics0, grad0), (loss1, metrics1, grad1) = outs
    assert torch.equal(loss1, loss0) and torch.equal(grad1, grad0)
    assert all(torch.equal(metrics1[k], metrics0[k]) for k in metrics0)
    assert bool((grad1[~mask] == 0).all()) and bool(torch.isfinite(loss1))


def test_value_loss_float_and_int_masks_and_16_bit_inputs():
    values, old_values, returns, mask = _value_inputs(seed=8)
    expected = rlk.value_loss(values, old_values, returns, mask)[0]
    assert torch.equal(rlk.value_loss(values, old_values, returns, mask.float())[0], expected)
    assert torch.equal(rlk.value_loss(values, old_values, returns, mask.long())[0], expected)
    v = values.to(torch.bfloat16).requires_grad_(True)
    loss, _ = rlk.value_loss(v, old_values.to(torch.bfloat16), returns, mask)
    loss.backward()
    assert loss.dtype == F32 and v.grad.dtype == torch.bfloat16
    v32 = v.detach().float().requires_grad_(True)
    loss32, _ = rlk.value_loss(v32, old_values.to(torch.bfloat16).float(), returns, mask)
    loss32.backward()
    assert torch.equal(loss, loss32) and torch.equal(v.grad, v32.grad.to(torch.bfloat16))


def test_value_loss_empty_shapes():
    for shape in ((0, 5), (3, 0)):
        v = torch.randn(shape, requires_grad=True)
        loss, metrics = rlk.value_loss(v, torch.randn(shape), torch.randn(shape), torch.ones(shape, dtype=torch.bool))
        loss.backward()
        assert float(loss.detach()) == 0.0 and v.grad.shape == shape and float(metrics["values_mean"]) == 0.0


def test_value_loss_fp64_gradcheck():
    values, old_values, returns, mask = (t.double() if t.is_floating_point() else t for t in _value_inputs(b=4, t=7))
    for agg in ("token-mean", "seq-mean-token-mean"):
        assert torch.autograd.gradcheck(
            lambda v, agg=agg: rlk.value_loss(v, old_values, returns, mask, clip=0.3, agg=agg)[0],
            (values.requires_grad_(True),),
        )


_V = torch.randn(3, 4)
_B = torch.ones(3, 4, dtype=torch.bool)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(values=_V[0]), ValueError, r"values: expected shape \[B, T\], got \(4,\)"),
        (dict(values=_V.long()), TypeError, "values: expected dtype"),
        (dict(returns=_V[:2]), ValueError, r"returns: expected shape \(3, 4\) \(the shape of values\)"),
        (dict(old_values=_V.T), ValueError, r"old_values: expected shape \(3, 4\)"),
        (dict(old_values=None), ValueError, "old_values: needed when clip is set"),
        (dict(mask=_B[:, :2]), ValueError, r"mask: expected shape \(3, 4\)"),
        (dict(mask=[[1]]), TypeError, "mask: expected a torch.Tensor"),
        (dict(returns=torch.zeros(3, 4, device="meta")), ValueError, "returns: expected device cpu"),
        (dict(clip=-0.1), ValueError, "clip: must be a finite number >= 0, got -0.1"),
        (dict(clip=math.inf), ValueError, "clip: must be a finite number"),
        (dict(clip="0.2"), TypeError, "clip: expected a number"),
        (dict(agg="mean"), ValueError, "agg: expected one of 'token-mean'"),
        (dict(agg="seq-mean-token-sum-norm"), ValueError, "loss_scale: agg='seq-mean-token-sum-norm' needs"),
        (dict(loss_scale=10), ValueError, "loss_scale: only agg='seq-mean-token-sum-norm' uses it"),
        (dict(global_tokens=0), ValueError, "global_tokens: must be a finite number > 0, got 0"),
        (dict(global_seqs=True), TypeError, "global_seqs: expected a number or a one-element tensor"),
        (
            dict(global_tokens=torch.ones(2)),
            ValueError,
            r"global_tokens: expected a number or a one-element tensor, "
            r"got shape \(2,\)",
        ),
        (dict(global_tokens=torch.ones((), device="meta")), ValueError, "global_tokens: expected device cpu"),
    ],
)
def test_value_loss_bad_input_gets_a_clear_error(kwargs, error, message):
    args = dict(values=_V, old_values=_V, returns=_V, mask=_B)
    args.update(kwargs)
    positional = [args.pop(k) for k in ("values", "old_values", "returns", "mask")]
    with pytest.raises(error, match=message):
        rlk.value_loss(*positional, **args)


# ---------------------------------------------------------------------------
# aggregation helper
# ---------------------------------------------------------------------------


def test_aggregation_weights_match_the_formulas():
    g = _gen(9)
    mask = torch.rand(5, 6, generator=g) > 0.4
    mask[1] = False
    loss = torch.randn(5, 6, generator=g, dtype=torch.float64)
    for agg in AGGS:
        for norms in ({}, {"global_tokens": 40, "global_seqs": 7}):
            norms = dict(norms, **({"loss_scale": 6} if agg == "seq-mean-token-sum-norm" else {}))
            w = aggregation.token_weights(mask, agg, dtype=torch.float64, **norms)
            expected = _agg_truth(torch.where(mask, loss, 0.0), mask, agg, **norms)
            torch.testing.assert_close((w * loss).sum(), expected, rtol=1e-14, atol=1e-14)
            torch.testing.assert_close(
                aggregation.aggregate(loss, mask, agg, **norms), expected, rtol=1e-14, atol=1e-14
            )
            assert bool((w[~mask] == 0).all()) and w.dtype == torch.float64
            c = aggregation.row_weights(mask, agg, dtype=torch.float64, **norms)
            assert c.shape == (5,) and torch.equal(w, torch.where(mask, c[:, None], 0.0))


def test_aggregation_empty_mask_and_garbage():
    mask = torch.zeros(3, 4, dtype=torch.bool)
    loss = torch.full((3, 4), math.nan)
    for agg in AGGS:
        norms = {"loss_scale": 4} if agg == "seq-mean-token-sum-norm" else {}
        assert float(aggregation.aggregate(loss, mask, agg, **norms)) == 0.0
        assert bool(torch.isfinite(aggregation.row_weights(mask, agg, **norms)).all())


def test_aggregation_rejects_bad_mask():
    with pytest.raises(ValueError, match=r"mask: expected a \[B, T\] tensor"):
        aggregation.row_weights(torch.ones(3, dtype=torch.bool), "token-mean")


# ---------------------------------------------------------------------------
# dpo_loss
# ---------------------------------------------------------------------------


def _dpo_inputs(p=29, seed=10):
    g = _gen(seed)
    len_c = torch.randint(1, 400, (p,), generator=g)
    len_r = torch.randint(1, 400, (p,), generator=g)
    lc = -len_c * (0.2 + torch.rand(p, generator=g))
    lr = -len_r * (0.2 + torch.rand(p, generator=g))
    lc_ref = lc + 8 * torch.randn(p, generator=g)
    lr_ref = lr + 8 * torch.randn(p, generator=g)
    return lc, lr, lc_ref, lr_ref, len_c, len_r


def _dpo_scales(loss_type, beta, dl_dx, losses, logps):
    """Contract scales: per pair, reduced, rewards, gradient (see contract.json ``dpo_loss.scale``)."""
    s = 1 + sum(t.abs() for t in logps)
    per_pair = 1 + losses.abs() + dl_dx.abs() * s
    k = 1.0 if loss_type == "ipo" else beta
    return s, per_pair, 1 + beta * s.mean(), float((k * s).max())


VARIANTS = [("sigmoid", 0.0), ("sigmoid", 0.2), ("hinge", 0.0), ("ipo", 0.0), ("robust", 0.0), ("robust", 0.3)]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("loss_type, smoothing", VARIANTS)
def test_dpo_matches_trl(loss_type, smoothing, reduction):
    lc, lr, lc_ref, lr_ref, len_c, len_r = _dpo_inputs()
    beta = 0.1 if loss_type != "hinge" else 0.05
    a, b = lc.clone().requires_grad_(True), lr.clone().requires_grad_(True)
    lengths = {"chosen_length": len_c, "rejected_length": len_r} if loss_type == "ipo" else {}
    loss, metrics = rlk.dpo_loss(
        a, b, lc_ref, lr_ref, beta=beta, loss=loss_type, label_smoothing=smoothing, reduction=reduction, **lengths
    )
    weights = torch.randn(lc.shape, generator=_gen(11)) if reduction == "none" else torch.ones(())
    (loss * weights).sum().backward()

    losses, r_c, r_r, dl_dx, logps = _trl_dpo(lc, lr, lc_ref, lr_ref, beta, loss_type, smoothing, len_c, len_r)
    s, per_pair, reward_scale, grad_scale = _dpo_scales(loss_type, beta, dl_dx, losses, logps)
    e = contract.entry("dpo_loss", F32)
    reduce = {"mean": torch.mean, "sum": torch.sum, "none": lambda t: t}[reduction]
    ref_loss, ref_scale = reduce(losses), reduce(per_pair)
    assert loss.dtype == F32 and loss.shape == ref_loss.shape
    assert contract.compare_outputs(e, "loss", loss.reshape(-1), ref_loss.reshape(-1), ref_scale.reshape(-1)).ok
    for name, ref in (
        ("rewards_chosen", r_c.mean()),
        ("rewards_rejected", r_r.mean()),
        ("reward_margin", (r_c - r_r).mean()),
    ):
        dev = contract.compare_outputs(e, name, metrics[name].reshape(1), ref.reshape(1), reward_scale.reshape(1))
        assert dev.ok, dev
    assert float(metrics["reward_accuracy"]) == pytest.approx(float((r_c > r_r).double().mean()), abs=e.atol)
    assert 0 < float(metrics["reward_accuracy"]) < 1

    a64, b64 = lc.double().requires_grad_(True), lr.double().requires_grad_(True)
    ref_losses = _trl_dpo_differentiable(a64, b64, lc_ref, lr_ref, beta, loss_type, smoothing, len_c, len_r)
    (reduce(ref_losses) * weights.double()).sum().backward()
    for name, got, ref in (("grad_chosen", a.grad, a64.grad), ("grad_rejected", b.grad, b64.grad)):
        dev = contract.compare_grad(e, name, got, ref, grad_scale)
        assert dev.ok, dev


def _trl_dpo_differentiable(lc, lr, lc_ref, lr_ref, beta, loss_type, eps, len_c, len_r):
    """The same TRL formulas as :func:`_trl_dpo`, differentiable w.r.t. lc and lr."""
    lc_ref, lr_ref = lc_ref.double(), lr_ref.double()
    if loss_type == "ipo":
        lc, lc_ref, lr, lr_ref = lc / len_c, lc_ref / len_c, lr / len_r, lr_ref / len_r
    logits = (lc - lr) - (lc_ref - lr_ref)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
    if loss_type == "hinge":
        return torch.relu(1 - beta * logits)
    if loss_type == "ipo":
        return (logits - 1 / (2 * beta)) ** 2
    return (-F.logsigmoid(beta * logits) * (1 - eps) + F.logsigmoid(-beta * logits) * eps) / (1 - 2 * eps)


def test_dpo_defaults_are_trls():
    """beta 0.1, sigmoid, no label smoothing, mean: TRL's DPOConfig defaults."""
    lc, lr, lc_ref, lr_ref, _, _ = _dpo_inputs(seed=12)
    loss, _ = rlk.dpo_loss(lc, lr, lc_ref, lr_ref)
    losses, *_ = _trl_dpo(lc, lr, lc_ref, lr_ref)
    torch.testing.assert_close(loss.double(), losses.mean(), rtol=1e-6, atol=1e-6)


def test_dpo_extreme_margins_are_finite():
    """|beta x| up to 1e3: logsigmoid and sigmoid must neither overflow nor lose the small tail (u = 30)."""
    lc = torch.tensor([-10.0, -10000.0, -5.0, -20.0])
    lr = torch.tensor([-310.0, -10.0, -5.0, -20.0 - 1e-3])
    zeros = torch.zeros(4)
    for loss_type in ("sigmoid", "robust", "hinge"):
        a = lc.clone().requires_grad_(True)
        losses, _ = rlk.dpo_loss(
            a, lr, zeros, zeros, loss=loss_type, reduction="none", label_smoothing=0.1 if loss_type != "hinge" else 0.0
        )
        losses.sum().backward()
        assert bool(torch.isfinite(losses).all()) and bool(torch.isfinite(a.grad).all())
    losses, _ = rlk.dpo_loss(lc, lr, zeros, zeros, reduction="none")
    truth = -F.logsigmoid(0.1 * ((lc - lr).double()))
    assert 0 < float(losses[0]) < 1e-12
    torch.testing.assert_close(losses.double(), truth, rtol=1e-5, atol=0)


def test_dpo_ipo_lengths_below_one_count_as_one_and_16_bit_inputs():
    lc, lr, lc_ref, lr_ref, len_c, len_r = _dpo_inputs(p=5, seed=13)
    len_r[0] = 0
    got, _ = rlk.dpo_loss(
        lc, lr, lc_ref, lr_ref, loss="ipo", chosen_length=len_c, rejected_length=len_r, reduction="none"
    )
    ones = len_r.clone()
    ones[0] = 1
    assert torch.equal(
        got,
        rlk.dpo_loss(
            lc,
            lr,
            lc_ref,
            lr_ref,
            loss="ipo",
            chosen_length=len_c.float(),
            rejected_length=ones.float(),
            reduction="none",
        )[0],
    )
    a = lc.to(torch.bfloat16).requires_grad_(True)
    loss, metrics = rlk.dpo_loss(a, lr.to(torch.bfloat16), lc_ref, lr_ref)
    loss.backward()
    assert loss.dtype == F32 and a.grad.dtype == torch.bfloat16 and metrics["reward_margin"].dtype == F32


def test_dpo_ties():
    """Equal rewards are not accurate (strict >, as TRL); x = 0 gives log 2 for sigmoid, 1 for hinge."""
    lc = torch.tensor([-5.0, -7.0, -3.0])
    lr = torch.tensor([-5.0, -7.0, -4.0])
    zeros = torch.zeros(3)
    for loss_type, at_zero in (("sigmoid", math.log(2)), ("hinge", 1.0), ("robust", math.log(2))):
        losses, metrics = rlk.dpo_loss(lc, lr, zeros, zeros, loss=loss_type, reduction="none")
        assert float(metrics["reward_accuracy"]) == pytest.approx(1 / 3)
        assert float(losses[0]) == pytest.approx(at_zero, rel=1e-6)


def test_dpo_no_pairs():
    a = torch.zeros(0, requires_grad=True)
    loss, metrics = rlk.dpo_loss(a, torch.zeros(0), torch.zeros(0), torch.zeros(0))
    loss.backward()
    assert float(loss.detach()) == 0.0 and all(float(m) == 0.0 for m in metrics.values()) and a.grad.shape == (0,)
    losses, _ = rlk.dpo_loss(torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0), reduction="none")
    assert losses.shape == (0,)


def test_dpo_only_one_input_needs_grad_and_metrics_are_constants():
    lc, lr, lc_ref, lr_ref, _, _ = _dpo_inputs(p=6, seed=14)
    b = lr.clone().requires_grad_(True)
    loss, metrics = rlk.dpo_loss(lc, b, lc_ref, lr_ref)
    loss.backward()
    assert b.grad is not None and bool((b.grad > 0).all())  # pushing the rejected log-prob up raises the loss
    assert not any(m.requires_grad for m in metrics.values())


def test_dpo_fp64_gradcheck():
    lc, lr, lc_ref, lr_ref, len_c, len_r = (t.double() for t in _dpo_inputs(p=5, seed=15))
    lengths = {"chosen_length": len_c, "rejected_length": len_r}
    for loss_type, eps in (("sigmoid", 0.1), ("ipo", 0.0), ("robust", 0.2), ("hinge", 0.0)):
        assert torch.autograd.gradcheck(
            lambda a, b, t=loss_type, e=eps: rlk.dpo_loss(
                a, b, lc_ref, lr_ref, loss=t, label_smoothing=e, reduction="none", **lengths
            )[0],
            (lc.clone().requires_grad_(True), lr.clone().requires_grad_(True)),
        )


_P = torch.randn(4)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(chosen=_P[None]), ValueError, r"chosen_logprob: expected shape \[P\]"),
        (dict(rejected=_P[:3]), ValueError, r"rejected_logprob: expected shape \(4,\) \(the shape of chosen_logprob\)"),
        (dict(ref_chosen=_P.long()), TypeError, "ref_chosen_logprob: expected dtype"),
        (dict(ref_rejected=torch.zeros(4, device="meta")), ValueError, "ref_rejected_logprob: expected device cpu"),
        (dict(beta=0.0), ValueError, "beta: must be a finite number > 0, got 0.0"),
        (dict(beta=None), TypeError, "beta: expected a number"),
        (dict(loss="kto"), ValueError, "loss: expected one of 'sigmoid', 'hinge', 'ipo', 'robust', got 'kto'"),
        (dict(loss="robust", label_smoothing=0.5), ValueError, r"label_smoothing: must lie in \[0, 0.5\) for"),
        (dict(label_smoothing=0.7), ValueError, r"label_smoothing: must lie in \[0, 0.5\] for loss='sigmoid'"),
        (dict(label_smoothing=-0.1), ValueError, "label_smoothing: must be a finite number >= 0"),
        (dict(loss="hinge", label_smoothing=0.1), ValueError, "label_smoothing: loss='hinge' has no label smoothing"),
        (dict(loss="ipo"), ValueError, "chosen_length and rejected_length: loss='ipo' normalizes"),
        (dict(loss="ipo", chosen_length=torch.ones(4)), ValueError, "^rejected_length: loss='ipo'"),
        (
            dict(loss="ipo", chosen_length=torch.ones(3), rejected_length=torch.ones(4)),
            ValueError,
            r"chosen_length: expected shape \(4,\)",
        ),
        (
            dict(loss="ipo", chosen_length=[1, 2, 3, 4], rejected_length=torch.ones(4)),
            TypeError,
            "chosen_length: expected a torch.Tensor",
        ),
        (dict(reduction="avg"), ValueError, "reduction: expected one of 'mean', 'sum', 'none', got 'avg'"),
    ],
)
def test_dpo_bad_input_gets_a_clear_error(kwargs, error, message):
    args = dict(chosen=_P, rejected=_P, ref_chosen=_P, ref_rejected=_P)
    args.update(kwargs)
    positional = [args.pop(k) for k in ("chosen", "rejected", "ref_chosen", "ref_rejected")]
    with pytest.raises(error, match=message):
        rlk.dpo_loss(*positional, **args)


_IPO_LENGTHS = dict(loss="ipo", chosen_length=torch.ones(4), rejected_length=torch.ones(4))


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.triton_interpreter)])
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(_IPO_LENGTHS, chosen_length=torch.tensor([3.0, math.nan, 2.0, 1.0])),
            r"chosen_length: must be finite and >= 0; found nan at position 1",
        ),
        (
            dict(_IPO_LENGTHS, rejected_length=torch.tensor([3.0, 2.0, math.inf, 1.0])),
            r"rejected_length: must be finite and >= 0; found inf at position 2",
        ),
        (
            dict(_IPO_LENGTHS, rejected_length=torch.tensor([3, 2, -1, 1])),
            r"rejected_length: must be finite and >= 0; found -1.0 at position 2",
        ),
        (dict(beta=1e-50), r"beta: 1e-50 rounds to 0 in torch.float32"),
        (dict(beta=1e39), r"beta: 1e\+39 overflows torch.float32"),
        (dict(_IPO_LENGTHS, beta=1e-300), r"beta: 1e-300 rounds to 0 in torch.float32"),
        (
            dict(_IPO_LENGTHS, beta=1e-30),
            r"beta: 1e-30 is so small that the ipo loss \(x - 1 / \(2 beta\)\)\^2 overflows",
        ),
    ],
)
def test_dpo_refuses_non_finite_lengths_and_beta(backend, kwargs, message):
    """IPO with a NaN ``chosen_length`` or an inf ``rejected_length`` used to give a NaN loss or silently zero the
    pair's log-probs, ``beta=1e-50`` (0 in float32) was accepted, and IPO with ``beta=1e-300`` gave an inf loss: the
    lengths are checked inside the op where they are read (finite, >= 0; one synchronization), ``beta`` at the call
    (nonzero and finite in float32, and for ipo ``(1 / (2 beta))^2`` too)."""
    with rlk.use_backend(backend), pytest.raises(ValueError, match=message):
        rlk.dpo_loss(_P, _P - 1, _P * 0.5, _P * 0.5, **kwargs)


def test_dpo_lengths_checks_follow_the_switch(monkeypatch):
    """The lengths are checked where they are used (ipo) and like every value check, skipped with RLK_CHECK_VALUES=0;
    beta (a number) always."""
    nan = torch.tensor([1.0, math.nan, 1.0, 1.0])
    rlk.dpo_loss(_P, _P, _P, _P, chosen_length=nan, rejected_length=nan)  # sigmoid: the lengths are not read
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")
    loss, _ = rlk.dpo_loss(_P, _P, _P, _P, loss="ipo", chosen_length=nan, rejected_length=torch.ones(4))
    assert math.isnan(float(loss))
    rlk.dpo_loss(_P, _P, _P, _P, loss="ipo", beta=2.8e-20, chosen_length=torch.ones(4), rejected_length=torch.ones(4))
    with pytest.raises(ValueError, match="beta: 1e-50 rounds to 0"):
        rlk.dpo_loss(_P, _P, _P, _P, beta=1e-50)


# ---------------------------------------------------------------------------
# torch.library integration
# ---------------------------------------------------------------------------


def test_opcheck_loss_custom_ops():
    values, old_values, returns, mask = _value_inputs(b=4, t=9, seed=16)
    weights = aggregation.row_weights(mask, "seq-mean-token-mean")
    v = values.requires_grad_(True)
    for clip in (0.4, None):
        torch.library.opcheck(torch.ops.rlk.value_loss_fwd.default, (v, old_values, returns, mask, weights, clip, ""))
        torch.library.opcheck(
            torch.ops.rlk.value_loss_bwd.default,
            (values.detach(), old_values, returns, mask, weights, clip, torch.tensor(1.5), "reference"),
        )
    lc, lr, lc_ref, lr_ref, len_c, len_r = _dpo_inputs(p=6, seed=17)
    a, b = lc.requires_grad_(True), lr.requires_grad_(True)
    for loss_type, lengths in (("sigmoid", (None, None)), ("ipo", (len_c.float(), len_r.float()))):
        for mean in (True, False):
            args = (a, b, lc_ref, lr_ref, *lengths, 0.1, loss_type, 0.0, mean)
            torch.library.opcheck(torch.ops.rlk.dpo_loss_fwd.default, args)
            torch.library.opcheck(
                torch.ops.rlk.dpo_loss_bwd.default,
                (
                    *(t.detach() if isinstance(t, torch.Tensor) else t for t in args),
                    torch.randn(6),
                    torch.tensor(2.0),
                    "reference",
                ),
            )


def test_torch_compile_fullgraph_matches_eager():
    values, old_values, returns, mask = _value_inputs(b=4, t=11, seed=18)
    lc, lr, lc_ref, lr_ref, len_c, len_r = _dpo_inputs(p=6, seed=19)

    def step(v, a, b):
        vl, vm = rlk.value_loss(
            v, old_values, returns, mask, agg="seq-mean-token-sum-norm", loss_scale=11, global_seqs=torch.tensor(4)
        )
        dl, dm = rlk.dpo_loss(a, b, lc_ref, lr_ref, loss="ipo", chosen_length=len_c, rejected_length=len_r)
        sl, _ = rlk.dpo_loss(a, b, lc_ref, lr_ref, label_smoothing=0.1, reduction="none")
        return vl + dl + sl.sum() + 0 * (vm["vf_clip_fraction"] + dm["reward_accuracy"])

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        inputs = [t.clone().requires_grad_(True) for t in (values, lc, lr)]
        loss = fn(*inputs)
        loss.backward()
        results.append((loss.detach(), *(t.grad for t in inputs)))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)
