"""The public policy-loss ops (``rlk.policy_loss``, ``rlk.kl_penalty``) on the reference backend.

Ground truth is independent: the policy-loss formulas of verl, TRL, OpenRLHF and slime,
re-derived below in plain PyTorch with each framework's defaults (as documented in
``/work/shared/design/RL_MATH.md``), run in float64 with autograd. rlk runs on the same
input values in float32; tolerances come from the numerical contract (``rlk.core.contract``).
Also: micro-batching with global normalizers, empty masks, extreme log-ratios, ``-inf`` at
masked positions, bad input, opcheck, ``torch.compile`` and batch invariance.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import rlk
from rlk.core import contract

ENTRY = contract.entry("policy_loss", torch.float32)
KL_ENTRY = contract.entry("kl_penalty", torch.float32)
AGGS = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSSES = ["ppo", "gspo", "cispo", "gpg", "sapo", "geo_mean", "vespo"]

# Worst deviation / allowed seen by the contract checks of this module (printed with RLK_REPORT_RATIOS=1, -s).
_WORST: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_ratios():
    yield
    if os.environ.get("RLK_REPORT_RATIOS") == "1":
        for name, ratio in sorted(_WORST.items(), key=lambda kv: -kv[1]):
            print(f"contract ratio {ratio:.3g}  {name}")


def _record(dev: contract.Deviation, tag: str) -> None:
    key = f"{tag}:{dev.name}"
    _WORST[key] = max(_WORST.get(key, 0.0), dev.ratio)
    assert dev.ok, dev


def check_value(name: str, got: torch.Tensor, truth: torch.Tensor, entry=ENTRY, tag="policy_loss") -> None:
    """``|got - truth| <= atol + rtol * (1 + |truth|)`` elementwise (the contract's "scale" of these ops)."""
    truth = truth.detach().double().reshape(-1)
    _record(contract.compare_outputs(entry, name, got.detach().reshape(-1), truth, 1.0 + truth.abs()), tag)


def check_grad(name: str, got: torch.Tensor, truth: torch.Tensor, entry=ENTRY, tag="policy_loss") -> None:
    _record(contract.compare_grad(entry, name, got, truth, 1.0), tag)


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------


def make_batch(
    b: int = 6, t: int = 13, seed: int = 0, per_seq_adv: bool = True, ragged: bool = True, extreme: bool = False
) -> dict:
    """fp32 inputs: right-padded rows of 1..t tokens (row 0 full), mixed-sign advantages, ratios spread
    around 1 with some far outside the clip ranges (r ~ 4.5 and ~ 0.2) and one row almost on-policy.
    ``extreme``: also log-ratios of +25 and -25 (past the +-20 clamps of verl and OpenRLHF)."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 4 - 0.05
    old = lp + 0.3 * torch.randn(b, t, generator=g)
    old[:, ::5] = lp[:, ::5] - 1.5
    old[:, 1::7] = lp[:, 1::7] + 1.5
    if b > 1:
        old[1] = lp[1] + 1e-5 * torch.randn(t, generator=g)
    if extreme:
        old[:, 3::6] = lp[:, 3::6] - 25.0
        old[:, 4::9] = lp[:, 4::9] + 25.0
    ref = lp + 0.7 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g) if per_seq_adv else torch.randn(b, t, generator=g)
    if per_seq_adv and b > 2:
        adv[0], adv[2] = abs(float(adv[0])) + 0.1, -abs(float(adv[2])) - 0.1
    lengths = torch.randint(1, t + 1, (b,), generator=g) if ragged else torch.full((b,), t)
    lengths[0] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]
    entropy = torch.rand(b, t, generator=g) * 2
    iw = torch.rand(b, t, generator=g) + 0.5
    return {"lp": lp, "old": old, "ref": ref, "adv": adv, "mask": mask, "entropy": entropy, "iw": iw}


def adv_bt(batch: dict) -> torch.Tensor:
    adv, lp = batch["adv"], batch["lp"]
    return adv[:, None].expand_as(lp) if adv.dim() == 1 else adv


def run_rlk(batch: dict, *, with_entropy_grad: bool = False, **kwargs):
    """rlk on the fp32 inputs: (loss, metrics, grad_logprob, grad_entropy)."""
    lp = batch["lp"].detach().clone().requires_grad_(True)
    ent = batch["entropy"].detach().clone().requires_grad_(True) if with_entropy_grad else kwargs.pop("entropy", None)
    if with_entropy_grad:
        kwargs.pop("entropy", None)
    loss, metrics = rlk.policy_loss(
        lp,
        kwargs.pop("old", batch["old"]),
        kwargs.pop("adv", batch["adv"]),
        kwargs.pop("mask", batch["mask"]),
        entropy=ent,
        **kwargs,
    )
    loss.backward()
    return loss.detach(), metrics, lp.grad, (ent.grad if with_entropy_grad else None)


def f64(batch: dict) -> dict:
    """The same input values in float64; ``lp`` a leaf that requires grad."""
    out = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
    out["lp"] = out["lp"].requires_grad_(True)
    out["entropy"] = out["entropy"].requires_grad_(True)
    return out


# ----------------------------------------------------------------------------------------------
# verl (verl.trainer.ppo.core_algos), re-derived: defaults clip_ratio 0.2, clip_ratio_c 3.0,
# log-ratio clamp +-20, loss_agg_mode token-mean, kl_loss_type low_var_kl
# ----------------------------------------------------------------------------------------------


def verl_masked_mean(x, m):
    return (x * m).sum() / (m.sum() + 1e-8)


def verl_agg(loss_mat, m, mode):
    m = m.to(loss_mat.dtype)
    if mode == "token-mean":
        return verl_masked_mean(loss_mat, m)
    if mode == "token-sum":  # not among the verl modes re-derived here: the plain masked sum
        return (loss_mat * m).sum()
    if mode == "seq-mean-token-sum":
        return (loss_mat * m).sum(-1).mean()
    if mode == "seq-mean-token-mean":
        return ((loss_mat * m).sum(-1) / m.sum(-1)).mean()
    if mode == "seq-mean-token-sum-norm":  # Dr.GRPO in verl: the sum of sequence sums over the padded length
        return (loss_mat * m).sum(-1).sum() / m.shape[-1]
    raise ValueError(mode)


def verl_agg_kwargs(mode, t):
    """rlk's aggregation arguments that reproduce verl's mode (no empty rows)."""
    if mode == "seq-mean-token-sum-norm":
        return {"agg": mode, "loss_scale": t, "global_seqs": 1}
    return {"agg": mode}


def verl_vanilla(lp, old, adv, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0):
    """Token losses and the metrics (pg_clipfrac, ppo_kl, pg_clipfrac_lower) of verl's PPO (dual clip on)."""
    neg_kl = torch.clamp(lp - old, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip1 = torch.maximum(l1, l2)
    l3 = -adv * clip_ratio_c
    clip2 = torch.min(l3, clip1)
    losses = torch.where(adv < 0, clip2, clip1)
    return losses, {
        "clipfrac": torch.gt(l2, l1),
        "ppo_kl": -neg_kl,
        "lower": torch.gt(clip1, l3) & (adv < 0),
        "ratio": ratio,
    }


def verl_gspo(lp, old, adv, m, clip_low, clip_high):
    d = lp - old
    n = m.sum(-1).clamp(min=1)
    seq = (d * m).sum(-1) / n
    log_s = lp - lp.detach() + seq.detach()[:, None]
    log_s = torch.clamp(log_s, max=10.0)
    s = torch.exp(log_s)
    l1 = -adv * s
    l2 = -adv * torch.clamp(s, 1 - clip_low, 1 + clip_high)
    return torch.maximum(l1, l2)


def verl_gpg(lp, adv):
    return -lp * adv


def verl_cispo(lp, old, adv, clip_low=0.2, clip_high=0.2):
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    return -torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach() * adv * lp


def verl_geo_mean(lp, old, adv, m, clip_low=0.4, clip_high=0.4):
    """verl's GMPO: already a scalar (torch.mean over the sequences)."""
    m = m.to(lp.dtype)
    neg_kl = lp - old
    sgn = torch.sign(adv)
    clamped = torch.clamp(neg_kl, -clip_low, clip_high)
    kl_min = sgn * torch.min(sgn * neg_kl, sgn * clamped)
    n = m.sum(-1)
    ratio = torch.exp((kl_min * m).sum(-1) / (n + 1e-8))
    seq_adv = (adv * m).sum(-1) / (n + 1e-8)
    return torch.mean(-seq_adv * ratio)


def sapo_token_losses(lp, old, adv, tau_pos=1.0, tau_neg=1.05):
    """SAPO (TRL sapo_temperature_pos / _neg defaults 1.0 / 1.05, no clamp)."""
    ratio = torch.exp(lp - old)
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(lp.dtype)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv


def verl_low_var_kl(lp, ref):
    kl = ref - lp
    kl = torch.clamp(kl, min=-20, max=20)
    kld = torch.exp(kl) - kl - 1
    return torch.clamp(kld, min=-10, max=10)


def verl_kl_penalty(lp, ref, name):
    if name in ("kl", "k1"):
        return lp - ref
    if name == "abs":
        return (lp - ref).abs()
    if name in ("mse", "k2"):
        return 0.5 * (lp - ref).square()
    if name in ("low_var_kl", "k3"):
        return verl_low_var_kl(lp, ref)
    if name.endswith("+"):  # straight-through: value of the estimator, gradient of k2
        backward = 0.5 * (lp - ref).square()
        return backward - backward.detach() + verl_kl_penalty(lp, ref, name[:-1]).detach()
    raise ValueError(name)


VERL_TOKEN_LOSSES = {
    "ppo": lambda b: verl_vanilla(b["lp"], b["old"], adv_bt(b))[0],
    "gpg": lambda b: verl_gpg(b["lp"], adv_bt(b)),
    "cispo": lambda b: verl_cispo(b["lp"], b["old"], adv_bt(b)),
    "sapo": lambda b: sapo_token_losses(b["lp"], b["old"], adv_bt(b)),
    "gspo": lambda b: verl_gspo(b["lp"], b["old"], adv_bt(b), b["mask"], 3e-4, 4e-4),
}
RLK_FOR_VERL = {
    "ppo": {"loss": "ppo", "dual_clip": 3.0, "clamp_log_ratio": 20.0},
    "gpg": {"loss": "gpg"},
    "cispo": {"loss": "cispo", "clamp_log_ratio": 20.0},
    "sapo": {"loss": "sapo"},
    "gspo": {"loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4, "clamp_log_ratio": (None, 10.0)},
}


@pytest.mark.parametrize("mode", AGGS)
@pytest.mark.parametrize("variant", list(VERL_TOKEN_LOSSES))
def test_verl_every_variant_and_aggregation(variant, mode):
    """verl's token losses through verl's agg_loss; rlk with the matching arguments (rlk accepts any
    aggregation for gspo, where verl forces seq-mean-token-mean)."""
    batch = make_batch(seed=1, ragged=True, extreme=variant in ("ppo", "cispo", "gspo"))
    truth = f64(batch)
    expected = verl_agg(VERL_TOKEN_LOSSES[variant](truth), truth["mask"], mode)
    expected.backward()
    loss, _, grad, _ = run_rlk(batch, **RLK_FOR_VERL[variant], **verl_agg_kwargs(mode, batch["lp"].shape[1]))
    check_value(f"verl {variant} {mode} loss", loss, expected)
    check_grad(f"verl {variant} {mode} grad", grad, truth["lp"].grad)


def test_verl_ppo_defaults_with_kl_entropy_and_metrics():
    """verl's actor objective: pg_loss - entropy_coeff * agg(entropy) + kl_loss_coef * agg(low_var_kl), and the
    metrics it logs (pg_clipfrac, ppo_kl, pg_clipfrac_lower)."""
    batch = make_batch(seed=2)
    truth = f64(batch)
    m = truth["mask"].double()
    token_losses, stats = verl_vanilla(truth["lp"], truth["old"], adv_bt(truth))
    kl = verl_kl_penalty(truth["lp"], truth["ref"], "low_var_kl")
    expected = (
        verl_agg(token_losses, m, "token-mean")
        - 0.001 * verl_agg(truth["entropy"], m, "token-mean")
        + 0.001 * verl_agg(kl, m, "token-mean")
    )
    expected.backward()
    loss, metrics, grad, grad_ent = run_rlk(
        batch,
        dual_clip=3.0,
        clamp_log_ratio=20.0,
        ref_logprob=batch["ref"],
        kl="low_var_kl",
        kl_coef=0.001,
        entropy=batch["entropy"],
        entropy_coef=0.001,
        with_entropy_grad=True,
    )
    check_value("verl objective", loss, expected)
    check_grad("verl grad_logprob", grad, truth["lp"].grad)
    check_grad("verl grad_entropy", grad_ent, truth["entropy"].grad)
    check_value("clip_fraction", metrics["clip_fraction"], verl_masked_mean(stats["clipfrac"].double(), m))
    check_value("lower_clip_fraction", metrics["lower_clip_fraction"], verl_masked_mean(stats["lower"].double(), m))
    check_value("approx_kl", metrics["approx_kl"], verl_masked_mean(stats["ppo_kl"], m))
    check_value("ratio_mean", metrics["ratio_mean"], verl_masked_mean(stats["ratio"], m))
    check_value("ratio_max", metrics["ratio_max"], stats["ratio"][truth["mask"]].max())
    check_value("entropy_mean", metrics["entropy_mean"], verl_masked_mean(truth["entropy"], m))
    check_value("kl_mean", metrics["kl_mean"], verl_masked_mean(kl, m))
    assert float(metrics["clip_fraction"]) > 0 and float(metrics["lower_clip_fraction"]) > 0
    assert all(v.dtype == torch.float32 and v.dim() == 0 and not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("clip_low, clip_high", [(0.4, 0.4), (0.3, 0.5)])
def test_verl_geo_mean(clip_low, clip_high):
    """GMPO (verl's recipe: clip 0.4 both sides, in log space); the sign-aware clip fraction."""
    batch = make_batch(seed=3, ragged=True)
    truth = f64(batch)
    a, d, m = adv_bt(truth), truth["lp"] - truth["old"], truth["mask"]
    expected = verl_geo_mean(truth["lp"], truth["old"], a, m, clip_low, clip_high)
    expected.backward()
    # verl's torch.mean counts every row: global_seqs = B.
    loss, metrics, grad, _ = run_rlk(
        batch,
        loss="geo_mean",
        clip_low=clip_low,
        clip_high=clip_high,
        agg="seq-mean-token-mean",
        global_seqs=batch["lp"].shape[0],
    )
    check_value("verl geo_mean loss", loss, expected)
    check_grad("verl geo_mean grad", grad, truth["lp"].grad)
    clipped = ((a > 0) & (d > clip_high)) | ((a < 0) & (d < -clip_low))
    check_value("geo_mean clip_fraction", metrics["clip_fraction"], clipped[m].double().mean())
    assert float(metrics["clip_fraction"]) > 0


def test_verl_gspo_metrics():
    batch = make_batch(seed=4)
    truth = f64(batch)
    m = truth["mask"].double()
    _, metrics, _, _ = run_rlk(batch, **RLK_FOR_VERL["gspo"], agg="seq-mean-token-mean")
    s = torch.exp(torch.clamp(((truth["lp"] - truth["old"]) * m).sum(-1) / m.sum(-1), max=10.0))[:, None]
    a = adv_bt(truth)
    clipped = (-a * torch.clamp(s, 1 - 3e-4, 1 + 4e-4)) > (-a * s)
    check_value("gspo clip_fraction", metrics["clip_fraction"], verl_masked_mean(clipped.double(), m))
    check_value("gspo approx_kl", metrics["approx_kl"], verl_masked_mean(truth["old"] - truth["lp"], m))
    check_value("gspo ratio_mean", metrics["ratio_mean"], verl_masked_mean(s.expand_as(m), m))
    assert 0 < float(metrics["clip_fraction"]) < 1


# ----------------------------------------------------------------------------------------------
# TRL (GRPOTrainer._compute_loss), re-derived: epsilon 0.2, no log-ratio clamp, beta * k3 (unclamped)
# added per token, loss types grpo / bnpo / dr_grpo / dapo, delta (two-sided), sequence-level IS,
# cispo (upper cap epsilon_high), sapo
# ----------------------------------------------------------------------------------------------


def trl_loss(
    lp,
    old,
    adv,
    m,
    *,
    loss_type,
    eps_low=0.2,
    eps_high=0.2,
    delta=None,
    beta=0.0,
    ref=None,
    level="token",
    max_completion_length=None,
    num_items_in_batch=None,
):
    m = m.to(lp.dtype)
    log_ratio = lp - old
    if level == "sequence":
        log_w = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_w = log_ratio
    coef_1 = torch.exp(log_w)
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=eps_high).detach() * adv[:, None] * lp
    elif loss_type == "sapo":
        per_token = sapo_token_losses(lp, old, adv[:, None].expand_as(lp))
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if beta != 0.0:
        per_token = per_token + beta * (torch.exp(ref - lp) - (ref - lp) - 1)
    if loss_type in ("grpo", "sapo"):  # TRL 1.16 aggregates sapo like grpo
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (per_token.size(0) * max_completion_length)
    if loss_type in ("dapo", "cispo"):
        return (per_token * m).sum() / num_items_in_batch
    raise ValueError(loss_type)


def rlk_for_trl(loss_type, b, t, n_items):
    return {
        "grpo": {"agg": "seq-mean-token-mean", "global_seqs": b},
        "bnpo": {"agg": "token-mean"},
        "dr_grpo": {"agg": "seq-mean-token-sum-norm", "loss_scale": t, "global_seqs": b},
        "dapo": {"agg": "token-mean", "global_tokens": n_items},
        "cispo": {"agg": "token-mean", "global_tokens": n_items},
        "sapo": {"agg": "seq-mean-token-mean", "global_seqs": b},
    }[loss_type]


TRL_CASES = [
    ("grpo", {}, {}),
    ("bnpo", {}, {}),
    ("dr_grpo", {}, {}),
    ("dapo", {"eps_high": 0.28}, {"clip_high": 0.28}),
    ("grpo", {"beta": 0.04}, {"kl": "k3", "kl_k3_clamp": False, "kl_coef": 0.04}),
    ("dapo", {"delta": 4.0}, {"dual_clip": 4.0}),
    (
        "grpo",
        {"level": "sequence", "eps_low": 3e-4, "eps_high": 4e-4},
        {"loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4},
    ),
    (
        "dapo",
        {"level": "sequence", "eps_low": 3e-4, "eps_high": 4e-4},
        {"loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4},
    ),
    ("cispo", {"eps_high": 5.0}, {"loss": "cispo", "cispo_form": "upper", "clip_high": 5.0}),
    ("sapo", {}, {"loss": "sapo"}),
]


@pytest.mark.parametrize("loss_type, trl_kwargs, rlk_kwargs", TRL_CASES)
def test_trl(loss_type, trl_kwargs, rlk_kwargs):
    """TRL's GRPO family; the sequence-level cases equal rlk's GSPO-token form because the advantage
    is per sequence. num_items_in_batch (dapo) plays the global token count of two micro-batches."""
    batch = make_batch(b=7, t=11, seed=5)
    truth = f64(batch)
    b, t = batch["lp"].shape
    n_items = 2 * int(batch["mask"].sum())
    expected = trl_loss(
        truth["lp"],
        truth["old"],
        truth["adv"],
        truth["mask"],
        loss_type=loss_type,
        ref=truth["ref"],
        max_completion_length=t,
        num_items_in_batch=n_items,
        **trl_kwargs,
    )
    expected.backward()
    ref = batch["ref"] if "kl_coef" in rlk_kwargs else None
    loss, _, grad, _ = run_rlk(batch, ref_logprob=ref, **rlk_for_trl(loss_type, b, t, n_items), **rlk_kwargs)
    check_value(f"trl {loss_type} {trl_kwargs} loss", loss, expected)
    check_grad(f"trl {loss_type} {trl_kwargs} grad", grad, truth["lp"].grad)


def test_trl_on_policy_without_old_logprob():
    """TRL's first iteration: old = logprob.detach(); rlk: old_logprob=None (ratio 1)."""
    batch = make_batch(seed=6)
    truth = f64(batch)
    lp = truth["lp"]
    expected = trl_loss(lp, lp.detach(), truth["adv"], truth["mask"], loss_type="bnpo")
    expected.backward()
    loss, metrics, grad, _ = run_rlk(batch, old=None)
    check_value("on-policy loss", loss, expected)
    check_grad("on-policy grad", grad, lp.grad)
    assert float(metrics["ratio_mean"]) == 1.0 and float(metrics["clip_fraction"]) == 0.0


# ----------------------------------------------------------------------------------------------
# OpenRLHF (openrlhf.models.loss.PolicyLoss), re-derived: clip 0.2 / 0.2, log-ratio clamp +-20,
# dual clip off, token_level_loss=True (token mean) or False (mean over sequences of token means);
# KL: compute_approx_kl clamped to [-10, 10]
# ----------------------------------------------------------------------------------------------


def openrlhf_masked_mean(x, m, dim=None):
    if dim is None:
        return (x * m).sum() / m.sum()
    return (x * m).sum(dim) / m.sum(dim)


def openrlhf_policy_loss(
    lp, old, adv, m, *, clip_low=0.2, clip_high=0.2, dual_clip=None, token_level_loss=True, policy_loss_type="ppo"
):
    m = m.to(lp.dtype)
    if policy_loss_type == "ppo":
        ratio = torch.clamp(lp - old, min=-20.0, max=20.0).exp()
    else:  # gspo: the sequence ratio, gradient through the mean
        ratio = (((lp - old) * m).sum(-1) / m.sum(-1)).exp().unsqueeze(-1) * m
    surr1 = ratio * adv
    surr2 = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    if dual_clip is None:
        loss = -torch.min(surr1, surr2)
    else:
        clip1 = torch.min(surr1, surr2)
        clip2 = torch.max(clip1, dual_clip * adv)
        loss = -torch.where(adv < 0, clip2, clip1)
    if token_level_loss:
        return openrlhf_masked_mean(loss, m)
    return openrlhf_masked_mean(loss, m, dim=-1).mean()


def openrlhf_approx_kl(lp, ref, estimator):
    log_ratio = lp - ref
    if estimator == "k2":
        log_ratio = log_ratio**2 / 2.0
    elif estimator == "k3":
        log_ratio = -log_ratio
        log_ratio = log_ratio.exp() - 1 - log_ratio
    return log_ratio.clamp(min=-10, max=10)


@pytest.mark.parametrize("token_level_loss", [True, False])
@pytest.mark.parametrize("case", ["ppo", "dual_clip", "gspo", "kl_k1", "kl_k2", "kl_k3"])
def test_openrlhf(case, token_level_loss):
    batch = make_batch(seed=7, extreme=case != "gspo")
    truth = f64(batch)
    m = truth["mask"].double()
    a = adv_bt(truth)
    agg = "token-mean" if token_level_loss else "seq-mean-token-mean"
    kwargs = {"agg": agg, "clamp_log_ratio": 20.0}
    if case == "gspo":
        expected = openrlhf_policy_loss(
            truth["lp"], truth["old"], a, m, policy_loss_type="gspo", token_level_loss=token_level_loss
        )
        kwargs = {"agg": agg, "loss": "gspo"}
    else:
        expected = openrlhf_policy_loss(
            truth["lp"],
            truth["old"],
            a,
            m,
            token_level_loss=token_level_loss,
            dual_clip=3.0 if case == "dual_clip" else None,
        )
    if case == "dual_clip":
        kwargs["dual_clip"] = 3.0
    if case.startswith("kl_"):
        estimator = case[3:]
        kl = openrlhf_approx_kl(truth["lp"], truth["ref"], estimator)
        expected = expected + 0.01 * (
            openrlhf_masked_mean(kl, m) if token_level_loss else openrlhf_masked_mean(kl, m, dim=-1).mean()
        )
        kwargs.update(ref_logprob=batch["ref"], kl=estimator, kl_coef=0.01, kl_clamp=10.0, kl_k3_clamp=False)
    expected.backward()
    loss, _, grad, _ = run_rlk(batch, **kwargs)
    check_value(f"openrlhf {case} loss", loss, expected)
    check_grad(f"openrlhf {case} grad", grad, truth["lp"].grad)


# ----------------------------------------------------------------------------------------------
# slime, re-derived: cispo with eps_low 1.0 (no lower bound), eps_high 4.0, no clamp; unbiased KL
# ----------------------------------------------------------------------------------------------


def test_slime_cispo_and_unbiased_kl():
    batch = make_batch(seed=8)
    batch["old"][:, 3::6] = batch["lp"][:, 3::6] - 2.5  # r = 12: past the upper bound 5
    truth = f64(batch)
    m = truth["mask"].double()
    lp, old, a = truth["lp"], truth["old"], adv_bt(truth)
    weight = torch.clamp(torch.exp(lp - old), 1 - 1.0, 1 + 4.0).detach()
    pg = -(weight * a * lp)
    kl = torch.exp(lp - old).detach() * verl_low_var_kl(lp, truth["ref"])
    expected = (pg * m).sum() / m.sum() + 0.01 * (kl * m).sum() / m.sum()
    expected.backward()
    loss, metrics, grad, _ = run_rlk(
        batch,
        loss="cispo",
        clip_low=1.0,
        clip_high=4.0,
        ref_logprob=batch["ref"],
        kl="low_var_kl",
        kl_coef=0.01,
        kl_unbiased=True,
    )
    check_value("slime cispo loss", loss, expected)
    check_grad("slime cispo grad", grad, lp.grad)
    check_value("slime kl_mean", metrics["kl_mean"], (kl * m).sum() / m.sum())
    clipped = (weight != torch.exp(lp - old)).double()
    check_value("slime cispo clip_fraction", metrics["clip_fraction"], (clipped * m).sum() / m.sum())
    assert float(metrics["clip_fraction"]) > 0


# ----------------------------------------------------------------------------------------------
# every variant x every aggregation: importance weights, per-token advantages, gradcheck
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("loss", LOSSES)
def test_importance_weights_and_token_advantages(loss, agg):
    """Per-token advantages and importance weights: rlk in fp32 against rlk's own fp64 run (the reference
    backend's ground-truth mode), whose math the framework tests above pin down."""
    batch = make_batch(seed=9, per_seq_adv=loss != "geo_mean")
    kwargs = {"loss": loss, "agg": agg, "importance_weights": batch["iw"]}
    if agg == "seq-mean-token-sum-norm":
        kwargs["loss_scale"] = 16
    loss32, metrics32, grad32, _ = run_rlk(batch, **kwargs)
    truth = f64(batch)
    kwargs["importance_weights"] = truth["iw"]
    loss64, metrics64, grad64, _ = run_rlk(truth, **kwargs)
    check_value(f"{loss} {agg} iw loss", loss32, loss64)
    check_grad(f"{loss} {agg} iw grad", grad32, grad64)
    for name, value in metrics32.items():
        check_value(f"{loss} {name}", value, metrics64[name])


@pytest.mark.parametrize("loss", ["ppo", "gpg", "sapo", "geo_mean"])
def test_fp64_gradcheck(loss):
    """Where the gradient is the true derivative of the value (not for gspo's and cispo's stop-gradients)."""
    batch = make_batch(b=3, t=5, seed=10)
    old, adv, mask = batch["old"].double(), batch["adv"].double(), batch["mask"]
    iw, ref = batch["iw"].double(), batch["ref"].double()
    lp = batch["lp"].double().requires_grad_(True)
    ent = batch["entropy"].double().requires_grad_(True)

    def fn(x, h):
        return rlk.policy_loss(
            x,
            old,
            adv,
            mask,
            loss=loss,
            dual_clip=3.0 if loss == "ppo" else None,
            importance_weights=iw,
            agg="seq-mean-token-mean",
            ref_logprob=ref,
            kl="k3",
            kl_coef=0.1,
            entropy=h,
            entropy_coef=0.01,
        )[0]

    assert torch.autograd.gradcheck(fn, (lp, ent))


# ----------------------------------------------------------------------------------------------
# micro-batching with global normalizers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("loss", LOSSES)
def test_micro_batches_add_up_to_the_full_batch(loss, agg):
    """Split a batch into micro-batches, pass the global normalizers of the whole batch: the micro losses add
    up to the full-batch loss and the gradients match (loss, KL and entropy terms)."""
    batch = make_batch(b=9, t=10, seed=11)
    batch["mask"][4] = False  # an empty sequence: counted by neither normalizer
    tokens = int(batch["mask"].sum())
    seqs = int(batch["mask"].any(dim=1).sum())
    kwargs = {
        "loss": loss,
        "agg": agg,
        "global_tokens": tokens,
        "global_seqs": torch.tensor(float(seqs)),
        "ref_logprob": None,
        "kl_coef": 0.05,
        "entropy_coef": 0.01,
    }
    if agg == "seq-mean-token-sum-norm":
        kwargs["loss_scale"] = 12.0

    def run(rows):
        part = {k: v[rows] for k, v in batch.items()}
        return run_rlk(
            part, **{**kwargs, "ref_logprob": part["ref"], "entropy": part["entropy"]}, with_entropy_grad=True
        )

    full_loss, _, full_grad, full_ent_grad = run(slice(0, 9))
    pieces = [run(rows) for rows in (slice(0, 2), slice(2, 7), slice(7, 9))]
    check_value(f"{loss} {agg} micro sum", sum(p[0] for p in pieces), full_loss)
    check_grad(f"{loss} {agg} micro grad", torch.cat([p[2] for p in pieces]), full_grad)
    check_grad(f"{loss} {agg} micro grad_entropy", torch.cat([p[3] for p in pieces]), full_ent_grad)
    # without global normalizers the micro-batch is the whole batch: the one-piece "split" is the full batch
    local = run_rlk(batch, loss=loss, agg=agg, loss_scale=kwargs.get("loss_scale"))
    global_ = run_rlk(
        batch, loss=loss, agg=agg, loss_scale=kwargs.get("loss_scale"), global_tokens=tokens, global_seqs=seqs
    )
    assert torch.equal(local[0], global_[0]) and torch.equal(local[2], global_[2])


# ----------------------------------------------------------------------------------------------
# edge cases
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("loss", LOSSES)
def test_empty_mask_gives_zero_loss_and_gradient(loss, agg):
    batch = make_batch(b=4, t=6, seed=12)
    batch["mask"][:] = False
    kwargs = {
        "loss": loss,
        "agg": agg,
        "ref_logprob": batch["ref"],
        "kl_coef": 0.1,
        "entropy": batch["entropy"],
        "entropy_coef": 0.1,
        "loss_scale": 6 if agg == "seq-mean-token-sum-norm" else None,
    }
    value, metrics, grad, grad_ent = run_rlk(batch, with_entropy_grad=True, **kwargs)
    assert float(value) == 0.0 and torch.all(grad == 0) and torch.all(grad_ent == 0)
    assert all(float(v) == 0.0 for v in metrics.values())


@pytest.mark.parametrize("loss", LOSSES)
def test_empty_rows_do_not_change_the_loss(loss):
    """Rows without loss tokens get zero gradient and, with local normalizers, leave the loss unchanged."""
    batch = make_batch(b=5, t=8, seed=13)
    batch["mask"][[1, 3]] = False
    keep = [0, 2, 4]
    for agg in AGGS:
        scale = 8 if agg == "seq-mean-token-sum-norm" else None
        value, _, grad, _ = run_rlk(batch, loss=loss, agg=agg, loss_scale=scale)
        sub = {k: v[keep] for k, v in batch.items()}
        value_sub, _, grad_sub, _ = run_rlk(sub, loss=loss, agg=agg, loss_scale=scale)
        check_value(f"{loss} {agg} empty rows", value, value_sub)
        assert torch.all(grad[[1, 3]] == 0)
        check_grad(f"{loss} {agg} empty rows grad", grad[keep], grad_sub)


def test_empty_batch():
    for shape in ((0, 5), (3, 0)):
        lp = torch.zeros(shape, requires_grad=True)
        ent = torch.zeros(shape, requires_grad=True)
        value, metrics = rlk.policy_loss(
            lp, lp.detach(), torch.zeros(shape[0]), torch.zeros(shape, dtype=torch.bool), entropy=ent, entropy_coef=0.1
        )
        value.backward()
        assert float(value.detach()) == 0.0 and lp.grad.shape == shape and ent.grad.shape == shape
        assert all(float(v) == 0.0 for v in metrics.values())
    kl = rlk.kl_penalty(torch.zeros(0, 3), torch.zeros(0, 3), "k3")
    assert kl.shape == (0, 3)


@pytest.mark.parametrize("clamp", [None, 20.0])
@pytest.mark.parametrize("loss", LOSSES)
def test_log_ratios_of_plus_minus_50(loss, clamp):
    """d = +-50: exp(50) = 5e21 is finite in fp32, so no inf / NaN anywhere (the frameworks have none here)."""
    batch = make_batch(b=4, t=6, seed=14)
    batch["old"][:, ::2] = batch["lp"][:, ::2] - 50.0
    batch["old"][:, 1::2] = batch["lp"][:, 1::2] + 50.0
    batch["ref"] = batch["lp"] - 50.0 * torch.sign(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)))
    kwargs = {"loss": loss, "clamp_log_ratio": clamp, "ref_logprob": batch["ref"], "kl_coef": 0.1, "kl": "k3"}
    value, metrics, grad, _ = run_rlk(batch, **kwargs)
    assert math.isfinite(float(value)) and bool(torch.isfinite(grad).all())
    assert all(math.isfinite(float(v)) for v in metrics.values())
    truth = f64(batch)
    value64, metrics64, grad64, _ = run_rlk(truth, **{**kwargs, "ref_logprob": truth["ref"]})
    check_value(f"{loss} +-50 loss", value, value64)
    check_grad(f"{loss} +-50 grad", grad, grad64)
    for name in metrics:
        check_value(f"{loss} +-50 {name}", metrics[name], metrics64[name])


def test_sapo_at_a_log_ratio_of_90_has_the_right_gradient():
    """exp(90) overflows fp32: the gradient -4 A f (1 - f) r is 0 there (f = 1), not 0 * inf = NaN."""
    batch = make_batch(b=3, t=5, seed=21)
    batch["old"] = batch["lp"] - 90.0
    value, _, grad, _ = run_rlk(batch, loss="sapo")
    truth = f64(batch)
    value64, _, grad64, _ = run_rlk(truth, loss="sapo")
    assert bool(torch.isfinite(grad).all())
    check_value("sapo d=90 loss", value, value64)
    check_grad("sapo d=90 grad", grad, grad64)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("d", [90.0, -90.0, 100.0, -100.0, 200.0, -200.0])
def test_log_ratios_beyond_the_fp32_range_of_exp_give_no_nan(loss, d):
    """|d| >= 90 without a clamp: r = exp(d) is inf or 0 in fp32. No NaN anywhere (loss, gradient, metrics),
    also with zero advantages, zero importance weights and the unbiased KL (``0 * inf`` counts as 0); values
    whose exact result exceeds fp32 are +-inf. Advantages have one sign per call, so rows of +inf and -inf never
    meet in the sum (that sum has no fp32 value)."""
    batch = make_batch(b=4, t=6, seed=22)
    batch["old"] = batch["lp"] - d
    batch["ref"] = batch["lp"] + d
    batch["iw"][:, ::2] = 0.0
    for adv in (torch.zeros(4), batch["adv"].abs() + 0.1, -batch["adv"].abs() - 0.1):
        for extra in (
            {},
            {"importance_weights": batch["iw"]},
            {"ref_logprob": batch["ref"], "kl_coef": 0.1, "kl_unbiased": True},
        ):
            value, metrics, grad, _ = run_rlk(batch, loss=loss, adv=adv, **extra)
            what = (loss, d, float(adv[0]), list(extra))
            assert not bool(value.isnan()), what
            assert not bool(grad.isnan().any()), what
            assert not any(bool(v.isnan()) for v in metrics.values()), what
            if float(adv[0]) == 0.0 and not extra:
                assert float(value) == 0.0 and bool((grad == 0).all()), what
    kl = rlk.kl_penalty(batch["lp"], batch["ref"], "k3", k3_clamp=False, old_logprob=batch["old"])
    assert not bool(kl.isnan().any())


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("loss", LOSSES)
def test_minus_inf_at_masked_positions(loss, agg):
    """-inf log-probs (and NaN entropies) where the mask is off change nothing, bit for bit, and make no NaN."""
    batch = make_batch(b=5, t=9, seed=15, per_seq_adv=False)
    kwargs = {
        "loss": loss,
        "agg": agg,
        "importance_weights": batch["iw"],
        "kl_coef": 0.1,
        "entropy_coef": 0.01,
        "loss_scale": 9 if agg == "seq-mean-token-sum-norm" else None,
    }
    off = ~batch["mask"]
    clean = run_rlk(batch, ref_logprob=batch["ref"], entropy=batch["entropy"], with_entropy_grad=True, **kwargs)
    poisoned = {k: v.clone() for k, v in batch.items()}
    for name in ("lp", "old", "ref"):
        poisoned[name][off] = -math.inf
    poisoned["entropy"][off] = math.nan
    poisoned["iw"][off] = math.inf
    poisoned["adv"][off] = math.nan
    kwargs["importance_weights"] = poisoned["iw"]
    dirty = run_rlk(
        poisoned, ref_logprob=poisoned["ref"], entropy=poisoned["entropy"], with_entropy_grad=True, **kwargs
    )
    assert torch.equal(clean[0], dirty[0])
    assert torch.equal(clean[2], dirty[2]) and torch.equal(clean[3], dirty[3])
    assert all(torch.equal(clean[1][k], dirty[1][k]) for k in clean[1])
    assert bool(torch.isfinite(dirty[2]).all()) and torch.all(dirty[2][off] == 0)


def test_mask_dtypes_and_advantage_shapes():
    batch = make_batch(seed=16)
    expected = rlk.policy_loss(batch["lp"], batch["old"], batch["adv"], batch["mask"])[0]
    for mask in (batch["mask"].float(), batch["mask"].int(), batch["mask"].to(torch.uint8)):
        assert torch.equal(rlk.policy_loss(batch["lp"], batch["old"], batch["adv"], mask)[0], expected)
    for adv in (batch["adv"][:, None], adv_bt(batch).contiguous()):
        assert torch.equal(rlk.policy_loss(batch["lp"], batch["old"], adv, batch["mask"])[0], expected)
    bf16 = rlk.policy_loss(batch["lp"].bfloat16(), batch["old"].bfloat16(), batch["adv"], batch["mask"])[0]
    assert bf16.dtype == torch.float32
    lp = batch["lp"].bfloat16().requires_grad_(True)
    rlk.policy_loss(lp, batch["old"], batch["adv"], batch["mask"])[0].backward()
    assert lp.grad.dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# kl_penalty
# ----------------------------------------------------------------------------------------------


def _kl_inputs(n=64, seed=17):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(4, n // 4, generator=g) * 5
    delta = torch.randn(4, n // 4, generator=g) * 3
    delta[0, :4] = torch.tensor([25.0, -25.0, -12.0, 15.0])  # past verl's +-20 and the +-10 value clamps
    return lp, lp - delta, lp + 0.3 * torch.randn(4, n // 4, generator=g)


KL_CASES = [
    # (rlk estimator, rlk kwargs, independent formula)
    ("k1", {}, lambda lp, ref, old: verl_kl_penalty(lp, ref, "k1")),
    ("kl", {}, lambda lp, ref, old: verl_kl_penalty(lp, ref, "kl")),
    ("abs", {}, lambda lp, ref, old: verl_kl_penalty(lp, ref, "abs")),
    ("k2", {}, lambda lp, ref, old: verl_kl_penalty(lp, ref, "k2")),
    ("mse", {}, lambda lp, ref, old: verl_kl_penalty(lp, ref, "mse")),
    ("k3", {}, lambda lp, ref, old: verl_kl_penalty(lp, ref, "k3")),
    ("low_var_kl", {}, lambda lp, ref, old: verl_kl_penalty(lp, ref, "low_var_kl")),
    ("k3+", {}, lambda lp, ref, old: verl_kl_penalty(lp, ref, "k3+")),
    ("k1", {"straight_through": True}, lambda lp, ref, old: verl_kl_penalty(lp, ref, "k1+")),
    ("k3", {"k3_clamp": False}, lambda lp, ref, old: torch.exp(ref - lp) - (ref - lp) - 1),  # TRL
    ("k1", {"clamp": 10.0, "k3_clamp": False}, lambda lp, ref, old: openrlhf_approx_kl(lp, ref, "k1")),
    ("k2", {"clamp": 10.0, "k3_clamp": False}, lambda lp, ref, old: openrlhf_approx_kl(lp, ref, "k2")),
    ("k3", {"clamp": 10.0, "k3_clamp": False}, lambda lp, ref, old: openrlhf_approx_kl(lp, ref, "k3")),
    ("low_var_kl", {"old": True}, lambda lp, ref, old: torch.exp(lp - old).detach() * verl_low_var_kl(lp, ref)),
]


@pytest.mark.parametrize("estimator, kwargs, formula", KL_CASES)
def test_kl_penalty_matches_the_frameworks(estimator, kwargs, formula):
    lp, ref, old = _kl_inputs()
    kwargs = dict(kwargs)
    use_old = kwargs.pop("old", False)
    x = lp.clone().requires_grad_(True)
    value = rlk.kl_penalty(x, ref, estimator, old_logprob=old if use_old else None, **kwargs)
    g = torch.randn(lp.shape, generator=torch.Generator().manual_seed(3))
    (value * g).sum().backward()
    x64 = lp.double().requires_grad_(True)
    expected = formula(x64, ref.double(), old.double())
    (expected * g.double()).sum().backward()
    assert value.shape == lp.shape and value.dtype == torch.float32
    check_value(f"kl {estimator} {kwargs}", value, expected, KL_ENTRY, "kl_penalty")
    check_grad(f"kl {estimator} {kwargs} grad", x.grad, x64.grad, KL_ENTRY, "kl_penalty")


def test_kl_penalty_clamps_zero_the_gradient():
    lp = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    ref = torch.tensor([25.0, 3.0, 1.0])  # k3: log-ratio clamp, value clamp (16.1 > 10), neither
    rlk.kl_penalty(lp, ref, "k3").sum().backward()
    assert lp.grad[0] == 0 and lp.grad[1] == 0 and lp.grad[2] != 0


def test_k3_log_ratio_clamp_keeps_infinite_log_ratios_finite():
    """verl clamps the log-ratio before exp: an infinite one gives the value clamp 10 and no gradient."""
    lp = torch.tensor([-math.inf, 0.0, 0.0], requires_grad=True)
    ref = torch.tensor([0.0, 50.0, -100.0])
    value = rlk.kl_penalty(lp, ref, "low_var_kl")
    value.sum().backward()
    lp64 = lp.detach().double().requires_grad_(True)
    expected = verl_low_var_kl(lp64, ref.double())
    expected.sum().backward()
    assert torch.equal(value.double(), expected.detach()) and torch.equal(lp.grad.double(), lp64.grad)
    assert torch.equal(value, torch.tensor([10.0, 10.0, 10.0])) and torch.all(lp.grad == 0)


def test_kl_penalty_gradcheck():
    lp, ref, old = (t.double() for t in _kl_inputs(n=16))
    x = lp.clone().requires_grad_(True)
    for estimator in ("k1", "abs", "k2", "k3"):
        assert torch.autograd.gradcheck(lambda v, e=estimator: rlk.kl_penalty(v, ref, e, k3_clamp=False), (x,))


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------

_B = make_batch(b=3, t=4, seed=18)
_ARGS = (_B["lp"], _B["old"], _B["adv"], _B["mask"])


def _pl(*args, **kwargs):
    return rlk.policy_loss(*(args or _ARGS), **kwargs)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: _pl(_B["lp"][0], _B["old"][0], _B["adv"], _B["mask"][0]),
            ValueError,
            r"logprob: expected shape \[B, T\]",
        ),
        (
            lambda: _pl(_B["lp"], _B["old"][:, :3], _B["adv"], _B["mask"]),
            ValueError,
            r"old_logprob: expected shape \(3, 4\), got \(3, 3\)",
        ),
        (
            lambda: _pl(_B["lp"], _B["old"], torch.zeros(4), _B["mask"]),
            ValueError,
            r"advantages: expected shape \(3, 4\) or \(3,\) or \(3, 1\), got \(4,\)",
        ),
        (lambda: _pl(_B["lp"], _B["old"], _B["adv"], _B["mask"][:2]), ValueError, "mask: expected shape"),
        (lambda: _pl(_B["lp"].long(), _B["old"], _B["adv"], _B["mask"]), TypeError, "logprob: expected dtype"),
        (lambda: _pl(importance_weights=torch.ones(3, 5)), ValueError, "importance_weights: expected shape"),
        (lambda: _pl(ref_logprob=torch.ones(2, 4)), ValueError, "ref_logprob: expected shape"),
        (lambda: _pl(entropy=torch.ones(3)), ValueError, "entropy: expected shape"),
        (lambda: _pl(loss="ppo2"), ValueError, "loss: expected one of 'ppo', 'gspo'"),
        (lambda: _pl(agg="mean"), ValueError, "agg: expected one of"),
        (lambda: _pl(kl="k4", ref_logprob=_B["ref"]), ValueError, "kl: expected one of"),
        (lambda: _pl(agg="seq-mean-token-sum-norm"), ValueError, "loss_scale: agg='seq-mean-token-sum-norm' needs"),
        (lambda: _pl(clip_low=-0.1), ValueError, "clip_low: must be a finite number >= 0, got -0.1"),
        (lambda: _pl(clip_high=-0.2), ValueError, "clip_high: must be a finite number >= 0, got -0.2"),
        (lambda: _pl(dual_clip=0.5), ValueError, "dual_clip: must be a finite number > 1, got 0.5"),
        (lambda: _pl(loss="gspo", dual_clip=3.0), ValueError, "dual_clip: only loss='ppo'"),
        (lambda: _pl(clamp_log_ratio=-1.0), ValueError, "clamp_log_ratio: must be a finite number > 0"),
        (lambda: _pl(clamp_log_ratio=(5.0, 1.0)), ValueError, "clamp_log_ratio: expected low < high"),
        (lambda: _pl(loss="cispo", cispo_form="upper"), ValueError, "clip_high: cispo_form='upper'"),
        (lambda: _pl(cispo_form="lower"), ValueError, "cispo_form: expected 'clip' or 'upper'"),
        (lambda: _pl(sapo_tau=(1.0, -1.0)), ValueError, "sapo_tau: must be a finite number > 0"),
        (lambda: _pl(kl_coef=0.1), ValueError, "ref_logprob: required when kl_coef != 0"),
        (lambda: _pl(entropy_coef=0.1), ValueError, "entropy: required when entropy_coef != 0"),
        (lambda: _pl(kl_clamp=0.0, ref_logprob=_B["ref"]), ValueError, "kl_clamp: must be a finite number > 0"),
        (lambda: _pl(global_tokens=-3), ValueError, "global_tokens"),
        (lambda: _pl(clip_low="0.2"), TypeError, "clip_low: expected a number"),
        (lambda: rlk.kl_penalty(_B["lp"], _B["ref"], "k5"), ValueError, "estimator: expected one of"),
        (lambda: rlk.kl_penalty(_B["lp"], _B["ref"][:2], "k3"), ValueError, "ref_logprob: expected shape"),
        (
            lambda: rlk.kl_penalty(_B["lp"], _B["ref"], "k3", clamp=-1.0),
            ValueError,
            "clamp: must be a finite number > 0",
        ),
        (
            lambda: rlk.kl_penalty(_B["lp"], _B["ref"], "k3", old_logprob=_B["old"][0]),
            ValueError,
            "old_logprob: expected shape",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_device_mismatch_is_named():
    with pytest.raises(ValueError, match="old_logprob: expected device cpu"):
        rlk.policy_loss(_B["lp"], _B["old"].to("meta"), _B["adv"], _B["mask"])
    with pytest.raises(ValueError, match="ref_logprob: expected device cpu"):
        rlk.kl_penalty(_B["lp"], _B["ref"].to("meta"), "k3")


# ----------------------------------------------------------------------------------------------
# torch.library integration and batch invariance
# ----------------------------------------------------------------------------------------------


def _fwd_args(batch, loss="ppo", iw=True, ref=True, ent=True, with_entropy_grad=True, global_seqs=None):
    lp = batch["lp"].clone().requires_grad_(True)
    entropy = batch["entropy"].clone().requires_grad_(with_entropy_grad) if ent else None
    return (
        lp,
        batch["old"],
        batch["adv"][:, None],
        batch["mask"],
        batch["iw"] if iw else None,
        batch["ref"] if ref else None,
        entropy,
        ent and with_entropy_grad,
        None,
        global_seqs,
        None,
        "seq-mean-token-mean",
        loss,
        "k3",
        [False, True, False, False],
        [
            0.2,
            0.28,
            3.0 if loss == "ppo" else 0.0,
            -20.0,
            20.0,
            1.0,
            1.05,
            0.1,
            math.inf,
            0.01,
            2.0,
            3.0,
            3.0,
            2.0,
            math.nan,
            math.nan,
            math.nan,
        ],
    )


def test_opcheck_all_custom_ops():
    batch = make_batch(b=3, t=5, seed=19)
    for loss in LOSSES:
        torch.library.opcheck(torch.ops.rlk.policy_loss_fwd.default, _fwd_args(batch, loss))
    torch.library.opcheck(torch.ops.rlk.policy_loss_fwd.default, _fwd_args(batch, iw=False, ref=False, ent=False))
    torch.library.opcheck(torch.ops.rlk.policy_loss_fwd.default, _fwd_args(batch, with_entropy_grad=False))
    torch.library.opcheck(torch.ops.rlk.policy_loss_fwd.default, _fwd_args(batch, global_seqs=torch.tensor(4.0)))
    grad, grad_ent = torch.randn(2, 3, 5)
    torch.library.opcheck(torch.ops.rlk.policy_loss_bwd.default, (torch.tensor(0.5), grad, grad_ent, "reference"))
    torch.library.opcheck(torch.ops.rlk.policy_loss_bwd.default, (torch.tensor(0.5), grad, None, "reference"))
    lp = batch["lp"].reshape(-1).clone().requires_grad_(True)
    ref, old = batch["ref"].reshape(-1), batch["old"].reshape(-1)
    torch.library.opcheck(torch.ops.rlk.kl_penalty_fwd.default, (lp, ref, None, "k3", False, True, math.inf))
    torch.library.opcheck(torch.ops.rlk.kl_penalty_fwd.default, (lp, ref, old, "k2", True, True, 10.0))
    torch.library.opcheck(torch.ops.rlk.kl_penalty_bwd.default, (torch.randn(15), torch.randn(15), "reference"))


@pytest.mark.parametrize("loss", LOSSES)
def test_torch_compile_fullgraph_matches_eager(loss):
    batch = make_batch(b=4, t=7, seed=20)

    def objective(lp, ent):
        value, metrics = rlk.policy_loss(
            lp,
            batch["old"],
            batch["adv"],
            batch["mask"],
            loss=loss,
            agg="seq-mean-token-mean",
            importance_weights=batch["iw"],
            ref_logprob=batch["ref"],
            kl="k3+",
            kl_coef=0.1,
            entropy=ent,
            entropy_coef=0.01,
            global_seqs=torch.tensor(4.0),
        )
        kl = rlk.kl_penalty(lp, batch["ref"], "low_var_kl", old_logprob=batch["old"])
        return value + 0.1 * kl.sum(), metrics

    results = []
    for fn in (objective, torch.compile(objective, fullgraph=True, backend="aot_eager")):
        lp = batch["lp"].clone().requires_grad_(True)
        ent = batch["entropy"].clone().requires_grad_(True)
        value, metrics = fn(lp, ent)
        value.backward()
        results.append((value.detach(), lp.grad, ent.grad, *metrics.values()))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("loss", LOSSES)
def test_batch_invariance_of_the_gradient(loss):
    """token-sum: a row's weight is 1 whatever the batch, so its gradient (= the forward's, times 1) is the same
    bits alone, first, middle or last in batches of 2, 5 and 9 rows (the reference computes per token, and per
    row for the sequence sums of gspo and geo_mean)."""
    probe = make_batch(b=1, t=12, seed=21)
    kwargs = {"loss": loss, "agg": "token-sum", "kl_coef": 0.1, "entropy_coef": 0.01}
    _, _, alone, alone_ent = run_rlk(
        probe, ref_logprob=probe["ref"], entropy=probe["entropy"], with_entropy_grad=True, **kwargs
    )
    for b in (2, 5, 9):
        for pos in sorted({0, b // 2, b - 1}):
            batch = make_batch(b=b, t=12, seed=100 + b)
            for k in batch:
                batch[k][pos] = probe[k][0]
            _, _, grad, grad_ent = run_rlk(
                batch, ref_logprob=batch["ref"], entropy=batch["entropy"], with_entropy_grad=True, **kwargs
            )
            assert torch.equal(grad[pos : pos + 1], alone), (b, pos)
            assert torch.equal(grad_ent[pos : pos + 1], alone_ent), (b, pos)


def test_backward_fills_no_zero_gradients_for_the_auxiliary_outputs():
    """The forward's gradient, weight, statistic and metric outputs are non-differentiable: the backward
    must not zero-fill gradients for them (at [512, 8192] that was five fill kernels, 16 MiB for the
    gradient alone)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 8, generator=gen, requires_grad=True)
    old, adv = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen)
    mask = torch.rand(3, 8, generator=gen) < 0.8
    for fn in (lambda: rlk.policy_loss(lp, old, adv, mask)[0], lambda: rlk.kl_penalty(lp, old, "k3").sum()):
        out = fn()
        with RecordOps() as recorded:
            (grad,) = torch.autograd.grad(out, lp)
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0
        fills = [op for op in recorded.ops if "zero" in op or "fill" in op]
        assert not fills, fills


# ----------------------------------------------------------------------------------------------
# policy_loss_and_grad: the same loss and gradient without autograd
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# PolicyLossConfig: the options of a call, one frozen object
# ----------------------------------------------------------------------------------------------


def _call(batch, **kwargs):
    return rlk.policy_loss(
        batch["lp"],
        batch["old"],
        batch["adv"],
        batch["mask"],
        ref_logprob=batch["ref"],
        entropy=batch["entropy"],
        **kwargs,
    )


def test_a_config_gives_the_results_of_its_keywords_and_keywords_override_its_fields():
    batch = make_batch(seed=41)
    options = dict(
        loss="ppo",
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
        clamp_log_ratio=20.0,
        agg="seq-mean-token-mean",
        kl="low_var_kl",
        kl_coef=0.05,
        entropy_coef=0.01,
    )
    want, want_metrics = _call(batch, **options)
    config = rlk.PolicyLossConfig(**options)
    got, got_metrics = _call(batch, config=config)
    assert torch.equal(got, want)
    assert all(torch.equal(got_metrics[k], want_metrics[k]) for k in want_metrics)
    # a keyword replaces the config's field; the config itself is unchanged (frozen)
    overridden, _ = _call(batch, config=config, clip_high=0.4)
    assert torch.equal(overridden, _call(batch, **{**options, "clip_high": 0.4})[0])
    assert not torch.equal(overridden, want)
    assert config.clip_high == 0.28
    with pytest.raises(AttributeError):
        config.clip_high = 0.4


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"loss": "ppo2"}, ValueError, "loss: expected one of"),
        ({"clip_low": -0.1}, ValueError, "clip_low"),
        ({"agg": "mean"}, ValueError, "agg: expected one of"),
        ({"kl": "k9"}, ValueError, "kl: expected one of"),
        ({"sapo_tau": (1.0,)}, ValueError, "sapo_tau: expected a pair"),
        ({"loss": "gspo", "dual_clip": 3.0}, ValueError, "dual_clip: only loss='ppo'"),
    ],
)
def test_a_config_is_checked_when_it_is_made(kwargs, error, message):
    with pytest.raises(error, match=message):
        rlk.PolicyLossConfig(**kwargs)


def test_an_unknown_option_or_a_config_of_another_type_is_refused_by_name():
    batch = make_batch(seed=42)
    with pytest.raises(TypeError, match="clip_lo: not an argument of the policy loss"):
        _call(batch, clip_lo=0.2)
    with pytest.raises(TypeError, match="attrs: not an argument of the policy loss"):  # derived, not an option
        _call(batch, attrs=None)
    with pytest.raises(TypeError, match="config: expected an rlk.PolicyLossConfig, got dict"):
        _call(batch, config={"loss": "ppo"})


def test_policy_loss_and_grad_takes_exactly_the_arguments_of_policy_loss():
    import inspect

    assert inspect.signature(rlk.policy_loss).parameters == inspect.signature(rlk.policy_loss_and_grad).parameters


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("loss", LOSSES)
def test_policy_loss_and_grad_is_policy_loss_with_its_backward(loss, agg):
    """Loss, metrics and gradients (log-prob and entropy) bit for bit equal to policy_loss + backward(), with the
    KL and entropy terms and importance weights; nothing recorded for autograd."""
    batch = make_batch(b=5, t=11, seed=30, per_seq_adv=False)
    kwargs = {
        "loss": loss,
        "agg": agg,
        "importance_weights": batch["iw"],
        "ref_logprob": batch["ref"],
        "kl_coef": 0.1,
        "entropy_coef": 0.01,
        "loss_scale": 11.0 if agg == "seq-mean-token-sum-norm" else None,
        "dual_clip": 3.0 if loss == "ppo" else None,
        "clamp_log_ratio": 20.0,
    }
    value, metrics, grad, grad_ent = run_rlk(batch, with_entropy_grad=True, **kwargs)
    lp = batch["lp"].clone().requires_grad_(True)
    ent = batch["entropy"].clone().requires_grad_(True)
    out = rlk.policy_loss_and_grad(lp, batch["old"], batch["adv"], batch["mask"], entropy=ent, **kwargs)
    assert torch.equal(out.loss, value) and not out.loss.requires_grad
    assert torch.equal(out.grad_logprob, grad) and torch.equal(out.grad_entropy, grad_ent)
    assert out.metrics.keys() == metrics.keys()
    assert all(torch.equal(out.metrics[k], metrics[k]) for k in metrics)
    assert lp.grad is None and ent.grad is None


def test_policy_loss_and_grad_feeds_backward_of_the_logprobs():
    """The documented use: logprob from a differentiable computation, then logprob.backward(grad_logprob); bf16
    log-probs get a bf16 gradient, as autograd gives them; no entropy gradient without entropy_coef."""
    batch = make_batch(b=4, t=9, seed=31)
    base = batch["lp"].to(torch.bfloat16)
    results = []
    for fused in (False, True):
        leaf = base.clone().requires_grad_(True)
        logprob = leaf * 1.0
        kwargs = {"loss": "cispo", "agg": "seq-mean-token-sum", "entropy": batch["entropy"]}
        if fused:
            out = rlk.policy_loss_and_grad(logprob, batch["old"], batch["adv"], batch["mask"], **kwargs)
            assert out.grad_logprob.dtype == torch.bfloat16 and out.grad_entropy is None
            logprob.backward(out.grad_logprob)
            value = out.loss
        else:
            value, _ = rlk.policy_loss(logprob, batch["old"], batch["adv"], batch["mask"], **kwargs)
            value.backward()
        results.append((value.detach(), leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_policy_loss_and_grad_edge_cases():
    for shape in ((0, 5), (3, 0)):
        lp, ent = torch.zeros(shape), torch.zeros(shape)
        out = rlk.policy_loss_and_grad(
            lp, lp, torch.zeros(shape[0]), torch.zeros(shape, dtype=torch.bool), entropy=ent, entropy_coef=0.1
        )
        assert float(out.loss) == 0.0 and out.grad_logprob.shape == shape and out.grad_entropy.shape == shape
    batch = make_batch(b=3, t=4, seed=32)
    batch["mask"][:] = False
    out = rlk.policy_loss_and_grad(batch["lp"], batch["old"], batch["adv"], batch["mask"])
    assert float(out.loss) == 0.0 and torch.all(out.grad_logprob == 0)
    with pytest.raises(ValueError, match="dual_clip: must be a finite number > 1"):
        rlk.policy_loss_and_grad(batch["lp"], batch["old"], batch["adv"], batch["mask"], dual_clip=0.5)
    with pytest.raises(TypeError):
        rlk.policy_loss_and_grad(batch["lp"], batch["old"], batch["adv"], batch["mask"], clip=0.2)


# ----------------------------------------------------------------------------------------------
# DPPO-Binary (dppo_tv, dppo_kl), re-derived from verl's formulas
# ----------------------------------------------------------------------------------------------


def verl_dppo(lp, old, adv, variant, eps_low, eps_high, cap):
    """verl's DPPO-Binary token losses and clip fractions: a detached trust-region mask times the truncated
    detached ratio times ``-A lp``."""
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    truncated = torch.clamp(ratio, max=cap).detach()
    p, q = torch.exp(lp), torch.exp(old)
    if variant == "dppo_tv":
        valid = torch.where(adv > 0, (p - q) <= eps_high, (p - q) >= -eps_low)
    else:
        b = q * (old - lp) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
        valid = torch.where(adv > 0, (b <= eps_high) | (p <= q), (b <= eps_low) | (p >= q))
    valid = valid.detach().to(lp.dtype)
    return -adv * truncated * lp * valid, {"clipfrac": 1.0 - valid, "lower": (ratio > cap).to(lp.dtype) * valid}


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("variant, eps", [("dppo_tv", (0.05, 0.08)), ("dppo_kl", (0.01, 0.02))])
def test_dppo_matches_verls_formulas(variant, eps, agg):
    batch = make_batch(seed=4, ragged=True, extreme=True)
    truth = f64(batch)
    losses, parts = verl_dppo(truth["lp"], truth["old"], adv_bt(truth), variant, *eps, 2.0)
    expected = verl_agg(losses, truth["mask"], agg)
    expected.backward()
    loss, metrics, grad, _ = run_rlk(
        batch,
        loss=variant,
        clip_low=eps[0],
        clip_high=eps[1],
        dual_clip=2.0,
        clamp_log_ratio=20.0,
        **verl_agg_kwargs(agg, batch["lp"].shape[1]),
    )
    check_value(f"{variant} {agg} loss", loss, expected)
    check_grad(f"{variant} {agg} grad", grad, truth["lp"].grad)
    m = truth["mask"].double()
    for name, key in (("clip_fraction", "clipfrac"), ("lower_clip_fraction", "lower")):
        want = verl_masked_mean(parts[key], m)
        check_value(f"{variant} {name}", metrics[name], want)
        assert 0 < float(want) < 1, name  # both branches occur on these inputs


def test_dppo_without_cap_and_its_checks():
    batch = make_batch(seed=6)
    truth = f64(batch)
    losses, _ = verl_dppo(truth["lp"], truth["old"], adv_bt(truth), "dppo_tv", 0.1, 0.1, math.inf)
    expected = verl_agg(losses, truth["mask"], "token-mean")
    expected.backward()
    loss, metrics, grad, _ = run_rlk(batch, loss="dppo_tv", clip_low=0.1, clip_high=0.1)
    check_value("loss", loss, expected)
    check_grad("grad", grad, truth["lp"].grad)
    assert float(metrics["lower_clip_fraction"]) == 0.0
    with pytest.raises(ValueError, match="dual_clip"):
        rlk.policy_loss(batch["lp"], batch["old"], batch["adv"], batch["mask"], loss="gpg", dual_clip=2.0)


# vespo (TRL's loss_type="vespo"), re-derived from the VESPO paper's weight phi(w) = w^k e^(lam (1 - w)) of
# the sequence ratio w = prod_t r_t I_t, with TRL's clamps (each log-ratio to +-20, each log I and log w to
# [ln 1e-8, 20]); phi is a constant of the gradient
# ----------------------------------------------------------------------------------------------


def vespo_token_losses(lp, old, adv, m, iw=None, k=(2.0, 3.0), lam=(3.0, 2.0)):
    """Per-token ``-sg(phi) A lp`` and the sequence ratio ``w`` (``[B, 1]``), in the dtype of ``lp``."""
    m = m.to(lp.dtype)
    log_w = (torch.clamp(lp - old, -20.0, 20.0) * m).sum(-1, keepdim=True)
    if iw is not None:
        log_w = log_w + (torch.clamp(torch.log(iw), math.log(1e-8), 20.0) * m).sum(-1, keepdim=True)
    w = torch.exp(torch.clamp(log_w, math.log(1e-8), 20.0)).detach()
    k_t = torch.where(adv >= 0, k[0], k[1]).to(lp.dtype)
    lam_t = torch.where(adv >= 0, lam[0], lam[1]).to(lp.dtype)
    phi = w**k_t * torch.exp(lam_t * (1.0 - w))
    return -phi * adv * lp, w


def vespo_batch(seed: int, per_seq_adv: bool = True) -> dict:
    """make_batch with log-ratios of about 0.03 (sequence ratios near 1, phi well away from 0) and one row far
    off-policy."""
    batch = make_batch(seed=seed, per_seq_adv=per_seq_adv)
    g = torch.Generator().manual_seed(seed + 1)
    batch["old"] = batch["lp"] + 0.03 * torch.randn(batch["lp"].shape, generator=g)
    batch["old"][4] = batch["lp"][4] + 0.8
    batch["iw"] = 1.0 + 0.05 * torch.randn(batch["lp"].shape, generator=g)
    return batch


@pytest.mark.parametrize("iw", [False, True], ids=["no_iw", "iw"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "token-sum"])
@pytest.mark.parametrize("per_seq_adv", [True, False], ids=["seq_adv", "token_adv"])
def test_vespo_matches_the_paper_formula(agg, iw, per_seq_adv):
    """rlk fp32 against the re-derivation in fp64 with autograd: loss, gradient (phi detached) and the ratio
    metrics (of w); the importance weights in the sequence ratio, not a factor of the loss."""
    batch = vespo_batch(seed=40, per_seq_adv=per_seq_adv)
    kwargs = {
        "loss": "vespo",
        "agg": agg,
        "clamp_log_ratio": 20.0,
        "importance_weights": batch["iw"] if iw else None,
        "global_tokens": 50.0 if agg == "token-mean" else None,
    }
    value, metrics, grad, _ = run_rlk(batch, **kwargs)
    t = f64(batch)
    m = t["mask"]
    losses, w = vespo_token_losses(t["lp"], t["old"], adv_bt(t), m, t["iw"] if iw else None)
    want = verl_agg(losses, m, agg) if agg != "token-mean" else (losses * m).sum() / 50.0
    want.backward()
    check_value(f"vespo {agg} loss", value, want)
    check_grad(f"vespo {agg} grad", grad, t["lp"].grad)
    w_tok = w.expand_as(t["lp"])
    check_value("vespo ratio_mean", metrics["ratio_mean"], w_tok[m].mean())
    check_value("vespo ratio_max", metrics["ratio_max"], w_tok[m].max())
    assert float(metrics["clip_fraction"]) == 0.0
    live = (grad != 0) & batch["mask"]
    assert int(live.sum()) > int(batch["mask"].sum()) // 2  # phi is not trivially 0 here


def test_vespo_on_policy_is_gpg():
    """On-policy (w = 1) phi = e^(lam - lam) = 1 exactly: the loss and gradient of gpg, bit for bit."""
    batch = make_batch(seed=41)
    for agg in AGGS:
        scale = 13 if agg == "seq-mean-token-sum-norm" else None
        vespo = run_rlk(
            batch, loss="vespo", old=None, agg=agg, loss_scale=scale, vespo_k=(1.5, 4.0), vespo_lambda=(0.7, 5.0)
        )
        gpg = run_rlk(batch, loss="gpg", old=None, agg=agg, loss_scale=scale)
        assert torch.equal(vespo[0], gpg[0]) and torch.equal(vespo[2], gpg[2]), agg


def test_vespo_shape_parameters_follow_the_sign_of_the_advantage():
    """(k, lam) = vespo_k[0], vespo_lambda[0] where A >= 0 (A = 0 included), [1] where A < 0: changing the other
    side's parameters changes nothing."""
    batch = vespo_batch(seed=42)
    batch["adv"] = batch["adv"].abs()
    batch["adv"][1] = 0.0
    base = run_rlk(batch, loss="vespo")
    other = run_rlk(batch, loss="vespo", vespo_k=(2.0, 7.0), vespo_lambda=(3.0, 0.1))
    assert torch.equal(base[0], other[0]) and torch.equal(base[2], other[2])
    changed = run_rlk(batch, loss="vespo", vespo_k=(2.5, 3.0))
    assert not torch.equal(base[2], changed[2])


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"vespo_k": 2.0}, ValueError, r"vespo_k: expected a pair \(for A >= 0, for A < 0\)"),
        ({"vespo_lambda": (3.0, 2.0, 1.0)}, ValueError, "vespo_lambda: expected a pair"),
        ({"vespo_lambda": (3.0, 0.0)}, ValueError, "vespo_lambda: must be a finite number > 0, got 0.0"),
        ({"vespo_k": (math.inf, 3.0)}, ValueError, "vespo_k: must be a finite number"),
        ({"vespo_k": (1e39, 3.0)}, ValueError, "vespo_k: 1e[+]?39 overflows torch.float32"),
        ({"vespo_k": ("2", 3.0)}, TypeError, "vespo_k: expected a number"),
    ],
)
def test_vespo_bad_parameters_get_a_clear_error(kwargs, error, message):
    with pytest.raises(error, match=message):
        _pl(loss="vespo", **kwargs)
