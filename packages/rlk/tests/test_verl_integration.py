"""``rlk.integrations.verl`` against the real verl 0.9.1 (``ci/install_verl_env.sh`` sets up its environment).

Every drop-in runs beside verl's own function of the same name on the same values: the policy losses (loss, the
gradient w.r.t. ``log_prob`` by autograd on both sides, every metric of the same name) in every ``loss_agg_mode``,
with and without the global batch info verl's ``ppo_loss`` fills in and the rollout importance weights;
``agg_loss``; ``kl_penalty`` for every verl type; every advantage estimator rlk serves; the fused log-prob + entropy
against verl's unfused path and its torch fused module. float64 inputs on both sides agree to rounding (``_TIGHT``);
rlk in float32 meets the numerical contract against verl run in float64 on the same values (metrics that are
fractions against verl in float32: the same clip decisions). The module is marked ``verl``: the root conftest
deselects it where verl cannot be imported, and ``RLK_REQUIRE_VERL=1`` makes that an error.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rlk
import rlk.integrations.verl as rv
from rlk.core import contract
from rlk.reference import advantages as ref_adv

try:
    from verl.trainer.config import AlgoConfig, RolloutCorrectionConfig
    from verl.trainer.ppo import core_algos
    from verl.utils import torch_functional as verl_F
    from verl.utils.experimental.torch_functional import FusedLinearForPPO as VerlFusedLinearForPPO
    from verl.workers.config import ActorConfig, PolicyLossConfig
except ImportError:  # deselected by the root conftest (an error with RLK_REQUIRE_VERL=1)
    core_algos = None

pytestmark = pytest.mark.verl

#: float64 against float64: the same sums in another order.
_TIGHT = {"rtol": 1e-10, "atol": 1e-12}
#: float64 against verl's float64 forms that round a constant to float32 (GRPO's singleton denominator
#: ``torch.tensor(1.0) + epsilon``) or add 1e-8 guards (its masked mean and variance, under the whitening).
_NEAR = {"rtol": 3e-7, "atol": 3e-7}
#: a fraction of at most a hundred tokens, float32 against float32 (the same decisions).
_FRACTION = {"rtol": 1e-6, "atol": 1e-7}
AGGS = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
POLICY_ENTRY = contract.entry("policy_loss", torch.float32) if core_algos is not None else None

#: verl's original functions, taken before any register(override=True) of this module can swap them.
VERL = {name: getattr(core_algos, name) for name in dir(core_algos)} if core_algos is not None else {}


@pytest.fixture(autouse=True)
def _restore_verl():
    yield
    rv.unregister()


def _metric_tolerance(name):
    """verl's fractions are float32 (``.float()`` of a comparison) even on float64 inputs; the rest float64."""
    return (
        {"rel": 1e-9, "abs": 1e-12} if name.endswith("ppo_kl") else {"rel": _FRACTION["rtol"], "abs": _FRACTION["atol"]}
    )


def check_value(name, got, truth, entry):
    truth = torch.as_tensor(truth).detach().double().reshape(-1)
    dev = contract.compare_outputs(entry, name, torch.as_tensor(got).detach().reshape(-1), truth, 1.0 + truth.abs())
    assert dev.ok, dev


def check_scaled(name, got, truth, scale, entry):
    dev = contract.compare_outputs(
        entry, name, got.detach().reshape(-1), truth.detach().double().reshape(-1), scale.double().reshape(-1)
    )
    assert dev.ok, dev


def check_grad(name, got, truth, entry):
    dev = contract.compare_grad(entry, name, got, truth, 1.0)
    assert dev.ok, dev


# ----------------------------------------------------------------------------------------------
# inputs and configs
# ----------------------------------------------------------------------------------------------


def make_batch(b=6, t=11, seed=0, empty_row=False):
    """fp32 ``[B, T]`` policy-loss inputs: right-padded rows (row 0 full), log-ratios spread around 0 with some far
    outside the clip ranges, mixed-sign per-sequence advantages, rollout weights in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 3 - 0.05
    old = lp + 0.3 * torch.randn(b, t, generator=g)
    old[:, ::4] = lp[:, ::4] - 1.2
    old[:, 1::5] = lp[:, 1::5] + 1.2
    adv = torch.randn(b, generator=g)[:, None].expand(b, t).clone()
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    if empty_row:
        lengths[-1] = 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    iw = torch.rand(b, t, generator=g) + 0.5
    return {"lp": lp, "old": old, "adv": adv, "mask": mask, "iw": iw}


def actor_config(global_info=None, **kwargs):
    kwargs.setdefault("clip_ratio", 0.2)
    kwargs.setdefault("clip_ratio_low", 0.15)
    kwargs.setdefault("clip_ratio_high", 0.28)
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **kwargs)
    config.global_batch_info.update(global_info or {})
    return config


def global_info(batch, agg):
    """What verl's ``ppo_loss`` passes for a micro-batch that is a third of a step on each of 2 ranks."""
    n_tok = int(batch["mask"].sum()) * 3 * 2
    n_seq = int((batch["mask"].sum(-1) > 0).sum()) * 3 * 2
    return {
        "dp_size": 2,
        "batch_num_tokens": n_tok,
        "global_batch_size": n_seq,
        "loss_scale_factor": 16 if agg == "seq-mean-token-sum-norm" else None,
    }


#: verl loss mode -> extra config of the case (dppo: its divergence thresholds are clip_ratio_*).
LOSS_CONFIGS = {
    "vanilla": {},
    "gspo": {"clip_ratio_low": 3e-2, "clip_ratio_high": 4e-2},
    "sapo": {},
    "gpg": {},
    "geo_mean": {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4},
    "cispo": {},
    "dppo_tv": {"clip_ratio_low": 0.05, "clip_ratio_high": 0.08, "clip_ratio_c": 2.0},
    "dppo_kl": {"clip_ratio_low": 0.01, "clip_ratio_high": 0.02, "clip_ratio_c": 2.0},
    "dro": {"policy_loss": None},  # filled in by the test (PolicyLossConfig needs verl)
}


def loss_config(mode, info):
    extra = dict(LOSS_CONFIGS[mode])
    if mode == "dro":
        extra["policy_loss"] = PolicyLossConfig(loss_mode="dro", dro_beta=0.7)
    return actor_config(info, **extra)


def run_loss(fn, batch, dtype, agg, config, iw):
    """``fn``'s (loss, grad w.r.t. log_prob, metrics) on ``batch`` in ``dtype``."""
    lp = batch["lp"].to(dtype).clone().requires_grad_(True)
    loss, metrics = fn(
        batch["old"].to(dtype),
        lp,
        batch["adv"].to(dtype),
        batch["mask"],
        agg,
        config,
        batch["iw"].to(dtype) if iw else None,
    )
    loss.backward()
    return loss.detach(), lp.grad, metrics


# ----------------------------------------------------------------------------------------------
# policy losses
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(LOSS_CONFIGS))
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("setting", ["local", "global", "global+iw", "local+iw+empty"])
def test_policy_loss_matches_verl(mode, agg, setting):
    iw = "iw" in setting
    batch = make_batch(seed=len(mode) + AGGS.index(agg), empty_row="empty" in setting)
    info = global_info(batch, agg) if "global" in setting else {}
    if mode in ("dro",) and iw:  # verl weights DRO's penalty too: rlk runs verl's own function (tested below)
        iw = False
    ours, theirs = rv.POLICY_LOSSES[mode], VERL[core_algos.POLICY_LOSS_REGISTRY[mode].__name__]
    # float64 on both sides: the same formulas
    loss64, grad64, metrics64 = run_loss(theirs, batch, torch.float64, agg, loss_config(mode, info), iw)
    got64, ggrad64, gmetrics64 = run_loss(ours, batch, torch.float64, agg, loss_config(mode, info), iw)
    torch.testing.assert_close(got64, loss64, **_TIGHT)
    torch.testing.assert_close(ggrad64, grad64, **_TIGHT)
    assert set(gmetrics64) == set(metrics64)
    for name in metrics64:
        assert isinstance(gmetrics64[name], float), name
        assert gmetrics64[name] == pytest.approx(metrics64[name], **_metric_tolerance(name)), name
    # float32 rlk against float64 verl: the contract; fractions against verl in float32
    got, ggrad, gmetrics = run_loss(ours, batch, torch.float32, agg, loss_config(mode, info), iw)
    check_value("loss", got, loss64, POLICY_ENTRY)
    check_grad("grad_logprob", ggrad, grad64, POLICY_ENTRY)
    _, _, metrics32 = run_loss(theirs, batch, torch.float32, agg, loss_config(mode, info), iw)
    for name in metrics32:
        if name == "actor/ppo_kl":
            check_value(name, gmetrics[name], metrics64[name], POLICY_ENTRY)
        else:
            assert gmetrics[name] == pytest.approx(metrics32[name], rel=_FRACTION["rtol"], abs=_FRACTION["atol"])
    assert loss64 != 0 and bool(grad64.abs().sum() > 0)


def test_policy_loss_cases_exercise_the_branches():
    """The inputs above clip, dual-clip, truncate and invalidate tokens (else the comparisons prove little)."""
    batch = make_batch(seed=3)
    metrics = {}
    for mode in ("vanilla", "dppo_tv", "dppo_kl", "cispo", "geo_mean", "gspo"):
        _, _, metrics[mode] = run_loss(
            VERL[core_algos.POLICY_LOSS_REGISTRY[mode].__name__],
            batch,
            torch.float64,
            "token-mean",
            loss_config(mode, {}),
            False,
        )
    assert metrics["vanilla"]["actor/pg_clipfrac"] > 0.1 and metrics["vanilla"]["actor/pg_clipfrac_lower"] > 0
    for mode in ("dppo_tv", "dppo_kl"):
        assert 0.05 < metrics[mode]["actor/pg_clipfrac"] < 0.95, mode
        assert metrics[mode]["actor/pg_clipfrac_lower"] > 0, mode
    assert metrics["cispo"]["actor/pg_clipfrac"] > 0.1
    assert metrics["geo_mean"]["actor/pg_clipfrac"] > 0 and metrics["geo_mean"]["actor/pg_clipfrac_lower"] > 0
    assert metrics["gspo"]["actor/pg_clipfrac"] > 0


def test_dro_with_rollout_weights_runs_verls_function():
    batch = make_batch(seed=5)
    config = loss_config("dro", {})
    want = run_loss(VERL["compute_policy_loss_dro"], batch, torch.float64, "token-mean", config, True)
    got = run_loss(rv.compute_policy_loss_dro, batch, torch.float64, "token-mean", config, True)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_bypass_mode_matches_verl(loss_type, agg):
    batch = make_batch(seed=11)
    rc = RolloutCorrectionConfig(
        rollout_is="token",
        rollout_is_threshold=1.5,
        rollout_rs="token_k1",
        rollout_rs_threshold="0.4_2.5",
        loss_type=loss_type,
    )

    def config():
        return actor_config(policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rc))

    loss64, grad64, metrics64 = run_loss(
        VERL["compute_policy_loss_bypass_mode"], batch, torch.float64, agg, config(), False
    )
    got64, ggrad64, gmetrics64 = run_loss(
        rv.compute_policy_loss_bypass_mode, batch, torch.float64, agg, config(), False
    )
    torch.testing.assert_close(got64, loss64, **_TIGHT)
    torch.testing.assert_close(ggrad64, grad64, **_TIGHT)
    assert set(gmetrics64) == set(metrics64)
    for name in metrics64:
        assert gmetrics64[name] == pytest.approx(metrics64[name], **_metric_tolerance(name)), name
    got, ggrad, _ = run_loss(rv.compute_policy_loss_bypass_mode, batch, torch.float32, agg, config(), False)
    check_value("loss", got, loss64, POLICY_ENTRY)
    check_grad("grad_logprob", ggrad, grad64, POLICY_ENTRY)
    assert metrics64["rollout_corr/rollout_rs_masked_fraction"] > 0  # the rejection mask removed tokens


def test_vanilla_needs_clip_ratio_c_above_one():
    batch = make_batch()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        run_loss(
            rv.compute_policy_loss_vanilla, batch, torch.float32, "token-mean", actor_config(clip_ratio_c=1.0), False
        )
    with pytest.raises(ValueError, match="batch_num_tokens is required"):
        run_loss(
            rv.compute_policy_loss_vanilla, batch, torch.float32, "token-mean", actor_config({"dp_size": 2}), False
        )


# ----------------------------------------------------------------------------------------------
# agg_loss, kl_penalty
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(
    "normalizers", [{}, {"dp_size": 4, "batch_num_tokens": 123, "global_batch_size": 17, "loss_scale_factor": 32}]
)
def test_agg_loss_matches_verl(agg, normalizers):
    g = torch.Generator().manual_seed(AGGS.index(agg))
    x = torch.randn(5, 9, generator=g) * 3
    mask = torch.rand(5, 9, generator=g) > 0.3
    mask[2] = False
    x[~mask] = 1e4  # masked out: never counts
    out = {}
    for name, fn, dtype in (
        ("verl", VERL["agg_loss"], torch.float64),
        ("rlk64", rv.agg_loss, torch.float64),
        ("rlk", rv.agg_loss, torch.float32),
    ):
        leaf = x.to(dtype).clone().requires_grad_(True)
        loss = fn(leaf, mask, agg, **normalizers)
        (loss * 1.0).backward()
        out[name] = (loss.detach(), torch.where(mask, leaf.grad, 0.0))
    torch.testing.assert_close(out["rlk64"][0], out["verl"][0], **_TIGHT)
    torch.testing.assert_close(out["rlk64"][1], out["verl"][1], **_TIGHT)
    check_value("loss", out["rlk"][0], out["verl"][0], POLICY_ENTRY)
    check_grad("grad", out["rlk"][1], out["verl"][1], POLICY_ENTRY)
    x[~mask] = float("nan")  # rlk never reads masked-out entries, whatever they hold
    torch.testing.assert_close(rv.agg_loss(x, mask, agg, **normalizers), out["rlk"][0], rtol=0, atol=0)


KL_TYPES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "abs+", "k2+", "k3+", "low_var_kl+"]


@pytest.mark.parametrize("kind", KL_TYPES)
def test_kl_penalty_matches_verl(kind):
    g = torch.Generator().manual_seed(KL_TYPES.index(kind))
    lp = -torch.rand(64, generator=g) * 5
    ref = lp + torch.randn(64, generator=g) * 2
    ref[:4] = lp[:4] + torch.tensor([25.0, -25.0, 12.0, -12.0])  # past verl's k3 clamps
    upstream = torch.randn(64, generator=g)
    entry = contract.entry("kl_penalty", torch.float32)
    out = {}
    for name, fn, dtype in (
        ("verl", VERL["kl_penalty"], torch.float64),
        ("rlk64", rv.kl_penalty, torch.float64),
        ("rlk", rv.kl_penalty, torch.float32),
    ):
        leaf = lp.to(dtype).clone().requires_grad_(True)
        kl = fn(leaf, ref.to(dtype), kind)
        (kl * upstream.to(dtype)).sum().backward()
        out[name] = (kl.detach(), leaf.grad)
    torch.testing.assert_close(out["rlk64"][0], out["verl"][0], **_TIGHT)
    torch.testing.assert_close(out["rlk64"][1], out["verl"][1], **_TIGHT)
    check_value("kl", out["rlk"][0], out["verl"][0], entry)
    check_grad("grad", out["rlk"][1], out["verl"][1], entry)
    with pytest.raises(NotImplementedError):
        rv.kl_penalty(lp, ref, "full")


# ----------------------------------------------------------------------------------------------
# advantage estimators
# ----------------------------------------------------------------------------------------------


def outcome_batch(seed=0, singleton=True, b=10, t=7):
    """Token rewards ``[B, T]`` (the outcome at the last response token, plus small token rewards on some rows),
    a right-padded mask with an interior hole (multi-turn), uid groups of sizes 4, 3, 2 and (``singleton``) 1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    mask[1, 1] = 0
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), lengths - 1] = torch.randint(0, 3, (b,), generator=g).float() + torch.rand(b, generator=g)
    rewards[3] += 0.1 * torch.randn(t, generator=g) * mask[3]
    sizes = [4, 3, 2, 1] if singleton else [4, 3, 3]
    labels = np.array([f"uid-{k}" for k, size in enumerate(sizes) for _ in range(size)], dtype=object)
    perm = torch.randperm(b, generator=g).numpy()
    return {
        "rewards": rewards,
        "mask": mask,
        "index": labels[perm],
        "values": torch.randn(b, t, generator=g),
        "baselines": torch.rand(b, generator=g) * 2,
        "group": torch.as_tensor(np.unique(labels[perm], return_inverse=True)[1]),
    }


def _f64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


GROUP_ENTRY = contract.entry("group_advantages", torch.float32) if core_algos is not None else None
WHITEN_ENTRY = contract.entry("masked_whiten", torch.float32) if core_algos is not None else None
RETURNS_ENTRY = contract.entry("discounted_returns", torch.float32) if core_algos is not None else None
GAE_ENTRY = contract.entry("gae", torch.float32) if core_algos is not None else None


def _group_scale(per_token, batch):
    """The group_advantages contract scale (``1 + max |adv|`` over the group) of per-row values, per token."""
    per_row = per_token.double().abs().amax(dim=-1)
    return ref_adv.group_contract_scale(per_row, batch["group"], 0)[:, None].expand_as(per_token)


def _whiten_scale(x64, mask, truth):
    return ref_adv.whiten_contract_scale(x64.reshape(-1), mask.reshape(-1).bool(), True, 1e-8, "add", truth.reshape(-1))


#: (verl estimator, its keyword arguments) of the plain group estimators.
GROUP_CASES = [
    ("grpo", {"norm_adv_by_std_in_grpo": True}),
    ("grpo", {"norm_adv_by_std_in_grpo": False}),
    ("grpo_vectorized", {"norm_adv_by_std_in_grpo": True}),
    ("grpo_vectorized", {"norm_adv_by_std_in_grpo": False}),
    ("rloo", {}),
    ("rloo_vectorized", {}),
    ("opo", {}),
    ("gpg", {}),
    ("gpg", {"f_norm": 2.5}),
]


@pytest.mark.parametrize(("name", "kwargs"), GROUP_CASES, ids=[f"{n}-{k}" for n, k in GROUP_CASES])
def test_group_estimators_match_verl(name, kwargs):
    batch = outcome_batch(seed=len(name))
    theirs = VERL[core_algos.ADV_ESTIMATOR_REGISTRY[name].__name__]
    if name == "grpo_vectorized":  # verl computes it in float32 whatever the input: the loop form is the truth
        theirs = VERL["compute_grpo_outcome_advantage"]
    ours = rv.ADVANTAGE_ESTIMATORS[name]
    want, want_ret = theirs(_f64(batch["rewards"]), batch["mask"], batch["index"], **kwargs)
    got64, got64_ret = ours(_f64(batch["rewards"]), batch["mask"], batch["index"], **kwargs)
    got, got_ret = ours(batch["rewards"], batch["mask"], batch["index"], **kwargs)
    near = _NEAR if name.startswith("grpo") else _TIGHT
    torch.testing.assert_close(got64, want, **near)
    torch.testing.assert_close(got64_ret, want_ret, **near)
    check_scaled("advantages", got, want, _group_scale(want, batch), GROUP_ENTRY)
    assert got.dtype == torch.float32 and bool(want.abs().sum() > 0)


def test_grpo_vectorized_agrees_with_verls_vectorized_form():
    batch = outcome_batch(seed=2)
    want, _ = VERL["compute_grpo_vectorized_outcome_advantage"](batch["rewards"], batch["mask"], batch["index"])
    got, _ = rv.compute_grpo_vectorized_outcome_advantage(batch["rewards"], batch["mask"], batch["index"])
    check_scaled("advantages", got, want, _group_scale(want, batch), GROUP_ENTRY)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_matches_verl(norm):
    batch = outcome_batch(seed=4, singleton=False)
    batch["rewards"][batch["group"] == 1] = 0.0  # a group of ties: 0 for everyone
    config = AlgoConfig(norm_adv_by_std_in_grpo=norm)
    theirs, ours = VERL["compute_grpo_passk_outcome_advantage"], rv.compute_grpo_passk_outcome_advantage
    want, _ = theirs(_f64(batch["rewards"]), batch["mask"], batch["index"], config=config)
    got64, _ = ours(_f64(batch["rewards"]), batch["mask"], batch["index"], config=config)
    got, _ = ours(batch["rewards"], batch["mask"], batch["index"], config=config)
    torch.testing.assert_close(got64, want, **_TIGHT)
    check_scaled("advantages", got, want, _group_scale(want, batch), GROUP_ENTRY)
    assert int((want.abs().sum(-1) > 0).sum()) == 2  # one winner in each group without ties
    with pytest.raises(ValueError, match="at least 2 samples"):
        ours(batch["rewards"], batch["mask"], np.arange(batch["rewards"].shape[0]), config=config)


def test_whitened_estimators_match_verl():
    """GAE, REINFORCE++, REINFORCE++-baseline and GDPO (each whitened over the mask)."""
    batch = outcome_batch(seed=7)
    r64, m = _f64(batch["rewards"]), batch["mask"]
    on = m.bool()
    algo = AlgoConfig(gamma=0.95)
    cases = []
    # gae (verl leaves the whitening formula's values off the mask: compare on it)
    want, want_ret = VERL["compute_gae_advantage_return"](r64, _f64(batch["values"]), m, 0.95, 0.9)
    got = rv.compute_gae_advantage_return(batch["rewards"], batch["values"], m, 0.95, 0.9)
    got64 = rv.compute_gae_advantage_return(r64, _f64(batch["values"]), m, 0.95, 0.9)
    cases.append(("gae", want, want_ret, got, got64, want_ret - _f64(batch["values"]), GAE_ENTRY))
    # reinforce++ (returns carried through the interior hole)
    want, want_ret = VERL["compute_reinforce_plus_plus_outcome_advantage"](r64, m, config=algo)
    got = rv.compute_reinforce_plus_plus_outcome_advantage(batch["rewards"], m, config=algo)
    got64 = rv.compute_reinforce_plus_plus_outcome_advantage(r64, m, config=algo)
    cases.append(("reinforce_plus_plus", want, want_ret, got, got64, want_ret, RETURNS_ENTRY))
    # reinforce++-baseline: whitening of (s - mean_g) m
    centred, _ = VERL["compute_grpo_outcome_advantage"](r64, m, batch["index"], norm_adv_by_std_in_grpo=False)
    args = (m, batch["index"])
    want, want_ret = VERL["compute_reinforce_plus_plus_baseline_outcome_advantage"](r64, *args, config=algo)
    got = rv.compute_reinforce_plus_plus_baseline_outcome_advantage(batch["rewards"], *args, config=algo)
    got64 = rv.compute_reinforce_plus_plus_baseline_outcome_advantage(r64, *args, config=algo)
    cases.append(("reinforce_plus_plus_baseline", want, want_ret, got, got64, centred, None))
    # gdpo without reward components: GRPO of the summed rewards, whitened
    want, want_ret = VERL["compute_gdpo_outcome_advantage"](r64, m, batch["index"])
    got = rv.compute_gdpo_outcome_advantage(batch["rewards"], m, batch["index"])
    got64 = rv.compute_gdpo_outcome_advantage(r64, m, batch["index"])
    pre, _ = VERL["compute_grpo_outcome_advantage"](r64, m, batch["index"])
    cases.append(("gdpo", want, want_ret, got, got64, pre, None))
    for name, want, want_ret, (adv, ret), (adv64, ret64), pre, ret_entry in cases:
        torch.testing.assert_close(torch.where(on, adv64, 0.0), torch.where(on, want, 0.0), **_NEAR, msg=name)
        assert bool((adv[~on] == 0).all()), name
        check_scaled(f"{name} advantages", adv[on], want[on], _whiten_scale(pre, m, want)[on.reshape(-1)], WHITEN_ENTRY)
        if ret_entry is not None:
            torch.testing.assert_close(ret64, want_ret, **_TIGHT, msg=name)
            check_value(f"{name} returns", ret, want_ret, ret_entry)


def test_remax_matches_verl():
    batch = outcome_batch(seed=9)
    args64 = (_f64(batch["rewards"]), _f64(batch["baselines"]), batch["mask"])
    want, want_ret = VERL["compute_remax_outcome_advantage"](*args64)
    got64, got64_ret = rv.compute_remax_outcome_advantage(*args64)
    got, got_ret = rv.compute_remax_outcome_advantage(batch["rewards"], batch["baselines"], batch["mask"])
    torch.testing.assert_close(got64, want, **_TIGHT)
    torch.testing.assert_close(got64_ret, want_ret, **_TIGHT)
    check_value("returns", got_ret, want_ret, RETURNS_ENTRY)
    check_value("advantages", got, want, RETURNS_ENTRY)


# ----------------------------------------------------------------------------------------------
# fused log-prob + entropy
# ----------------------------------------------------------------------------------------------


def lm_inputs(dtype, seed=0, b=2, t=5, h=16, v=37):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(b, t, h, generator=g) * 0.7).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * 0.7).to(dtype).requires_grad_(True)
    ids = torch.randint(0, v, (b, t), generator=g)
    up = (torch.randn(b, t, generator=g).to(torch.float64), torch.randn(b, t, generator=g).to(torch.float64))
    return hidden, weight, ids, up


def verl_unfused(hidden, weight, ids, temperature):
    """verl's path without fused kernels: the logits, then logprobs_from_logits and entropy_from_logits."""
    logits = (hidden @ weight.t()) / temperature
    return verl_F.logprobs_from_logits(logits, ids), verl_F.entropy_from_logits(logits)


def _backward(outputs, inputs, up):
    lp, ent = outputs
    (lp.double() * up[0]).sum().add_((ent.double() * up[1]).sum()).backward()
    return [x.grad.clone() for x in inputs]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("impl", ["module", "linear_cross_entropy"])
def test_fused_logprob_matches_verls_unfused_path(temperature, impl):
    entry = contract.entry("linear_logprob", torch.float32)
    h64, w64, ids, up = lm_inputs(torch.float64)
    want = verl_unfused(h64, w64, ids, temperature)
    want_grads = _backward(want, (h64, w64), up)
    want_torch_fused = VerlFusedLinearForPPO()(h64.detach(), w64.detach(), ids, temperature)
    for dtype in (torch.float64, torch.float32):
        h, w, _, _ = lm_inputs(dtype)
        if impl == "module":
            got = rv.FusedLinearForPPO()(h, w, ids, temperature)
            assert got[0].shape == ids.shape and got[1].dtype == dtype
        else:
            lp, ent = rv.linear_cross_entropy(h, w, ids, temperature, "none")
            assert lp.shape == (ids.numel(),) and ent.dtype == lp.dtype
            got = (lp.view(ids.shape), ent.view(ids.shape))
        grads = _backward(got, (h, w), up)
        if dtype == torch.float64:
            for a, b_ in zip((*got, *grads), (*want, *want_grads)):
                torch.testing.assert_close(a, b_, **_TIGHT)
            # verl's torch fused module returns float32 log-probs whatever the input: its value is float32
            check_value("logprob vs FusedLinearForPPO", want_torch_fused[0], got[0], entry)
            check_value("entropy vs FusedLinearForPPO", want_torch_fused[1], got[1], entry)
        else:
            check_value("logprob", got[0], want[0], entry)
            check_value("entropy", got[1], want[1], entry)
            check_grad("grad_hidden", grads[0], want_grads[0], entry)
            check_grad("grad_weight", grads[1], want_grads[1], entry)


def test_linear_cross_entropy_reductions_and_limits():
    h, w, ids, _ = lm_inputs(torch.float64)
    lp, _ = verl_unfused(h, w, ids, 1.0)
    for reduction, expect in (("sum", lp.sum()), ("mean", lp.mean())):
        got, ent = rv.linear_cross_entropy(h, w, ids, 1.0, reduction)
        assert got.dim() == 0 and ent.shape == (ids.numel(),)
        torch.testing.assert_close(got, expect, **_TIGHT)
    with pytest.raises(TypeError, match="dist_process_group"):  # vocab-parallel: tests/test_verl_megatron.py
        rv.linear_cross_entropy(h, w, ids, 1.0, "none", dist_process_group=object())
    with pytest.raises(ValueError, match="reduction"):
        rv.linear_cross_entropy(h, w, ids, 1.0, "max")


@pytest.mark.gpu
def test_linear_cross_entropy_matches_verls_triton_kernel():
    """On a GPU, against the kernel verl's ``use_fused_kernels`` + ``fused_kernels_backend="triton"`` runs."""
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as verl_lce

    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(300, 256, generator=g) * 0.5).cuda().bfloat16().requires_grad_(True)
    weight = (torch.randn(5000, 256, generator=g) * 0.5).cuda().bfloat16().requires_grad_(True)
    ids = torch.randint(0, 5000, (300,), generator=g).cuda()
    want = verl_lce(hidden, weight, ids, 0.8, "none")
    got = rv.linear_cross_entropy(hidden, weight, ids, 0.8, "none")
    entry = contract.entry("linear_logprob", torch.bfloat16)
    check_value("logprob", got[0], want[0].double(), entry)
    check_value("entropy", got[1], want[1].double(), entry)


# ----------------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------------


def test_register_adds_rlk_names():
    names = rv.register()
    assert "rlk_vanilla" in names and "rlk_grpo" in names
    assert core_algos.get_policy_loss_fn("rlk_vanilla") is rv.compute_policy_loss_vanilla
    assert core_algos.get_adv_estimator_fn("rlk_gae") is rv.compute_gae_advantage_return
    assert core_algos.get_policy_loss_fn("vanilla") is VERL["compute_policy_loss_vanilla"]
    for name in rv.VERL_ONLY_LOSSES:
        assert f"rlk_{name}" not in core_algos.POLICY_LOSS_REGISTRY
    rv.unregister()
    assert "rlk_vanilla" not in core_algos.POLICY_LOSS_REGISTRY


def test_register_override_serves_verls_own_names():
    import verl.utils.experimental.torch_functional as verl_tf
    import verl.utils.kernel.linear_cross_entropy as verl_lce
    import verl.workers.utils.losses as verl_losses

    rv.register(override=True)
    assert core_algos.get_policy_loss_fn("vanilla") is rv.compute_policy_loss_vanilla
    assert core_algos.get_policy_loss_fn("clip_cov") is VERL["compute_policy_loss_clip_cov"]
    assert core_algos.get_adv_estimator_fn("grpo") is rv.compute_grpo_outcome_advantage
    assert core_algos.compute_gae_advantage_return is rv.compute_gae_advantage_return
    assert verl_losses.agg_loss is rv.agg_loss and verl_losses.kl_penalty is rv.kl_penalty
    assert verl_lce.linear_cross_entropy is rv.linear_cross_entropy
    assert verl_tf.FusedLinearForPPO is rv.FusedLinearForPPO
    # verl's bypass mode calls compute_policy_loss_vanilla by name: now rlk's, with the same result
    batch = make_batch(seed=2)
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, loss_type="ppo_clip")
    config = actor_config(policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rc))
    got = run_loss(core_algos.get_policy_loss_fn("bypass_mode"), batch, torch.float64, "token-mean", config, False)
    rv.unregister()
    assert core_algos.get_policy_loss_fn("vanilla") is VERL["compute_policy_loss_vanilla"]
    assert verl_losses.agg_loss is VERL["agg_loss"]
    assert verl_tf.FusedLinearForPPO is VerlFusedLinearForPPO
    want = run_loss(core_algos.get_policy_loss_fn("bypass_mode"), batch, torch.float64, "token-mean", config, False)
    torch.testing.assert_close(got[0], want[0], **_TIGHT)
    torch.testing.assert_close(got[1], want[1], **_TIGHT)


def test_import_rlk_does_not_import_verl():
    import subprocess
    import sys

    code = "import sys, rlk, rlk.integrations; assert 'verl' not in sys.modules and 'trl' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert rlk.policy_loss is not None


def test_gdpo_with_reward_components_matches_verl():
    """Components from ``non_tensor_batch`` (verl builds them in float32 whatever the rewards' dtype: its result is
    the float32 truth here), weighted."""
    batch = outcome_batch(seed=8)
    m = batch["mask"]
    rng = np.random.default_rng(0)
    comps = {"fmt": rng.random(m.shape[0]), "acc": rng.integers(0, 2, m.shape[0]).astype(np.float64)}
    cfg = {"gdpo_reward_keys": ["fmt", "acc"], "gdpo_reward_weights": [0.3, 1.0]}
    tb = {"prompts": torch.zeros(m.shape[0], 3), "attention_mask": torch.cat([torch.ones_like(m[:, :3]), m], 1)}
    want, _ = VERL["compute_gdpo_outcome_advantage"](
        batch["rewards"], m, batch["index"], config=cfg, non_tensor_batch=comps, batch=tb
    )
    got, _ = rv.compute_gdpo_outcome_advantage(
        batch["rewards"], m, batch["index"], config=cfg, non_tensor_batch=comps, batch=tb
    )
    pre = sum(
        w
        * VERL["compute_grpo_outcome_advantage"](
            torch.as_tensor(comps[k]).double()[:, None] * torch.ones(1, m.shape[1], dtype=torch.float64) / m.shape[1],
            m,
            batch["index"],
        )[0]
        for k, w in zip(cfg["gdpo_reward_keys"], cfg["gdpo_reward_weights"])
    )
    on = m.bool()
    check_scaled("advantages", got[on], want[on], _whiten_scale(pre, m, want)[on.reshape(-1)], WHITEN_ENTRY)
    assert bool((got[~on] == 0).all()) and bool(want[on].abs().sum() > 0)
    with pytest.raises(ValueError, match="gdpo_reward_keys"):
        rv.compute_gdpo_outcome_advantage(
            batch["rewards"], m, batch["index"], config={}, non_tensor_batch=comps, batch=tb
        )


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "1.5", "0.6_1.4"])
def test_rollout_is_weights_match_verl(level, threshold):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    batch = make_batch(seed=13)
    rollout = batch["old"] + 0.02 * torch.randn(batch["old"].shape, generator=torch.Generator().manual_seed(1))
    if level == "token":
        rollout = batch["old"] + 0.4 * (rollout - batch["old"]) / 0.02
    m = batch["mask"]
    want, _ = compute_rollout_correction_weights(
        (batch["old"] - rollout).double(), m, rollout_is=level, rollout_is_threshold=threshold
    )
    got64 = rv.rollout_is_weights(batch["old"].double(), rollout.double(), m, level, threshold)
    got = rv.rollout_is_weights(batch["old"], rollout, m, level, threshold)
    want = torch.where(m, want, 0.0)
    torch.testing.assert_close(got64, want, **_NEAR)  # verl truncates at a float32 threshold: to float32 rounding
    check_value("weights", got, want, contract.entry("rollout_correction", torch.float32))
    assert bool((want[m] != want[m].max()).any())  # not all truncated or masked
