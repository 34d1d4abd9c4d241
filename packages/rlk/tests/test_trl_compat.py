"""``rlk.policy_loss`` against TRL's own GRPO loss code (written for trl 1.16.0).

TRL's loss is the method ``trl.trainer.grpo_trainer.GRPOTrainer._compute_loss(self, model, inputs)``.
It only reads attributes of ``self``, so the tests call it unbound on a small fake trainer
(:class:`FakeTrainer`) that provides exactly what it reads: the per-token log-probs and entropies
(leaf tensors, so autograd gives TRL's own gradient), the loss configuration, an identity
accelerator with one process and a metrics store. Nothing of TRL's math is re-derived here; the
re-derivations live in ``test_policy_loss.py``.

Each case runs TRL and rlk (reference backend, CPU) on the same values and compares:

* float64 inputs: loss, gradient w.r.t. the log-probs (and the entropies when the entropy bonus
  is on) and the metrics both report, to rounding (``_TIGHT``);
* float32 inputs: rlk's loss and gradient against TRL run in float64 on the same values, under
  the numerical contract (``rlk.contract``, scale ``1 + |truth|`` as in ``test_policy_loss.py``),
  and the metrics against TRL run in float32 (the same clip decisions).

Mapping TRL -> rlk (``rlk_kwargs``)
-----------------------------------
``r = exp(logprob - old)``; TRL applies no log-ratio clamp (rlk: ``clamp_log_ratio=None``).

* ``loss_type`` grpo / bnpo / dr_grpo / dapo / luspo: ``loss="ppo"``, ``clip_low=epsilon_low``,
  ``clip_high=epsilon_high``; ``args.delta`` -> ``dual_clip=delta`` (equal in value and gradient
  when ``delta > 1 + epsilon_high``, as TRL's docs recommend and every case here uses).
* ``importance_sampling_level="sequence"`` -> ``loss="gspo"``: the advantage is one per sequence,
  so the gradient of the GSPO-token form equals TRL's sequence-ratio gradient.
* cispo -> ``loss="cispo", cispo_form="upper", clip_high=epsilon_high`` (the cap itself).
* sapo -> ``loss="sapo", sapo_tau=(sapo_temperature_pos, sapo_temperature_neg)``.
* ``beta`` -> ``kl="k3", kl_k3_clamp=False, kl_coef=beta, ref_logprob=ref_per_token_logps``.
* aggregation, with ``G = current_gradient_accumulation_steps`` in training (1 in eval), ``B``
  the rows of the micro-batch (empty rows included: TRL averages over all of them) and ``P``
  the processes:

  - grpo, sapo: ``agg="seq-mean-token-mean", global_seqs=B*G``;
  - bnpo: ``agg="token-mean", global_tokens=max(sum(mask), 1)*G``;
  - dr_grpo: ``agg="seq-mean-token-sum-norm", global_seqs=B*G, loss_scale=max_completion_length``;
  - dapo, cispo: ``agg="token-mean", global_tokens=max(num_items_in_batch, 1)/P*G/steps_per_generation``
    (in eval ``max(num_items_in_batch, 1)/P``);
  - luspo: ``agg="seq-mean-token-sum", global_seqs=B*G``.
* entropy bonus (``entropy_coef``): TRL subtracts ``coef * token-mean(entropy) / G`` whatever the
  loss type, rlk subtracts ``entropy_coef * agg(entropy)`` with the policy's aggregation. They are
  one rlk call when the policy aggregation is that token mean (bnpo: ``entropy_coef=coef``);
  otherwise the bonus is a second ``rlk.policy_loss`` call with ``loss="gpg"``, zero advantages,
  ``agg="token-mean", global_tokens=max(sum(mask), 1)*G`` (tested for grpo).
* ``top_entropy_quantile < 1``, ``off_policy_mask_threshold`` and vLLM's
  ``importance_sampling_ratio`` multiply the policy term only (not the KL), which is rlk's
  ``importance_weights`` (their product).

Metrics compared (same definitions only)
----------------------------------------
* TRL ``clip_ratio/region_mean`` = rlk ``clip_fraction`` for the ppo family: both count the masked
  tokens where the clipped branch is the active one (``r > 1 + eps_high`` with ``A > 0``, or
  ``r < 1 - eps_low`` with ``A < 0``). TRL computes it after the ``delta`` cap, which changes no
  decision since ``delta > 1 + eps_high``. At the sequence level TRL averages over sequences
  (empty ones included) and rlk over tokens, so they are compared on batches of full rows only.
  TRL's ``low_mean`` / ``high_mean`` / ``low_min`` / ``high_max`` have no rlk counterpart (rlk does
  not split by side), and rlk's ``lower_clip_fraction`` (dual clip active), ``approx_kl``,
  ``ratio_mean`` and ``ratio_max`` have no TRL counterpart.
* TRL ``cispo_clip_ratio`` counts ``r > epsilon_high`` only where ``A > 0``; rlk's cispo
  ``clip_fraction`` counts every capped token. Equal when every advantage is positive (tested),
  otherwise TRL's is at most rlk's (tested).
* TRL ``kl`` = rlk ``kl_mean`` (k3 unclamped, masked token mean); TRL ``entropy`` = rlk
  ``entropy_mean``.

What rlk cannot express exactly (not tested as equal)
-----------------------------------------------------
* ``args.use_bias_correction_kl``: TRL multiplies k3 by the ratio ``coef_1`` *with* its gradient.
  rlk's ``kl_unbiased`` has the same value but a detached weight, so the gradients differ by
  ``beta * w * k3 * r`` per token (``w`` the aggregation weight); ``test_bias_correction_kl``
  checks exactly that difference. At the sequence level TRL's weight is the sequence ratio,
  which rlk has no form of.
* cispo and sapo with ``importance_sampling_level="sequence"`` (the weight / gate of the
  sequence ratio): rlk's cispo and sapo use the token ratio.
* ``delta`` with ``importance_sampling_level="sequence"``: rlk's gspo has no dual clip.
* ``delta <= 1 + epsilon_high`` (TRL would cap the ratio below the clip range as well).
* loss_type ``vespo`` (gamma weights of the sequence ratio): no rlk loss.
* The entropy bonus with ``top_entropy_quantile < 1`` (TRL restricts the bonus's token mean to
  the high-entropy tokens; rlk's importance weights do not touch the entropy term), and the
  adaptive entropy controller (``use_adaptive_entropy``: a trainer-state update, not a loss).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import types
import zlib

import pytest
import torch

import rlk
from rlk import contract

try:
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer
except ImportError as err:  # pragma: no cover - depends on the environment
    if os.environ.get("RLK_REQUIRE_TRL", "0") not in ("", "0"):
        raise ImportError(f"RLK_REQUIRE_TRL is set but trl cannot be imported ({err}); "
                          "install the pins of ci/requirements-dev.txt") from err
    pytest.skip(f"trl is not installed ({err}); set RLK_REQUIRE_TRL=1 to make this an error",
                allow_module_level=True)

ENTRY = contract.entry("policy_loss", torch.float32)
#: float64 against float64: both sides compute the same sums in another order.
_TIGHT = {"rtol": 1e-11, "atol": 1e-13}
#: A fraction of at most a few hundred tokens rounded to float32.
_FRACTION = {"rtol": 1e-6, "atol": 0.0}
_TRL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
#: TRL builds the SAPO temperatures with ``torch.where(advantages > 0, pos, neg)`` on Python floats,
#: which gives a float32 tensor whatever the input dtype: its temperatures are float32-rounded
#: (1.05 -> 1.0499999523...). rlk gets the same values, so float64 runs agree to rounding.
_TRL_SAPO_TAU = tuple(float(torch.tensor(_TRL_DEFAULTS[f"sapo_temperature_{s}"], dtype=torch.float32))
                      for s in ("pos", "neg"))


# ----------------------------------------------------------------------------------------------
# TRL's _compute_loss on a fake trainer
# ----------------------------------------------------------------------------------------------


class IdentityAccelerator:
    """One process: gather / reduce / pad return their input."""

    def __init__(self, num_processes: int = 1):
        self.num_processes = num_processes
        self.sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


@dataclasses.dataclass(frozen=True)
class Case:
    """One TRL configuration (``None``: TRL's default)."""

    loss_type: str
    level: str = "token"
    beta: float = 0.0
    epsilon: float | None = None
    epsilon_high: float | None = None
    delta: float | None = None
    entropy_coef: float = 0.0
    accum: int = 1
    steps_per_generation: int = 1
    num_processes: int = 1
    training: bool = True
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    vllm_is: bool = False
    bias_correction_kl: bool = False

    @property
    def eps_low(self) -> float:
        return _TRL_DEFAULTS["epsilon"] if self.epsilon is None else self.epsilon

    @property
    def eps_high(self) -> float:
        # GRPOTrainer.__init__: epsilon_high = args.epsilon_high if not None else args.epsilon
        return self.eps_low if self.epsilon_high is None else self.epsilon_high

    def __str__(self) -> str:
        fields = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                  if f.name != "loss_type" and getattr(self, f.name) != f.default]
        return "-".join([self.loss_type, *fields])


class FakeTrainer:
    """Exactly the attributes ``GRPOTrainer._compute_loss`` reads (a missing one raises AttributeError)."""

    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
    get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask

    def __init__(self, case: Case, logprob: torch.Tensor, entropy: torch.Tensor, max_completion_length: int):
        self._logprob, self._entropy = logprob, entropy
        self.loss_type = case.loss_type
        self.importance_sampling_level = case.level
        self.beta = case.beta
        self.epsilon_low, self.epsilon_high = case.eps_low, case.eps_high
        self.top_entropy_quantile = case.top_entropy_quantile
        self.off_policy_mask_threshold = case.off_policy_mask_threshold
        self.use_vllm = case.vllm_is
        self.vllm_importance_sampling_correction = case.vllm_is
        self.aux_loss_enabled = False
        self.entropy_coef = case.entropy_coef
        self.use_adaptive_entropy = False
        self._entropy_bonus_enabled = case.entropy_coef != 0.0
        self.model = types.SimpleNamespace(training=case.training)
        self.current_gradient_accumulation_steps = case.accum
        self.max_completion_length = max_completion_length
        self.accelerator = IdentityAccelerator(case.num_processes)
        self._metrics = collections.defaultdict(lambda: collections.defaultdict(list))
        self.args = types.SimpleNamespace(
            delta=case.delta,
            use_bias_correction_kl=case.bias_correction_kl,
            sapo_temperature_pos=_TRL_DEFAULTS["sapo_temperature_pos"],
            sapo_temperature_neg=_TRL_DEFAULTS["sapo_temperature_neg"],
            steps_per_generation=case.steps_per_generation,
        )

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        assert logits_to_keep == self._logprob.shape[1] and compute_entropy
        return self._logprob, self._entropy, None


def run_trl(case: Case, data: dict, dtype: torch.dtype) -> dict:
    """TRL's loss on ``data`` in ``dtype``: loss, gradients (log-probs, entropies) and the logged metrics."""
    b, t = data["lp"].shape
    lp = data["lp"].to(dtype).clone().requires_grad_(True)
    ent = data["entropy"].to(dtype).clone().requires_grad_(True)
    trainer = FakeTrainer(case, lp, ent, data["max_completion_length"])
    inputs = {
        "prompt_ids": torch.zeros(b, 2, dtype=torch.long),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.zeros(b, t, dtype=torch.long),
        "completion_mask": data["mask"],
        "advantages": data["adv"].to(dtype),
        "old_per_token_logps": data["old"].to(dtype),
        "ref_per_token_logps": data["ref"].to(dtype),
        "num_items_in_batch": torch.tensor(data["num_items"]),
    }
    if case.vllm_is:
        inputs["importance_sampling_ratio"] = data["is_ratio"].to(dtype)
    loss = GRPOTrainer._compute_loss(trainer, types.SimpleNamespace(), inputs)
    loss.backward()
    mode = "train" if case.training else "eval"
    metrics = {name: values[-1] for name, values in trainer._metrics[mode].items()}
    grad_ent = ent.grad if ent.grad is not None else torch.zeros_like(ent)
    return {"loss": loss.detach(), "grad": lp.grad, "grad_entropy": grad_ent, "metrics": metrics}


# ----------------------------------------------------------------------------------------------
# rlk with the mapped configuration
# ----------------------------------------------------------------------------------------------


def _entropy_normalizer(case: Case, mask: torch.Tensor) -> float:
    """TRL's entropy bonus: token mean over the micro-batch, divided by G in training."""
    return max(int(mask.sum()), 1) * (case.accum if case.training else 1)


def rlk_kwargs(case: Case, data: dict) -> dict:
    """``rlk.policy_loss`` keyword arguments equal to TRL's configuration (module docstring)."""
    b = data["lp"].shape[0]
    g = case.accum if case.training else 1
    kw: dict = {"clip_low": case.eps_low, "clip_high": case.eps_high}
    if case.loss_type == "cispo":
        kw.update(loss="cispo", cispo_form="upper")
    elif case.loss_type == "sapo":
        kw["loss"] = "sapo"
        kw["sapo_tau"] = _TRL_SAPO_TAU
    else:
        kw["loss"] = "gspo" if case.level == "sequence" else "ppo"
        if case.delta is not None:
            kw["dual_clip"] = case.delta
    if case.level == "sequence":
        assert kw["loss"] == "gspo", f"{case}: not expressible in rlk (module docstring)"
    if case.beta != 0.0:
        kw.update(kl="k3", kl_k3_clamp=False, kl_coef=case.beta)
    if case.loss_type in ("grpo", "sapo"):
        kw.update(agg="seq-mean-token-mean", global_seqs=b * g)
    elif case.loss_type == "bnpo":
        kw.update(agg="token-mean", global_tokens=max(int(data["mask"].sum()), 1) * g)
    elif case.loss_type == "dr_grpo":
        kw.update(agg="seq-mean-token-sum-norm", global_seqs=b * g, loss_scale=data["max_completion_length"])
    elif case.loss_type in ("dapo", "cispo"):
        n_items = max(data["num_items"], 1) / case.num_processes
        kw.update(agg="token-mean", global_tokens=n_items * g / case.steps_per_generation if case.training
                  else n_items)
    elif case.loss_type == "luspo":
        kw.update(agg="seq-mean-token-sum", global_seqs=b * g)
    else:
        raise AssertionError(f"loss_type {case.loss_type!r} has no rlk mapping")
    return kw


def importance_weights(case: Case, data: dict, dtype: torch.dtype) -> torch.Tensor | None:
    """The product of TRL's policy-term masks and weights, computed here from their definitions."""
    m = data["mask"].bool()
    w = torch.ones(data["lp"].shape, dtype=dtype)
    if case.top_entropy_quantile < 1.0:
        ent = data["entropy"].to(dtype)
        threshold = torch.quantile(ent[m].float(), 1.0 - case.top_entropy_quantile)
        w = w * (m & (ent * m >= threshold))
        assert 0 < int((w[m] == 0).sum()) < int(m.sum()), "the entropy mask should drop some tokens"
    if case.off_policy_mask_threshold is not None:
        d = (data["old"] - data["lp"]).to(dtype)
        seq_kl = torch.where(m, d, 0.0).sum(-1) / m.sum(-1).clamp(min=1)
        keep = (data["adv"] >= 0) | (seq_kl <= case.off_policy_mask_threshold)
        w = w * keep[:, None]
        assert not bool(keep[m.any(-1)].all()), "the off-policy mask should drop a sequence with tokens"
    if case.vllm_is:
        w = w * data["is_ratio"].to(dtype)
    return None if w.eq(1.0).all() else w


def run_rlk(case: Case, data: dict, dtype: torch.dtype) -> dict:
    """rlk on ``data`` in ``dtype`` (reference backend on the CPU)."""
    lp = data["lp"].to(dtype).clone().requires_grad_(True)
    ent = data["entropy"].to(dtype).clone().requires_grad_(True)
    mask = data["mask"].bool()
    kw = rlk_kwargs(case, data)
    single_call_bonus = kw["agg"] == "token-mean" and kw["global_tokens"] == _entropy_normalizer(case, mask)
    if case.entropy_coef != 0.0 and single_call_bonus:
        kw["entropy_coef"] = case.entropy_coef
    loss, metrics = rlk.policy_loss(
        lp, data["old"].to(dtype), data["adv"].to(dtype), mask, ref_logprob=data["ref"].to(dtype), entropy=ent,
        importance_weights=importance_weights(case, data, dtype), **kw)
    if case.entropy_coef != 0.0 and not single_call_bonus:
        bonus, _ = rlk.policy_loss(lp, None, torch.zeros_like(data["adv"], dtype=dtype), mask, loss="gpg",
                                   agg="token-mean", global_tokens=_entropy_normalizer(case, mask), entropy=ent,
                                   entropy_coef=case.entropy_coef)
        loss = loss + bonus
    loss.backward()
    grad_ent = ent.grad if ent.grad is not None else torch.zeros_like(ent)
    return {"loss": loss.detach(), "grad": lp.grad, "grad_entropy": grad_ent, "metrics": metrics}


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------


def make_data(b: int = 6, t: int = 9, seed: int = 0, *, ragged: bool = True, spread: float = 1.5,
              positive_adv: bool = False) -> dict:
    """float32 values: right-padded rows (row 0 full; with ``ragged`` row 2 empty), mixed-sign
    advantages (row 3 zero), log-ratios around 0 with some at +-``spread`` (far outside the clip
    ranges), an int completion mask as TRL builds it, ``num_items_in_batch`` of two micro-batches
    plus a few tokens, and ``max_completion_length`` past the padded length. Some reference
    log-probs lie 3 above the policy's (k3 of about 16)."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 4 - 0.05
    old = lp + 0.3 * torch.randn(b, t, generator=g)
    old[:, ::4] = lp[:, ::4] - spread
    old[:, 1::5] = lp[:, 1::5] + spread
    ref = lp + 0.5 * torch.randn(b, t, generator=g)
    ref[:, 2::6] = lp[:, 2::6] + 3.0  # k3 = e^3 - 4 > 10: verl's value clamp would change it, TRL has none
    adv = torch.randn(b, generator=g)
    adv[0], adv[1], adv[3] = abs(float(adv[0])) + 0.1, -abs(float(adv[1])) - 0.1, 0.0
    if positive_adv:
        adv = adv.abs() + 0.1
    lengths = torch.randint(1, t + 1, (b,), generator=g) if ragged else torch.full((b,), t)
    lengths[0] = t
    if ragged:
        lengths[2] = 0
    mask = (torch.arange(t)[None, :] < lengths[:, None]).int()
    return {
        "lp": lp, "old": old, "ref": ref, "adv": adv, "mask": mask,
        "entropy": torch.rand(b, t, generator=g) * 2,
        "is_ratio": torch.rand(b, t, generator=g) + 0.5,
        "num_items": 2 * int(mask.sum()) + 5,
        "max_completion_length": t + 3,
    }


# ----------------------------------------------------------------------------------------------
# comparisons
# ----------------------------------------------------------------------------------------------


def _check_contract(name: str, got: torch.Tensor, truth: torch.Tensor, *, grad: bool) -> None:
    truth = truth.detach().double()
    if grad:
        dev = contract.compare_grad(ENTRY, name, got, truth, 1.0)
    else:
        dev = contract.compare_outputs(ENTRY, name, got.reshape(-1), truth.reshape(-1), 1.0 + truth.abs().reshape(-1))
    assert dev.ok, dev


def _shared_metrics(case: Case, trl_metrics: dict, rlk_metrics: dict, full_rows: bool) -> list[tuple[str, str]]:
    """(TRL name, rlk name) of the metrics with the same definition in this case (module docstring)."""
    pairs = [("entropy", "entropy_mean")]
    if case.beta != 0.0:
        pairs.append(("kl", "kl_mean"))
    if case.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo") and (case.level == "token" or full_rows):
        pairs.append(("clip_ratio/region_mean", "clip_fraction"))
    for trl_name, rlk_name in pairs:
        assert trl_name in trl_metrics and rlk_name in rlk_metrics, (trl_name, rlk_name)
    return pairs


def compare(case: Case, data: dict, dtype: torch.dtype, *, full_rows: bool = False) -> tuple[dict, dict]:
    got = run_rlk(case, data, dtype)
    if dtype == torch.float64:
        want = truth = run_trl(case, data, torch.float64)
        for key in ("loss", "grad", "grad_entropy"):
            torch.testing.assert_close(got[key], want[key], **_TIGHT, msg=lambda m, key=key: f"{case} {key}: {m}")
        metric_tol = _TIGHT
    else:
        truth = run_trl(case, data, torch.float64)
        _check_contract(f"{case} loss", got["loss"], truth["loss"], grad=False)
        _check_contract(f"{case} grad", got["grad"], truth["grad"], grad=True)
        if case.entropy_coef != 0.0:
            _check_contract(f"{case} grad_entropy", got["grad_entropy"], truth["grad_entropy"], grad=True)
        want = run_trl(case, data, torch.float32)  # the same clip decisions as rlk's float32 run
        metric_tol = {"rtol": 1e-5, "atol": 1e-6}
    for trl_name, rlk_name in _shared_metrics(case, want["metrics"], got["metrics"], full_rows):
        # TRL counts clipped tokens as .float(): float32 fractions even for float64 inputs
        tol = _FRACTION if trl_name.startswith("clip_ratio") else metric_tol
        torch.testing.assert_close(got["metrics"][rlk_name].double(), torch.tensor(float(want["metrics"][trl_name]),
                                   dtype=torch.float64), **tol, msg=lambda m, n=trl_name: f"{case} {n}: {m}")
    return got, truth


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------

GSPO = {"epsilon": 3e-4, "epsilon_high": 4e-4}
CASES = [
    Case("grpo"),
    Case("grpo", beta=0.04, accum=2),
    Case("grpo", delta=3.0, beta=0.04),
    Case("grpo", training=False, accum=4),
    Case("bnpo"),
    Case("bnpo", delta=3.0, accum=3),
    Case("dr_grpo"),
    Case("dr_grpo", beta=0.04, accum=2),
    Case("dapo", epsilon_high=0.28),
    Case("dapo", epsilon_high=0.28, delta=3.0, beta=0.04, accum=2, steps_per_generation=4),
    Case("dapo", accum=2, steps_per_generation=2, num_processes=2),
    Case("dapo", training=False, accum=2, steps_per_generation=4),
    Case("luspo"),
    Case("luspo", delta=3.0, accum=2),
    Case("cispo", epsilon_high=5.0),
    Case("cispo", epsilon_high=1.28, beta=0.04, accum=2, steps_per_generation=2),
    Case("sapo"),
    Case("sapo", beta=0.04, accum=3),
    # sequence-level importance sampling (GSPO) -> rlk loss="gspo"
    Case("grpo", level="sequence", **GSPO),
    Case("grpo", level="sequence", beta=0.04, accum=2, **GSPO),
    Case("bnpo", level="sequence", **GSPO),
    Case("dr_grpo", level="sequence", **GSPO),
    Case("dapo", level="sequence", accum=2, steps_per_generation=2, **GSPO),
    Case("luspo", level="sequence", **GSPO),
    Case("luspo", level="sequence", epsilon=0.2),
    # entropy bonus: one rlk call (bnpo) or a second gpg call (the others)
    Case("bnpo", entropy_coef=0.01),
    Case("bnpo", entropy_coef=0.05, beta=0.04, accum=3),
    Case("grpo", entropy_coef=0.05, accum=2),
    Case("dapo", entropy_coef=0.05, epsilon_high=0.28, accum=2, steps_per_generation=2),
    # policy-term masks / weights -> importance_weights
    Case("bnpo", top_entropy_quantile=0.5, beta=0.04),
    Case("dapo", off_policy_mask_threshold=0.05, beta=0.04),
    Case("grpo", vllm_is=True, top_entropy_quantile=0.3, off_policy_mask_threshold=0.05, beta=0.04, accum=2),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_trl_compute_loss(case, dtype):
    """TRL's loss, gradient and shared metrics equal rlk's on a batch with an empty row, ragged rows
    and a zero advantage."""
    data = make_data(seed=zlib.crc32(str(case).encode()) % 1000)
    if case.off_policy_mask_threshold is not None:  # row 1 (A < 0) drifted far: TRL's mask drops it
        data["old"][1] += 2.0
    got, truth = compare(case, data, dtype)
    assert float(truth["grad"].abs().sum()) > 0
    assert torch.all(truth["grad"][2] == 0) and torch.all(got["grad"][2] == 0)  # the empty row


@pytest.mark.parametrize("case", [c for c in CASES if c.level == "sequence"] + CASES[:3], ids=str)
def test_trl_full_rows(case):
    """Rows all of full length: TRL's sequence-level clip ratio (a mean over sequences) then equals
    rlk's token mean, so it is compared too; and it is not trivially 0 or 1."""
    data = make_data(seed=11, ragged=False, spread=0.4)
    got, _ = compare(case, data, torch.float64, full_rows=True)
    if case.level == "token" or case.eps_low < 0.01:  # sequence ratios stay inside +-0.2 here
        assert 0.0 < float(got["metrics"]["clip_fraction"]) < 1.0


def test_trl_metrics_not_trivial():
    """The clip and KL metrics compared above are neither all-zero nor all-one on the test batch."""
    data = make_data(seed=3)
    got, _ = compare(Case("dapo", epsilon_high=0.28, beta=0.04), data, torch.float64)
    assert 0.0 < float(got["metrics"]["clip_fraction"]) < 1.0
    assert float(got["metrics"]["kl_mean"]) > 0.0


def test_trl_cispo_clip_ratio():
    """TRL's cispo_clip_ratio counts capped tokens with A > 0 only: equal to rlk's clip_fraction when
    every advantage is positive, at most it otherwise (and here strictly less)."""
    case = Case("cispo", epsilon_high=1.28)
    data = make_data(seed=4, positive_adv=True)
    got, _ = compare(case, data, torch.float64)
    want = run_trl(case, data, torch.float64)["metrics"]["cispo_clip_ratio"]
    assert 0.0 < want < 1.0
    assert float(got["metrics"]["clip_fraction"]) == pytest.approx(want, rel=1e-12)

    data = make_data(seed=4)
    got, _ = compare(case, data, torch.float64)
    want = run_trl(case, data, torch.float64)["metrics"]["cispo_clip_ratio"]
    assert want < float(got["metrics"]["clip_fraction"])


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo"])
def test_trl_all_masked(loss_type):
    """A micro-batch without any completion token: loss 0, zero gradients and no NaN on both sides."""
    data = make_data(seed=5)
    data["mask"] = torch.zeros_like(data["mask"])
    data["num_items"] = 0
    case = Case(loss_type, beta=0.04, entropy_coef=0.01 if loss_type == "bnpo" else 0.0,
                epsilon_high=5.0 if loss_type == "cispo" else None)
    got, truth = compare(case, data, torch.float64)
    for side in (got, truth):
        assert float(side["loss"]) == 0.0
        assert torch.all(side["grad"] == 0) and torch.all(side["grad_entropy"] == 0)


def test_trl_sapo_defaults():
    """rlk's default sapo_tau is TRL's (sapo_temperature_pos, sapo_temperature_neg)."""
    import inspect

    default = inspect.signature(rlk.policy_loss).parameters["sapo_tau"].default
    assert default == (_TRL_DEFAULTS["sapo_temperature_pos"], _TRL_DEFAULTS["sapo_temperature_neg"])


def test_bias_correction_kl():
    """Not expressible: TRL's use_bias_correction_kl weights k3 by the ratio with its gradient. rlk's
    kl_unbiased has the same loss value; its gradient lacks exactly ``beta * w * k3 * r`` per token."""
    case = Case("bnpo", beta=0.04, bias_correction_kl=True)
    data = make_data(seed=6)
    want = run_trl(case, data, torch.float64)
    got = run_rlk(dataclasses.replace(case, bias_correction_kl=False), data, torch.float64)
    lp = data["lp"].double().clone().requires_grad_(True)
    mask = data["mask"].bool()
    kw = rlk_kwargs(case, data)
    loss, _ = rlk.policy_loss(lp, data["old"].double(), data["adv"].double(), mask, ref_logprob=data["ref"].double(),
                              kl_unbiased=True, **kw)
    loss.backward()
    torch.testing.assert_close(loss.detach(), want["loss"], **_TIGHT)
    assert not torch.allclose(lp.grad, want["grad"])
    d = data["lp"].double() - data["ref"].double()
    k3 = torch.exp(-d) - 1 + d
    ratio = torch.exp(data["lp"].double() - data["old"].double())
    w = mask.double() / kw["global_tokens"]
    torch.testing.assert_close(lp.grad + case.beta * w * k3 * ratio, want["grad"], **_TIGHT)
    assert not torch.allclose(got["loss"], want["loss"])  # and kl_unbiased=False differs in value
