"""Property-based fuzzing of the policy-side losses: ``policy_loss``, ``policy_loss_and_grad``, ``kl_penalty``,
``value_loss``, ``dpo_loss`` and ``fused_linear_policy_loss`` (profiles, backends and repro lines:
``fuzz_support.py``; what is fuzzed and how to run it: ``docs/fuzzing.md``).

Properties (each a test; every backend that implements the op, batch invariance on those declaring it):

* agreement with the fp64 ground truth (the same public op on fp64 copies of the inputs, pinned to the
  reference backend) under the numerical contract, forward and gradient, with the scales each op's
  contract entry describes; finite outputs and gradients where the exact result is finite in fp32;
  16-bit inputs give the bits of their fp32 upcast (the op layer upcasts them);
* the same at extreme log-ratios (90 to 100, unclamped where the loss stays bounded);
* ``policy_loss_and_grad`` returns ``policy_loss``'s loss, metrics and backward gradients bit for bit;
* masked positions never influence a result: NaN / +-inf there versus 0 give bitwise equal outputs;
* batch invariance: a row alone versus at a random position of a batch of other rows, padded to a
  longer ``T`` with masked positions: its per-token gradient (and ``kl_penalty``'s / ``dpo_loss``'s
  per-element outputs) are bitwise equal, where its aggregation weight does not depend on the batch;
* ``fused_linear_policy_loss`` with ``mode="lean"`` is bitwise ``policy_loss(linear_logprob(...))`` (masked
  positions scored as ignored targets), entropy ``>= 0``; on batch-invariant backends ``mode="one_pass"`` (fuzzed
  chunk sizes) gives the same loss, metrics and entropy bit for bit and finite gradients; masked positions never
  matter in either mode, their hidden states included (NaN there never reaches ``grad_weight``).

Exclusions, where the exact result is not representable in fp32 (so nothing can be asked of it):
an unclamped log-ratio ``d`` makes the ratio ``exp(d)``, which overflows above ``d = 88.7``. Log-ratios
of magnitude 80-100 are drawn only where the loss and gradient stay bounded (``cispo``, ``gpg``, ``sapo``,
or ``clamp_log_ratio`` at most 60), and then the ``ratio_mean`` / ``ratio_max`` metrics are not compared
when a masked token's ratio overflows; elsewhere log-ratios stay within +-50. ``kl_unbiased`` weighs the
KL by the unclamped ratio: log-ratios within +-50 there. The plain k3 estimator (``k3_clamp=False``)
computes ``exp(-delta)``: KL log-ratios within +-20 there (within +-100 otherwise). ``kl_penalty``'s contract
scale is ``1 + |ref|`` (no allowance for the rounding of a log-ratio that ``exp`` amplifies, unlike
``policy_loss``'s): its importance-weight log-ratios stay within +-5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from fuzz_support import (
    DEVICE,
    DTYPES,
    EXP_LIMIT,
    FILTERS,
    MASK_KINDS,
    RowInBatch,
    as32,
    as64,
    backends,
    cast,
    check_equal,
    check_finite,
    check_grad,
    check_value,
    dtype_names,
    fuzz_run,
    generator,
    grad_or_zeros,
    insert_row,
    interpreted,
    limit,
    make_mask,
    on_backend,
    on_reference,
    padded_row,
    poisoned,
    rows_in_batch,
    seeds,
    sizes,
    sprinkle,
    to_device,
    zeroed,
)
from hypothesis import strategies as st

import rlk
from parity import rl as parity_rl
from rlk.core import abi, contract
from rlk.ops.policy_loss import _clamp_bounds, _kl_spec
from rlk.reference import aggregation
from rlk.reference import losses as ref_losses
from rlk.reference import policy_loss as ref_pl

pytestmark = FILTERS

LOSSES = abi.LOSSES
AGG_MODES = abi.AGG_MODES
#: KL estimator names, with the aliases and the straight-through suffix the op accepts.
KL_NAMES = ("k1", "abs", "k2", "k3", "kl", "mse", "low_var_kl", "k3+", "k1+")
#: Losses whose value and gradient stay bounded whatever the ratio.
BOUNDED_LOSSES = ("cispo", "gpg", "sapo")
OPTIONAL = ("importance_weights", "ref_logprob", "entropy")


# =============================================================================================
# policy_loss and policy_loss_and_grad
# =============================================================================================


@dataclass(frozen=True)
class PolicyCase:
    """One ``policy_loss`` call: sizes, the keyword arguments (tensors aside) and how the inputs are drawn."""

    b: int
    t: int
    seed: int
    kwargs: tuple[tuple[str, object], ...]
    dtype: str = "float32"
    adv: str = "token"  # "token": [B, T]; "seq": [B]; "seq1": [B, 1]
    mask: str = "holes"  # one of MASK_KINDS
    float_mask: bool = False  # the mask as 0/1 floats
    on_policy: bool = False  # old_logprob=None
    tensors: tuple[str, ...] = ()  # which of OPTIONAL are given
    norm_tensors: bool = False  # the global normalizers as 0-d tensors
    spread: float = 0.3  # standard deviation of the log-ratios logprob - old_logprob
    extreme: float = 0.0  # ~15% of the log-ratios are +-extreme
    kl_extreme: float = 0.0  # ~15% of the KL log-ratios logprob - ref_logprob are +-kl_extreme


@st.composite
def policy_kwargs(draw, invariant: bool = False) -> dict:
    """``rlk.policy_loss`` keywords (no tensors). ``invariant``: an aggregation whose row weights do not depend on
    the other rows (token-sum, or the global normalizers)."""
    loss = draw(st.sampled_from(LOSSES))
    agg = draw(st.sampled_from(AGG_MODES))
    # dppo's trust region of width 0 decides every token on rounding noise (``b <= 0`` for p ~ q), which no
    # tolerance covers: its widths are drawn > 0
    widths = [0.2, 3e-4, 0.4] if loss.startswith("dppo") else [0.2, 0.0, 3e-4, 0.4]
    kw = {"loss": loss, "agg": agg, "clip_low": draw(st.sampled_from(widths))}
    if loss == "cispo" and draw(st.booleans()):
        kw |= {"cispo_form": "upper", "clip_high": draw(st.sampled_from([5.0, 1.0, 2.5]))}
    else:
        clip_high = draw(st.sampled_from([None, 0.28, 4e-4, 1.0]))
        if clip_high is not None:
            kw["clip_high"] = clip_high
    if loss == "ppo":
        dual = draw(st.sampled_from([None, 3.0, 1.5, 10.0]))
        if dual is not None:
            kw["dual_clip"] = dual
    if loss == "sapo":
        kw["sapo_tau"] = draw(st.sampled_from([(1.0, 1.05), (0.5, 2.0), (8.0, 0.1)]))
    clamp = draw(st.sampled_from([None, 20.0, (None, 10.0), (-5.0, None), 60.0]))
    if clamp is not None:
        kw["clamp_log_ratio"] = clamp
    if agg == "seq-mean-token-sum-norm":
        kw["loss_scale"] = draw(st.sampled_from([1.0, 17.0, 4096.0]))
    if agg == "token-mean":
        tokens = draw(st.sampled_from([37.0, 1.0, 4096.0] if invariant else [None, 37.0, 1.0, 4096.0]))
        if tokens is not None:
            kw["global_tokens"] = tokens
    if agg.startswith("seq-"):
        seqs = draw(st.sampled_from([5.0, 1.0, 64.0] if invariant else [None, 5.0, 1.0, 64.0]))
        if seqs is not None:
            kw["global_seqs"] = seqs
    return kw


@st.composite
def policy_cases(
    draw, backend: str, invariant: bool = False, one_row: bool = False, extreme: bool = False
) -> PolicyCase:
    """A ``policy_loss`` case (``one_row``: a single row of at least one position, the probe of an invariance
    check; ``extreme``: log-ratios of magnitude 90 or 100, unclamped for the bounded losses and clamped at most at 60
    for the others, 50 with ``kl_unbiased``)."""
    kw = draw(policy_kwargs(invariant))
    tensors = tuple(name for name in OPTIONAL if draw(st.booleans()))
    if "ref_logprob" in tensors:
        kw |= {
            "kl": draw(st.sampled_from(KL_NAMES)),
            "kl_coef": draw(st.sampled_from([0.1, 0.0, 1.0])),
            "kl_k3_clamp": draw(st.booleans()),
            "kl_unbiased": draw(st.booleans()),
        }
        kl_clamp = draw(st.sampled_from([None, 10.0, 0.5]))
        if kl_clamp is not None:
            kw["kl_clamp"] = kl_clamp
    if "entropy" in tensors:
        kw["entropy_coef"] = draw(st.sampled_from([0.01, 0.0, -0.5]))
    unbiased = kw.get("kl_unbiased", False)
    if extreme:  # the edge of the exclusions: no clamp for the bounded losses, a clamp of at most 60 for the others
        kw.pop("clamp_log_ratio", None)
        if kw["loss"] not in BOUNDED_LOSSES:
            kw["clamp_log_ratio"] = draw(st.sampled_from([20.0, 60.0, (None, 10.0)]))
    _, clamp_high = _clamp_bounds(kw.get("clamp_log_ratio"))
    extremes = [0.0, 20.0, 50.0]
    if not unbiased and kw["loss"] in BOUNDED_LOSSES:
        extremes += [80.0, 90.0, 100.0]
    elif not unbiased and clamp_high <= 60.0:
        extremes += [90.0, 100.0]
    if extreme:
        extremes = [e for e in extremes if e >= 90.0] or [50.0]
    kl_extremes = [0.0, 20.0]
    if "ref_logprob" in tensors and (_kl_spec("kl", kw["kl"])[0] != "k3" or kw["kl_k3_clamp"]):
        kl_extremes.append(100.0)
    b = 1 if one_row else draw(sizes(0, limit(backend, 2, 64)))
    return PolicyCase(
        b=b,
        t=draw(sizes(1 if one_row else 0, limit(backend, 129, 300))),
        seed=draw(seeds),
        kwargs=tuple(sorted(kw.items())),
        dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        adv=draw(st.sampled_from(["token", "seq", "seq1"])),
        mask=draw(st.sampled_from(MASK_KINDS)),
        float_mask=draw(st.booleans()),
        on_policy=draw(st.booleans()),
        tensors=tensors,
        norm_tensors=draw(st.booleans()),
        spread=draw(st.sampled_from([0.3, 1e-5, 2.0])),
        extreme=draw(st.sampled_from(extremes)),
        kl_extreme=draw(st.sampled_from(kl_extremes)),
    )


def policy_inputs(case: PolicyCase) -> dict[str, torch.Tensor]:
    """The tensors of a case, in its dtype, on the device (``old_logprob`` absent when on-policy)."""
    g = generator(case.seed)
    b, t = case.b, case.t
    lp = -torch.rand(b, t, generator=g) * 4 - 0.05
    log_ratio = sprinkle(case.spread * torch.randn(b, t, generator=g), case.extreme, g)
    adv = {
        "token": torch.randn(b, t, generator=g),
        "seq": torch.randn(b, generator=g),
        "seq1": torch.randn(b, 1, generator=g),
    }[case.adv]
    adv = torch.where(torch.rand(adv.shape, generator=g) < 0.1, 0.0, adv)  # some exact zeros (sign-aware losses)
    mask = make_mask(b, t, case.mask, g)
    x = {"logprob": lp, "advantages": adv, "mask": mask.float() if case.float_mask else mask}
    if not case.on_policy:
        x["old_logprob"] = lp - log_ratio
    if "importance_weights" in case.tensors:
        x["importance_weights"] = torch.rand(b, t, generator=g) + 0.5
    if "ref_logprob" in case.tensors:
        x["ref_logprob"] = lp - sprinkle(0.7 * torch.randn(b, t, generator=g), case.kl_extreme, g)
    if "entropy" in case.tensors:
        x["entropy"] = torch.rand(b, t, generator=g) * 2
    return cast(x, case.dtype)


#: Tokens this many fp32 units of a decision's magnitude from its boundary are decided by rounding.
BOUNDARY_ULPS = 64


def _log_ratio_boundaries(kw: dict) -> list[float]:
    """The log-ratios at which the loss's per-token value, gradient or clip flag jumps (module docstring of
    ``rlk.reference.policy_loss``): ppo's clip range and dual clip, cispo's cap or clip range, geo_mean's
    sign-aware clip, dppo's ratio cap, and the bounds of ``clamp_log_ratio``."""
    loss = kw["loss"]
    clip_low = kw.get("clip_low", 0.2)
    clip_high = kw.get("clip_high", clip_low)
    ratios = []
    if loss in ("ppo", "gspo") or (loss == "cispo" and kw.get("cispo_form") != "upper"):
        ratios += [1.0 - clip_low, 1.0 + clip_high]
    if loss == "cispo" and kw.get("cispo_form") == "upper":
        ratios.append(clip_high)
    if loss in ("ppo", "gspo", "dppo_tv", "dppo_kl") and kw.get("dual_clip"):
        ratios.append(kw["dual_clip"])
    logs = [math.log(r) for r in ratios if r > 0]
    if loss == "geo_mean":
        logs += [clip_high, -clip_low]
    clamp_low, clamp_high = _clamp_bounds(kw.get("clamp_log_ratio"))
    return logs + [b for b in (clamp_low, clamp_high) if math.isfinite(b)]


def mask_rounding_boundaries(x: dict[str, torch.Tensor], kw: dict) -> dict[str, torch.Tensor]:
    """``x`` with the tokens whose clip decision is rounding noise masked out (no tolerance covers a decision that
    fp32 and the fp64 truth may take either way; e.g. TRL's cispo cap of 1 counts ``exp(d) > 1``, which fp32
    rounds to 1 for ``|d| < 2^-24``): log-ratios ``d`` within ``BOUNDARY_ULPS`` fp32 units of ``1 + |d|`` from a
    boundary of :func:`_log_ratio_boundaries` (gspo: the rows whose sequence log-ratio is); and dppo's trust-region
    tests ``|p - q - eps|`` (tv) or ``|b - eps|`` (kl), and ``|p - q|`` (kl's ``p <= q``), within as many units of
    the magnitude of their terms. ``b``'s ``log((1 - q) / (1 - p))`` carries the relative error of ``1 - p`` near
    ``p = 1``, ``2^-24 p / (1 - p)``."""
    if "old_logprob" not in x:
        return x
    x64 = as64(x)
    lp, old, adv = x64["logprob"], x64["old_logprob"], x64["advantages"]
    adv = adv[:, None] if adv.dim() == 1 else adv
    unit = BOUNDARY_ULPS * 2.0**-24
    d = lp - old
    if kw["loss"] == "gspo":  # the sequence log-ratio decides every token of its row
        valid = x64["mask"] != 0
        d = (torch.where(valid, d, 0.0).sum(dim=1) / valid.sum(dim=1).clamp(min=1))[:, None].expand_as(lp)
    near = torch.zeros_like(d, dtype=torch.bool)
    for bound in _log_ratio_boundaries(kw):
        near |= (d - bound).abs() <= unit * (1.0 + d.abs())
    if kw["loss"].startswith("dppo"):
        p, q = torch.exp(lp), torch.exp(old)
        eps_low, eps_high = kw.get("clip_low", 0.2), kw.get("clip_high", kw.get("clip_low", 0.2))
        eps = torch.where(adv > 0, eps_high, eps_low)
        near |= (p - q).abs() <= unit * (p + q)
        if kw["loss"] == "dppo_tv":
            near |= ((p - q).abs() - eps).abs() <= unit * (1.0 + p + q)
        else:
            guard = ref_pl.DPPO_KL_GUARD
            b, log_term = ref_pl.dppo_binary_kl(lp, old)
            terms = (q * (old - lp)).abs() + (1.0 - q) * (
                log_term.abs() + p / (1.0 - p + guard) + q / (1.0 - q + guard)
            )
            near |= (b - eps).abs() <= unit * (1.0 + terms)
    mask = x["mask"]
    keep = (~near).to(mask.device)
    return {**x, "mask": mask * keep.to(mask.dtype) if mask.dtype.is_floating_point else mask & keep}


def policy_call_kwargs(case: PolicyCase) -> dict:
    kw = dict(case.kwargs)
    if case.norm_tensors:
        for name in ("global_tokens", "global_seqs", "loss_scale"):
            if name in kw:
                kw[name] = torch.tensor(kw[name], device=DEVICE)
    return kw


@dataclass
class PolicyOut:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    grad_logprob: torch.Tensor
    grad_entropy: torch.Tensor | None


def policy_call(x: dict[str, torch.Tensor], kw: dict, fused: bool) -> PolicyOut:
    """``rlk.policy_loss`` and its backward (``fused``: ``rlk.policy_loss_and_grad``) on the pinned backend."""
    entropy = x.get("entropy")
    entropy_grad = entropy is not None and kw.get("entropy_coef", 0.0) != 0.0
    optional = {name: x[name] for name in ("importance_weights", "ref_logprob") if name in x}
    if fused:
        out = rlk.policy_loss_and_grad(
            x["logprob"], x.get("old_logprob"), x["advantages"], x["mask"], entropy=entropy, **optional, **kw
        )
        return PolicyOut(out.loss, out.metrics, out.grad_logprob, out.grad_entropy)
    lp = x["logprob"].detach().clone().requires_grad_()
    ent = entropy.detach().clone().requires_grad_() if entropy_grad else entropy
    loss, metrics = rlk.policy_loss(lp, x.get("old_logprob"), x["advantages"], x["mask"], entropy=ent, **optional, **kw)
    loss.backward()
    return PolicyOut(loss.detach(), metrics, grad_or_zeros(lp), grad_or_zeros(ent) if entropy_grad else None)


def policy_attrs(kw: dict) -> dict:
    """The primitive's attributes for the keywords ``kw`` (for ``rlk.reference.policy_loss.contract_scale``)."""
    kl, straight = _kl_spec("kl", kw.get("kl", "k3"))
    clamp_low, clamp_high = _clamp_bounds(kw.get("clamp_log_ratio"))
    clip_low = kw.get("clip_low", 0.2)
    clip_high = kw.get("clip_high", clip_low)
    tau_pos, tau_neg = kw.get("sapo_tau", (1.0, 1.05))
    kl_clamp = kw.get("kl_clamp")
    return {
        "loss": kw["loss"],
        "cispo_upper": kw.get("cispo_form") == "upper",
        "clip_low": clip_low,
        "clip_high": clip_high,
        "dual_clip": kw.get("dual_clip") or 0.0,
        "clamp_low": clamp_low,
        "clamp_high": clamp_high,
        "tau_pos": tau_pos,
        "tau_neg": tau_neg,
        "kl": kl,
        "kl_coef": kw.get("kl_coef", 0.0),
        "kl_k3_clamp": kw.get("kl_k3_clamp", True),
        "kl_clamp": math.inf if kl_clamp is None else kl_clamp,
        "kl_straight_through": straight,
        "kl_unbiased": kw.get("kl_unbiased", False),
        "entropy_coef": kw.get("entropy_coef", 0.0),
    }


def ratio_overflows(x64: dict[str, torch.Tensor], kw: dict) -> bool:
    """Whether a masked token's (clamped) ratio ``exp(d)`` exceeds fp32's range (its ratio metrics do too)."""
    if "old_logprob" not in x64:
        return False
    clamp_low, clamp_high = _clamp_bounds(kw.get("clamp_log_ratio"))
    d = (x64["logprob"] - x64["old_logprob"]).clamp(clamp_low, clamp_high)
    return bool((torch.where(x64["mask"] != 0, d, 0.0) > EXP_LIMIT).any())


def check_policy_against_truth(x: dict[str, torch.Tensor], kw: dict, got: PolicyOut) -> None:
    """fp32 results ``got`` of inputs ``x`` against the fp64 ground truth, under the contract."""
    x64 = as64(x)
    with on_reference():
        truth = policy_call(x64, kw, fused=False)
    entry = contract.entry("policy_loss", torch.float32)
    if x["logprob"].numel() == 0:  # documented: loss 0, zero metrics, empty gradients
        check_equal("loss", got.loss, torch.zeros_like(got.loss))
        for name, value in got.metrics.items():
            check_equal(name, value, torch.zeros_like(value))
        assert got.grad_logprob.shape == x["logprob"].shape
        return
    mask = x64["mask"] != 0
    agg_kw = {name: kw.get(name) for name in ("global_tokens", "global_seqs", "loss_scale")}
    row_weight = aggregation.row_weights(mask, kw["agg"], dtype=torch.float64, **agg_kw)
    adv = x64["advantages"]
    adv = adv[:, None] if adv.dim() == 1 else adv
    s = ref_pl.contract_scale(
        x64["logprob"],
        x64.get("old_logprob", x64["logprob"]),
        adv,
        mask,
        row_weight,
        x64.get("importance_weights"),
        x64.get("ref_logprob"),
        x64.get("entropy"),
        **policy_attrs(kw),
    )
    check_finite("loss", got.loss)
    check_value(entry, "loss", got.loss, truth.loss, 1.0 + truth.loss.abs() + s["loss"])
    assert set(got.metrics) == set(truth.metrics)
    skip = ("ratio_mean", "ratio_max") if ratio_overflows(x64, kw) else ()
    for name, value in truth.metrics.items():
        if name in skip:
            continue
        check_finite(name, got.metrics[name])
        scale = 1.0 + value.abs() + s["metrics"][abi.POLICY_METRICS.index(name)]
        check_value(entry, name, got.metrics[name], value, scale)
    check_finite("grad_logprob", got.grad_logprob)
    # vespo's gradient carries phi's relative error (``grad_max_scale``); 1 for the other losses
    check_grad(
        entry, "grad_logprob", got.grad_logprob, truth.grad_logprob, float(s["grad_max_scale"]), s["grad_magnitude"]
    )
    if truth.grad_entropy is not None:
        check_finite("grad_entropy", got.grad_entropy)
        check_grad(entry, "grad_entropy", got.grad_entropy, truth.grad_entropy, 1.0)


def check_policy_same(what: str, a: PolicyOut, b: PolicyOut) -> None:
    check_equal(f"{what}: loss", a.loss, b.loss)
    assert set(a.metrics) == set(b.metrics), f"{what}: metrics {sorted(a.metrics)} vs {sorted(b.metrics)}"
    for name in a.metrics:
        check_equal(f"{what}: {name}", a.metrics[name], b.metrics[name])
    check_equal(f"{what}: grad_logprob", a.grad_logprob, b.grad_logprob)
    check_equal(f"{what}: grad_entropy", a.grad_entropy, b.grad_entropy)


def check_policy_loss_matches_reference(backend: str, case: PolicyCase) -> None:
    """policy_loss_and_grad on the case's inputs gives the bits of policy_loss and its backward on their fp32
    upcast (the two entry points agree, and 16-bit inputs are upcast exactly; the gradient is rounded once to
    the input dtype), and those fp32 results agree with the fp64 ground truth under the contract (finite
    wherever the truth is)."""
    kw = policy_call_kwargs(case)
    x = mask_rounding_boundaries(policy_inputs(case), kw)
    with on_backend(backend):
        fused = policy_call(x, kw, fused=True)
        exact = policy_call(as32(x), kw, fused=False)
    low = DTYPES[case.dtype]
    lowered = PolicyOut(
        exact.loss,
        exact.metrics,
        exact.grad_logprob.to(low),
        None if exact.grad_entropy is None else exact.grad_entropy.to(low),
    )
    check_policy_same("policy_loss_and_grad vs policy_loss + backward on the fp32 upcast", fused, lowered)
    check_policy_against_truth(as32(x), kw, exact)


def check_policy_loss_masked_positions(backend: str, case: PolicyCase) -> None:
    """NaN / +-inf at the masked positions of every [B, T] input versus 0 there: bitwise equal loss, metrics
    and gradients."""
    x, kw = policy_inputs(case), policy_call_kwargs(case)
    masked = x["mask"] == 0
    g = generator(case.seed + 1)
    bad = {name: (poisoned(v, masked, g) if name != "mask" and v.shape == masked.shape else v) for name, v in x.items()}
    clean = {name: (zeroed(v, masked) if name != "mask" and v.shape == masked.shape else v) for name, v in x.items()}
    with on_backend(backend):
        check_policy_same(
            "NaN/inf vs 0 at masked positions", policy_call(bad, kw, fused=True), policy_call(clean, kw, fused=True)
        )


def check_policy_loss_batch_invariance(backend: str, case: RowInBatch) -> None:
    """A row's gradient alone versus inside a batch (random other rows, random position, padded with masked
    positions): bitwise equal, for aggregations whose row weight does not depend on the batch."""
    probe = case.probe
    t, kw = probe.t, policy_call_kwargs(probe)
    x = policy_inputs(probe)
    others = policy_inputs(replace(probe, b=case.others, t=t + case.pad, seed=case.seed))
    per_token = ("logprob", "old_logprob", "mask", *OPTIONAL) + (("advantages",) if probe.adv == "token" else ())
    batch = insert_row(padded_row(x, case.pad, per_token), others, case.position)
    with on_backend(backend):
        alone = policy_call(x, kw, fused=True)
        inside = policy_call(batch, kw, fused=True)
    check_equal(
        "grad_logprob of the row", inside.grad_logprob[case.position : case.position + 1, :t], alone.grad_logprob
    )
    if alone.grad_entropy is not None:
        check_equal(
            "grad_entropy of the row", inside.grad_entropy[case.position : case.position + 1, :t], alone.grad_entropy
        )


@pytest.fixture
def interpreted_chunks(monkeypatch, backend):
    """In the Triton interpreter the policy-loss token programs take chunks of 32 tokens, not 1024: rows of the CI
    profile's lengths (<= 129, + 17 of padding) then span several chunks (the in-row sums over chunk partials, a
    ragged last chunk), where one 1024 chunk reached neither, and the interpreter's reduce (one Python step per
    lane) costs ~6x less."""
    if interpreted(backend):
        from rlk_triton import policy_loss as tk

        monkeypatch.setattr(tk, "BLOCK_T", 32)


@pytest.mark.parametrize("backend", backends("policy_loss"))
def test_policy_loss_matches_reference(interpreted_chunks, backend):
    fuzz_run(check_policy_loss_matches_reference, backend, policy_cases(backend), ci=3)


@pytest.mark.parametrize("backend", backends("policy_loss"))
def test_policy_loss_matches_reference_at_extreme_log_ratios(interpreted_chunks, backend):
    fuzz_run(check_policy_loss_matches_reference, backend, policy_cases(backend, extreme=True), ci=2)


#: Found by the long profile on the H200: TRL's cispo cap ``clip_high = 1.0`` counts ``exp(d) > 1``, which fp32
#: rounds to 1 for ``|d| < 2^-24``, so ``clip_fraction`` was one token apart from the fp64 truth.
CISPO_CAP_AT_ONE = PolicyCase(
    b=3,
    t=63,
    seed=3,
    kwargs=(("agg", "token-mean"), ("cispo_form", "upper"), ("clip_high", 1.0), ("clip_low", 0.2), ("loss", "cispo")),
    dtype="float32",
    adv="token",
    mask="scattered",
    float_mask=False,
    on_policy=False,
    tensors=(),
    norm_tensors=False,
    spread=1e-05,
    extreme=90.0,
    kl_extreme=0.0,
)


@pytest.mark.parametrize("backend", backends("policy_loss"))
def test_policy_loss_clip_decisions_on_rounding_are_not_compared(interpreted_chunks, backend, monkeypatch):
    """The long profile's cispo finding passes with ``mask_rounding_boundaries``, and fails without it (the
    rounding-decided token is what differs, not the kernel)."""
    check_policy_loss_matches_reference(backend, CISPO_CAP_AT_ONE)
    monkeypatch.setitem(globals(), "mask_rounding_boundaries", lambda x, kw: x)
    with pytest.raises(AssertionError, match="clip_fraction"):
        check_policy_loss_matches_reference(backend, CISPO_CAP_AT_ONE)


@pytest.mark.parametrize("backend", backends("policy_loss"))
def test_policy_loss_masked_positions_never_matter(interpreted_chunks, backend):
    fuzz_run(check_policy_loss_masked_positions, backend, policy_cases(backend), ci=3)


@pytest.mark.parametrize("backend", backends("policy_loss", invariant_only=True))
def test_policy_loss_batch_invariance(interpreted_chunks, backend):
    probe = policy_cases(backend, invariant=True, one_row=True)
    fuzz_run(
        check_policy_loss_batch_invariance,
        backend,
        rows_in_batch(probe, limit(backend, 2, 64), limit(backend, 17, 300)),
        ci=3,
    )


#: The long profile's example on an H200: one geo_mean row (T = 16, token advantages, 8 of its 16 gradients
#: nonzero) alone and padded to 17 in a batch of two were 2 ulps apart.
PADDED_ROW = RowInBatch(
    probe=PolicyCase(
        b=1,
        t=16,
        seed=1,
        kwargs=(("agg", "token-mean"), ("clip_low", 0.2), ("global_tokens", 37.0), ("loss", "geo_mean")),
        dtype="float32",
        adv="token",
        mask="holes",
        float_mask=False,
        on_policy=False,
        tensors=(),
        norm_tensors=False,
        spread=0.3,
        extreme=0.0,
        kl_extreme=0.0,
    ),
    others=1,
    position=0,
    pad=1,
    seed=0,
)


@pytest.mark.gpu
@pytest.mark.parametrize("loss", ["geo_mean", "gspo", "vespo", "ppo"])
@pytest.mark.parametrize("pad", [1, 16])
def test_policy_loss_row_padded_to_another_length_gpu(loss, pad):
    """A row's gradients alone (T = 16) and padded to T + pad in a batch: the same bits on the Triton backend, whose
    kernels do not specialize on ``T`` (its divisibility picks the loads' vector width, which sets ``tl.sum``'s
    order)."""
    kwargs = tuple((k, loss if k == "loss" else v) for k, v in PADDED_ROW.probe.kwargs)
    check_policy_loss_batch_invariance(
        "triton", replace(PADDED_ROW, probe=replace(PADDED_ROW.probe, kwargs=kwargs), pad=pad)
    )


@pytest.mark.gpu
def test_policy_loss_kernels_specialized_on_t_break_the_padded_row_gpu(monkeypatch):
    """Control for the test above: the same two kernels jitted with Triton's default specialization give the
    H200's 2-ulp difference on the recorded geo_mean row."""
    import triton

    from rlk_triton import policy_loss as tk_policy

    for name in ("_seq_partials_kernel", "_policy_loss_chunk_kernel"):
        monkeypatch.setattr(tk_policy, name, triton.jit(getattr(tk_policy, name).fn))
    with pytest.raises(AssertionError, match="not bitwise equal"):
        check_policy_loss_batch_invariance("triton", PADDED_ROW)


# =============================================================================================
# kl_penalty
# =============================================================================================


@dataclass(frozen=True)
class KlCase:
    """One ``kl_penalty`` call: the input shape, the estimator's options and how the inputs are drawn."""

    shape: tuple[int, ...]
    seed: int
    estimator: str
    straight_through: bool = False
    clamp: float | None = None
    k3_clamp: bool = True
    unbiased: bool = False  # old_logprob given
    dtype: str = "float32"
    extreme: float = 0.0  # ~15% of the KL log-ratios logprob - ref_logprob are +-extreme
    ratio_extreme: float = 0.0  # ~15% of the log-ratios logprob - old_logprob are +-ratio_extreme


@st.composite
def kl_cases(draw, backend: str, one_row: bool = False) -> KlCase:
    estimator = draw(st.sampled_from(KL_NAMES + ("abs+",)))
    k3_clamp = draw(st.booleans())
    plain_k3 = _kl_spec("estimator", estimator)[0] == "k3" and not k3_clamp
    n = limit(backend, 65, 4097)
    shape = (
        (draw(sizes(1, n)),)
        if one_row
        else draw(st.sampled_from([(), (0,), (1,)]) | st.tuples(sizes(0, n)) | st.tuples(sizes(0, 5), sizes(0, 33)))
    )
    return KlCase(
        shape=shape,
        seed=draw(seeds),
        estimator=estimator,
        straight_through=draw(st.booleans()),
        clamp=draw(st.sampled_from([None, 10.0, 0.5])),
        k3_clamp=k3_clamp,
        unbiased=draw(st.booleans()),
        dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        extreme=draw(st.sampled_from([0.0, 20.0] if plain_k3 else [0.0, 20.0, 100.0])),
        ratio_extreme=draw(st.sampled_from([0.0, 5.0, 20.0])),
    )


def kl_inputs(case: KlCase) -> dict[str, torch.Tensor]:
    g = generator(case.seed)
    lp = -torch.rand(case.shape, generator=g) * 4
    x = {
        "logprob": lp,
        "ref_logprob": lp - sprinkle(0.7 * torch.randn(case.shape, generator=g), case.extreme, g),
        "c": torch.randn(case.shape, generator=g),
    }
    if case.unbiased:
        x["old_logprob"] = lp - sprinkle(0.3 * torch.randn(case.shape, generator=g), case.ratio_extreme, g)
    return cast(x, case.dtype)


def kl_call(x: dict[str, torch.Tensor], case: KlCase) -> tuple[torch.Tensor, torch.Tensor]:
    """``kl_penalty`` and the gradient of ``sum(c * kl)`` on the pinned backend."""
    lp = x["logprob"].detach().clone().requires_grad_()
    kl = rlk.kl_penalty(
        lp,
        x["ref_logprob"],
        case.estimator,
        straight_through=case.straight_through,
        clamp=case.clamp,
        k3_clamp=case.k3_clamp,
        old_logprob=x.get("old_logprob"),
    )
    (x["c"].to(kl.dtype) * kl).sum().backward()
    return kl.detach(), grad_or_zeros(lp)


def check_kl_penalty_matches_reference(backend: str, case: KlCase) -> None:
    """The estimate and its gradient against the fp64 ground truth under the contract (per element
    ``1 + |ref|``; the gradient with ``max_scale = 1``), finite; 16-bit inputs give their fp32 upcast's bits."""
    x = kl_inputs(case)
    with on_backend(backend):
        kl, grad = kl_call(x, case)
        exact = (kl, grad) if case.dtype == "float32" else kl_call(as32(x), case)
    if case.dtype != "float32":
        check_equal(f"kl of {case.dtype} inputs vs their fp32 upcast", kl, exact[0])
        check_equal(f"gradient of {case.dtype} inputs vs their fp32 upcast", grad, exact[1].to(grad.dtype))
    with on_reference():
        truth_kl, truth_grad = kl_call(as64(x), case)
    entry = contract.entry("kl_penalty", torch.float32)
    x64 = as64(x)
    value_scale, grad_magnitude = ref_pl.kl_contract_scale(
        x64["logprob"],
        x64["ref_logprob"],
        x64.get("old_logprob"),
        estimator=_kl_spec("estimator", case.estimator)[0],
        k3_clamp=case.k3_clamp,
    )
    check_finite("kl", exact[0])
    check_value(entry, "kl", exact[0], truth_kl, value_scale)
    check_finite("grad_logprob", exact[1])
    check_grad(entry, "grad_logprob", exact[1], truth_grad, 1.0, x["c"].double().abs() * grad_magnitude)


def check_kl_penalty_batch_invariance(backend: str, case: RowInBatch) -> None:
    """Elementwise: a 1-D run of elements alone versus inside a longer one (other elements before and after):
    bitwise equal estimates and gradients."""
    probe = case.probe
    n = probe.shape[0]
    x = kl_inputs(probe)
    before = kl_inputs(replace(probe, shape=(case.position,), seed=case.seed))
    after = kl_inputs(replace(probe, shape=(case.others + case.pad,), seed=case.seed + 1))
    batch = {name: torch.cat([before[name], x[name], after[name]]) for name in x}
    with on_backend(backend):
        alone = kl_call(x, probe)
        inside = kl_call(batch, probe)
    check_equal("kl of the run", inside[0][case.position : case.position + n], alone[0])
    check_equal("gradient of the run", inside[1][case.position : case.position + n], alone[1])


@pytest.mark.parametrize("backend", backends("kl_penalty"))
def test_kl_penalty_matches_reference(backend):
    fuzz_run(check_kl_penalty_matches_reference, backend, kl_cases(backend), ci=6)


@pytest.mark.parametrize("backend", backends("kl_penalty", invariant_only=True))
def test_kl_penalty_batch_invariance(backend):
    fuzz_run(
        check_kl_penalty_batch_invariance,
        backend,
        rows_in_batch(kl_cases(backend, one_row=True), limit(backend, 65, 4097), limit(backend, 65, 4097)),
        ci=4,
    )


# =============================================================================================
# value_loss
# =============================================================================================


@dataclass(frozen=True)
class ValueCase:
    """One ``value_loss`` call."""

    b: int
    t: int
    seed: int
    kwargs: tuple[tuple[str, object], ...]  # clip, agg and the normalizers
    dtype: str = "float32"
    mask: str = "holes"
    float_mask: bool = False
    no_old: bool = False  # old_values=None (with clip=None)
    scale: float = 1.0  # magnitude of values and returns


@st.composite
def value_cases(draw, backend: str, invariant: bool = False, one_row: bool = False) -> ValueCase:
    kw = draw(policy_kwargs(invariant))
    kw = {name: kw[name] for name in ("agg", "global_tokens", "global_seqs", "loss_scale") if name in kw}
    kw["clip"] = draw(st.sampled_from([0.5, None, 0.0, 0.2, 10.0]))
    return ValueCase(
        b=1 if one_row else draw(sizes(0, limit(backend, 5, 64))),
        t=draw(sizes(1 if one_row else 0, limit(backend, 129, 300))),
        seed=draw(seeds),
        kwargs=tuple(sorted(kw.items())),
        dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        mask=draw(st.sampled_from(MASK_KINDS)),
        float_mask=draw(st.booleans()),
        no_old=kw["clip"] is None and draw(st.booleans()),
        scale=draw(st.sampled_from([1.0, 1e-3, 300.0])),
    )


def value_inputs(case: ValueCase) -> dict[str, torch.Tensor]:
    g = generator(case.seed)
    b, t = case.b, case.t
    values = torch.randn(b, t, generator=g) * 2 * case.scale
    x = {
        "values": values,
        "returns": torch.randn(b, t, generator=g) * 2 * case.scale,
        "mask": make_mask(b, t, case.mask, g),
    }
    if case.float_mask:
        x["mask"] = x["mask"].float()
    if not case.no_old:
        x["old_values"] = values + 0.7 * case.scale * torch.randn(b, t, generator=g)
    return cast(x, case.dtype)


def value_call(x: dict[str, torch.Tensor], kw: dict) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """``value_loss`` and its backward on the pinned backend: (loss, metrics, grad_values)."""
    v = x["values"].detach().clone().requires_grad_()
    loss, metrics = rlk.value_loss(v, x.get("old_values"), x["returns"], x["mask"], **kw)
    loss.backward()
    return loss.detach(), metrics, grad_or_zeros(v)


def check_value_loss_matches_reference(backend: str, case: ValueCase) -> None:
    """Loss, metrics and gradient against the fp64 ground truth under the contract (loss ``1 + |loss|``,
    ``vf_clip_fraction`` 1, ``values_mean`` ``1 + mean |values|``, the gradient with ``max_scale = 1``), finite;
    16-bit inputs give their fp32 upcast's bits."""
    x, kw = value_inputs(case), dict(case.kwargs)
    with on_backend(backend):
        got = value_call(x, kw)
        exact = got if case.dtype == "float32" else value_call(as32(x), kw)
    if case.dtype != "float32":
        check_equal("loss of 16-bit inputs vs their fp32 upcast", got[0], exact[0])
        for name in got[1]:
            check_equal(f"{name} of 16-bit inputs vs their fp32 upcast", got[1][name], exact[1][name])
        check_equal("gradient of 16-bit inputs vs their fp32 upcast", got[2], exact[2].to(got[2].dtype))
    x64 = as64(x)
    with on_reference():
        loss, metrics, grad = value_call(x64, kw)
    entry = contract.entry("value_loss", torch.float32)
    m = x64["mask"] != 0
    v_abs = torch.where(m, x64["values"].abs(), 0.0).sum() / m.sum().clamp(min=1)
    scales = {"vf_clip_fraction": 1.0, "values_mean": 1.0 + v_abs}
    check_finite("loss", exact[0])
    check_value(entry, "loss", exact[0], loss, 1.0 + loss.abs())
    for name, value in metrics.items():
        check_finite(name, exact[1][name])
        check_value(entry, name, exact[1][name], value, scales[name])
    check_finite("grad_values", exact[2])
    check_grad(entry, "grad_values", exact[2], grad, 1.0)


def check_value_loss_masked_positions(backend: str, case: ValueCase) -> None:
    """NaN / +-inf at the masked positions of values, old_values and returns versus 0 there: bitwise equal
    loss, metrics and gradient."""
    x, kw = value_inputs(case), dict(case.kwargs)
    masked = x["mask"] == 0
    g = generator(case.seed + 1)
    bad = {name: (v if name == "mask" else poisoned(v, masked, g)) for name, v in x.items()}
    clean = {name: (v if name == "mask" else zeroed(v, masked)) for name, v in x.items()}
    with on_backend(backend):
        a, b = value_call(bad, kw), value_call(clean, kw)
    check_equal("loss", a[0], b[0])
    for name in a[1]:
        check_equal(name, a[1][name], b[1][name])
    check_equal("grad_values", a[2], b[2])


def check_value_loss_batch_invariance(backend: str, case: RowInBatch) -> None:
    """A row's gradient alone versus inside a batch (random other rows and position, padded with masked
    positions): bitwise equal, for aggregations whose row weight does not depend on the batch."""
    probe, kw = case.probe, dict(case.probe.kwargs)
    x = value_inputs(probe)
    others = value_inputs(replace(probe, b=case.others, t=probe.t + case.pad, seed=case.seed))
    batch = insert_row(padded_row(x, case.pad, ("values", "old_values", "returns", "mask")), others, case.position)
    with on_backend(backend):
        alone = value_call(x, kw)
        inside = value_call(batch, kw)
    check_equal("grad_values of the row", inside[2][case.position : case.position + 1, : probe.t], alone[2])


@pytest.mark.parametrize("backend", backends("value_loss"))
def test_value_loss_matches_reference(backend):
    fuzz_run(check_value_loss_matches_reference, backend, value_cases(backend), ci=5)


@pytest.mark.parametrize("backend", backends("value_loss"))
def test_value_loss_masked_positions_never_matter(backend):
    fuzz_run(check_value_loss_masked_positions, backend, value_cases(backend), ci=4)


@pytest.mark.parametrize("backend", backends("value_loss", invariant_only=True))
def test_value_loss_batch_invariance(backend):
    probe = value_cases(backend, invariant=True, one_row=True)
    fuzz_run(
        check_value_loss_batch_invariance,
        backend,
        rows_in_batch(probe, limit(backend, 5, 64), limit(backend, 33, 300)),
        ci=4,
    )


# =============================================================================================
# dpo_loss
# =============================================================================================


@dataclass(frozen=True)
class DpoCase:
    """One ``dpo_loss`` call over ``p`` pairs."""

    p: int
    seed: int
    loss: str
    beta: float
    label_smoothing: float = 0.0
    reduction: str = "mean"
    dtype: str = "float32"
    scale: float = 1.0  # per-token log-prob magnitude (sequence log-probs: lengths up to 500 times this)
    zero_lengths: bool = False  # some completion lengths are 0 (ipo counts them as 1)


@st.composite
def dpo_cases(draw, backend: str, one_row: bool = False) -> DpoCase:
    loss = draw(st.sampled_from(("sigmoid", "hinge", "ipo", "robust")))
    smoothing = {"sigmoid": [0.0, 0.1, 0.5], "robust": [0.0, 0.1, 0.4]}.get(loss, [0.0])
    return DpoCase(
        p=draw(sizes(1, 17)) if one_row else draw(sizes(0, limit(backend, 65, 4097))),
        seed=draw(seeds),
        loss=loss,
        beta=draw(st.sampled_from([0.1, 0.5, 1e-3, 10.0])),
        label_smoothing=draw(st.sampled_from(smoothing)),
        reduction="none" if one_row else draw(st.sampled_from(["mean", "sum", "none"])),
        dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        scale=draw(st.sampled_from([1.0, 0.01, 20.0])),
        zero_lengths=draw(st.booleans()),
    )


def dpo_inputs(case: DpoCase) -> dict[str, torch.Tensor]:
    """Sequence log-probs ``-length * U(0.2, 1.2) * scale``, reference ones within +-10 scale of them."""
    g = generator(case.seed)
    p = case.p
    low = 0 if case.zero_lengths else 1
    len_c = torch.randint(low, 500, (p,), generator=g).float()
    len_r = torch.randint(low, 500, (p,), generator=g).float()
    lc = -len_c * (0.2 + torch.rand(p, generator=g)) * case.scale
    lr = -len_r * (0.2 + torch.rand(p, generator=g)) * case.scale
    x = {
        "chosen": lc,
        "rejected": lr,
        "ref_chosen": lc + 10 * case.scale * torch.randn(p, generator=g),
        "ref_rejected": lr + 10 * case.scale * torch.randn(p, generator=g),
        "len_chosen": len_c,
        "len_rejected": len_r,
        "c": torch.randn(p, generator=g),
    }
    out = cast(x, case.dtype)
    out["len_chosen"], out["len_rejected"] = len_c.to(DEVICE), len_r.to(DEVICE)
    return out


def dpo_call(x: dict[str, torch.Tensor], case: DpoCase) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]:
    """``dpo_loss`` and its backward (of ``sum(c * losses)`` for reduction ``none``): (loss, metrics, grads)."""
    lc, lr = x["chosen"].detach().clone().requires_grad_(), x["rejected"].detach().clone().requires_grad_()
    lengths = {"chosen_length": x["len_chosen"], "rejected_length": x["len_rejected"]} if case.loss == "ipo" else {}
    loss, metrics = rlk.dpo_loss(
        lc,
        lr,
        x["ref_chosen"],
        x["ref_rejected"],
        beta=case.beta,
        loss=case.loss,
        label_smoothing=case.label_smoothing,
        reduction=case.reduction,
        **lengths,
    )
    (loss if case.reduction != "none" else (x["c"].to(loss.dtype) * loss).sum()).backward()
    return loss.detach(), metrics, grad_or_zeros(lc), grad_or_zeros(lr)


def check_dpo_loss_matches_reference(backend: str, case: DpoCase) -> None:
    """Loss (per pair or reduced), metrics and gradients against the fp64 ground truth under the contract
    (the scales of ``parity.rl``: per pair ``1 + |loss| + |dl/dx| s``), finite; 16-bit inputs give their fp32
    upcast's bits."""
    x = dpo_inputs(case)
    with on_backend(backend):
        got = dpo_call(x, case)
        exact = got if case.dtype == "float32" else dpo_call(as32(x), case)
    if case.dtype != "float32":
        check_equal("loss of 16-bit inputs vs their fp32 upcast", got[0], exact[0])
        for name in got[1]:
            check_equal(f"{name} of 16-bit inputs vs their fp32 upcast", got[1][name], exact[1][name])
        for k, name in ((2, "grad_chosen"), (3, "grad_rejected")):
            check_equal(f"{name} of 16-bit inputs vs their fp32 upcast", got[k], exact[k].to(got[k].dtype))
    x64 = as64(x)
    with on_reference():
        truth = dpo_call(x64, case)
        losses, _ = rlk.dpo_loss(
            *(x64[k] for k in ("chosen", "rejected", "ref_chosen", "ref_rejected")),
            beta=case.beta,
            loss=case.loss,
            label_smoothing=case.label_smoothing,
            reduction="none",
            chosen_length=x64["len_chosen"],
            rejected_length=x64["len_rejected"],
        )
    if case.p == 0:  # documented: no pairs give a loss of 0 and metrics of 0
        check_equal("loss", exact[0], torch.zeros_like(exact[0]))
        for name, value in exact[1].items():
            check_equal(name, value, torch.zeros_like(value))
        return
    params = {"beta": case.beta, "loss": case.loss, "label_smoothing": case.label_smoothing}
    scales, max_scale = parity_rl._dpo_scales(params, x64, parity_rl.RLOutputs({"losses": losses}, {}))
    scales["loss"] = {"mean": scales["loss"], "sum": scales["losses"].sum(), "none": scales["losses"]}[case.reduction]
    entry = contract.entry("dpo_loss", torch.float32)
    check_finite("loss", exact[0])
    check_value(entry, "loss", exact[0], truth[0], scales["loss"])
    for name, value in truth[1].items():
        check_finite(name, exact[1][name])
        check_value(entry, name, exact[1][name], value, scales[name])
    magnitude = dpo_grad_magnitude(x64, case)
    for k, name in ((2, "grad_chosen"), (3, "grad_rejected")):
        check_finite(name, exact[k])
        check_grad(entry, name, exact[k], truth[k], max_scale, magnitude)


def dpo_grad_magnitude(x: dict[str, torch.Tensor], case: DpoCase) -> torch.Tensor:
    """Per pair, the terms of ``d loss / d chosen`` by absolute value (fp64): the smoothed sigmoid loss's
    ``beta (-(1 - eps) sigmoid(-u) + eps sigmoid(u))`` cancels near ``u = 0`` at ``eps = 0.5``; ``dl/dx`` otherwise;
    times the upstream weight (``c``, or ``1 / P`` for the mean) and ``|dx / d chosen|``."""
    loss, dl_dx, dx_dc, *_ = ref_losses._dpo_terms(
        x["chosen"],
        x["rejected"],
        x["ref_chosen"],
        x["ref_rejected"],
        x["len_chosen"],
        x["len_rejected"],
        case.beta,
        case.loss,
        case.label_smoothing,
    )
    terms = dl_dx.abs()
    if case.loss == "sigmoid":
        lc, lr, lc_ref, lr_ref = (x[k] for k in ("chosen", "rejected", "ref_chosen", "ref_rejected"))
        u = case.beta * ((lc - lr) - (lc_ref - lr_ref))
        eps = case.label_smoothing
        terms = case.beta * ((1 - eps) * torch.sigmoid(-u) + eps * torch.sigmoid(u))
    upstream = {"none": x["c"].double().abs(), "sum": 1.0, "mean": 1.0 / max(terms.numel(), 1)}[case.reduction]
    return terms * upstream * torch.as_tensor(dx_dc, dtype=torch.float64).abs()


def check_dpo_loss_batch_invariance(backend: str, case: RowInBatch) -> None:
    """Per-pair losses and gradients (reduction ``none``) of some pairs alone versus inside a batch of other
    pairs at a random position: bitwise equal."""
    probe = case.probe
    x = dpo_inputs(probe)
    others = dpo_inputs(replace(probe, p=case.others + case.pad, seed=case.seed))
    batch = insert_row(x, others, case.position)
    rows = slice(case.position, case.position + probe.p)
    with on_backend(backend):
        alone = dpo_call(x, probe)
        inside = dpo_call(batch, probe)
    for k, name in ((0, "losses"), (2, "grad_chosen"), (3, "grad_rejected")):
        check_equal(f"{name} of the pairs", inside[k][rows], alone[k])


@pytest.mark.parametrize("backend", backends("dpo_loss"))
def test_dpo_loss_matches_reference(backend):
    fuzz_run(check_dpo_loss_matches_reference, backend, dpo_cases(backend), ci=6)


@pytest.mark.parametrize("backend", backends("dpo_loss", invariant_only=True))
def test_dpo_loss_batch_invariance(backend):
    fuzz_run(
        check_dpo_loss_batch_invariance,
        backend,
        rows_in_batch(dpo_cases(backend, one_row=True), limit(backend, 33, 4097), 0),
        ci=4,
    )


# =============================================================================================
# fused_linear_policy_loss
# =============================================================================================


@dataclass(frozen=True)
class FusedCase:
    """One ``fused_linear_policy_loss`` call: ``[B, T, H]`` hidden states (``[T, H]`` with ``one_sequence``),
    a ``[V, H]`` head, policy-loss keywords."""

    b: int
    t: int
    h: int
    v: int
    seed: int
    kwargs: tuple[tuple[str, object], ...]
    dtype: str = "float32"
    temperature: float = 1.0
    ignored: float = 0.2  # share of ignored targets
    return_entropy: bool = False
    one_sequence: bool = False
    tensors: tuple[str, ...] = ()  # "ref_logprob" given
    mode: str = "lean"
    chunk_tokens: int = 2048


@st.composite
def fused_cases(draw, backend: str) -> FusedCase:
    kw = draw(policy_kwargs())
    tensors = ("ref_logprob",) if draw(st.booleans()) else ()
    if tensors:
        kw |= {"kl": draw(st.sampled_from(KL_NAMES)), "kl_coef": draw(st.sampled_from([0.1, 0.0]))}
    if draw(st.booleans()):
        kw["entropy_coef"] = draw(st.sampled_from([0.01, -0.5]))
    one_sequence = draw(st.booleans())
    b = 1 if one_sequence else draw(sizes(1, limit(backend, 1, 8)))
    return FusedCase(
        b=b,
        t=draw(sizes(1, limit(backend, 17, 129))),
        h=draw(sizes(1, limit(backend, 17, 256))),
        v=draw(sizes(1, limit(backend, 129, 4097))),
        seed=draw(seeds),
        kwargs=tuple(sorted(kw.items())),
        dtype=draw(st.sampled_from(dtype_names(backend, "linear_logprob"))),
        temperature=draw(st.sampled_from([1.0, 0.05, 0.7, 2.0])),
        ignored=draw(st.sampled_from([0.2, 0.0, 1.0])),
        return_entropy=draw(st.booleans()),
        one_sequence=one_sequence,
        tensors=tensors,
        mode=draw(st.sampled_from(["lean", "one_pass"])),
        chunk_tokens=draw(st.sampled_from([1, 7, 64, 2048])),
    )


def fused_inputs(case: FusedCase) -> dict[str, torch.Tensor]:
    g = generator(case.seed)
    b, t = case.b, case.t
    hidden = torch.randn(b, t, case.h, generator=g)
    weight = torch.randn(case.v, case.h, generator=g) * (3 / math.sqrt(case.h))
    targets = torch.randint(0, case.v, (b, t), generator=g)
    targets[torch.rand(b, t, generator=g) < case.ignored] = -100
    x = {
        "hidden": hidden.to(DTYPES[case.dtype]),
        "weight": weight.to(DTYPES[case.dtype]),
        "targets": targets,
        "old_logprob": -torch.rand(b, t, generator=g) * 6,
        "advantages": torch.randn(b, t, generator=g),
        "mask": make_mask(b, t, "holes", g),
    }
    if "ref_logprob" in case.tensors:
        x["ref_logprob"] = -torch.rand(b, t, generator=g) * 6
    if case.one_sequence:
        x = {name: value[0] for name, value in x.items() if name != "weight"} | {"weight": x["weight"]}
    return to_device(x)


def fused_call(x: dict[str, torch.Tensor], case: FusedCase, composed: bool, mode: str | None = None) -> tuple:
    """The fused op in ``mode`` (default ``case.mode``; ``composed``: ``linear_logprob`` then ``policy_loss``) and
    its backward: (loss, metrics, grad_hidden, grad_weight, entropy or None)."""
    kw = dict(case.kwargs)
    h, w = x["hidden"].detach().clone().requires_grad_(), x["weight"].detach().clone().requires_grad_()
    ref = x.get("ref_logprob")
    with_entropy = case.return_entropy or kw.get("entropy_coef", 0.0) != 0.0
    entropy = None
    if composed:  # a masked position counts as an ignored target
        scored = torch.where(x["mask"] != 0, x["targets"], -100)
        out = rlk.linear_logprob(h, w, scored, temperature=case.temperature, return_entropy=with_entropy)
        lp, ent = out if with_entropy else (out, None)
        valid = scored != -100

        def rows(t):
            return t.unsqueeze(0) if case.one_sequence and t is not None else t

        loss, metrics = rlk.policy_loss(
            rows(lp),
            rows(x["old_logprob"]),
            rows(x["advantages"]),
            rows(valid),
            ref_logprob=rows(ref),
            entropy=rows(ent),
            **kw,
        )
        entropy = ent.detach() if case.return_entropy else None
    else:
        out = rlk.fused_linear_policy_loss(
            h,
            w,
            x["targets"],
            x["old_logprob"],
            x["advantages"],
            x["mask"],
            temperature=case.temperature,
            ref_logprob=ref,
            return_entropy=case.return_entropy,
            mode=mode or case.mode,
            chunk_tokens=case.chunk_tokens,
            **kw,
        )
        loss, metrics = out[:2]
        entropy = out[2] if case.return_entropy else None
    loss.backward()
    return loss.detach(), metrics, grad_or_zeros(h), grad_or_zeros(w), entropy


def check_fused_linear_policy_loss_is_the_composition(backend: str, case: FusedCase) -> None:
    """Loss, metrics, gradients and entropy are bitwise those of ``linear_logprob`` (masked positions scored as
    ignored targets) then ``policy_loss`` with the ignored targets masked out (the op's definition; each part is
    checked against the contract by its own properties); loss and gradients finite, entropy >= 0."""
    x = fused_inputs(case)
    with on_backend(backend):
        fused = fused_call(x, case, composed=False, mode="lean")
        composed = fused_call(x, case, composed=True)
    check_equal("loss", fused[0], composed[0])
    assert set(fused[1]) == set(composed[1]), f"metrics {sorted(fused[1])} vs {sorted(composed[1])}"
    for name in fused[1]:
        check_equal(name, fused[1][name], composed[1][name])
    for k, name in ((2, "grad_hidden"), (3, "grad_weight"), (4, "entropy")):
        check_equal(name, fused[k], composed[k])
    for k, name in ((0, "loss"), (2, "grad_hidden"), (3, "grad_weight")):
        check_finite(name, fused[k])
    if fused[4] is not None:
        assert bool((fused[4] >= 0).all()), f"entropy < 0: min {fused[4].min().item()!r}"


def check_fused_linear_policy_loss_modes_agree(backend: str, case: FusedCase) -> None:
    """On a batch-invariant backend the one-pass mode's loss, metrics and entropy are the lean mode's bits (the
    log-probs are linear_logprob's, the loss one call over the batch); its gradients are finite where the lean
    mode's are, and zero on the rows of ignored targets."""
    x = fused_inputs(case)
    with on_backend(backend):
        one = fused_call(x, case, composed=False, mode="one_pass")
        lean = fused_call(x, case, composed=False, mode="lean")
    check_equal("loss", one[0], lean[0])
    for name in lean[1]:
        check_equal(name, one[1][name], lean[1][name])
    check_equal("entropy", one[4], lean[4])
    ignored = (x["targets"] == -100).reshape(-1)
    for k, name in ((2, "grad_hidden"), (3, "grad_weight")):
        if bool(torch.isfinite(lean[k]).all()):
            check_finite(name, one[k])
    assert bool((one[2].reshape(ignored.shape[0], -1)[ignored] == 0).all()), "grad_hidden of an ignored target"


def check_fused_linear_policy_loss_masked_positions(backend: str, case: FusedCase) -> None:
    """NaN / +-inf in the hidden states, old_logprob, advantages and ref_logprob at the positions left out of the
    loss (mask 0 or an ignored target) versus 0 there: bitwise equal loss, metrics, entropy and gradients,
    ``grad_weight`` included (in the case's mode)."""
    x = fused_inputs(case)
    out_of_loss = (x["mask"] == 0) | (x["targets"] == -100)
    g = generator(case.seed + 1)
    where = {"hidden": out_of_loss[..., None]}  # the whole row of a hidden state
    names = ("hidden", "old_logprob", "advantages", "ref_logprob")
    bad = {name: (poisoned(v, where.get(name, out_of_loss), g) if name in names else v) for name, v in x.items()}
    clean = {name: (zeroed(v, where.get(name, out_of_loss)) if name in names else v) for name, v in x.items()}
    with on_backend(backend):
        a, b = fused_call(bad, case, composed=False), fused_call(clean, case, composed=False)
    check_equal("loss", a[0], b[0])
    for name in a[1]:
        check_equal(name, a[1][name], b[1][name])
    for k, name in ((2, "grad_hidden"), (3, "grad_weight"), (4, "entropy")):
        check_equal(name, a[k], b[k])


@pytest.mark.parametrize("backend", backends("linear_logprob", "policy_loss"))
def test_fused_linear_policy_loss_is_the_composition(backend):
    fuzz_run(check_fused_linear_policy_loss_is_the_composition, backend, fused_cases(backend), ci=2)


@pytest.mark.parametrize("backend", backends("linear_logprob_stored", "policy_loss", invariant_only=True))
def test_fused_linear_policy_loss_modes_agree(backend):
    fuzz_run(check_fused_linear_policy_loss_modes_agree, backend, fused_cases(backend), ci=2)


@pytest.mark.parametrize("backend", backends("linear_logprob", "policy_loss"))
def test_fused_linear_policy_loss_masked_positions_never_matter(backend):
    fuzz_run(check_fused_linear_policy_loss_masked_positions, backend, fused_cases(backend), ci=2)
