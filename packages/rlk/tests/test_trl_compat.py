"""rlk's TRL adapter (``rlk.integrations.trl.compute_loss``) against TRL's own GRPO loss code (trl 1.16.0).

TRL's loss is the method ``trl.trainer.grpo_trainer.GRPOTrainer._compute_loss(self, model, inputs)``; the
adapter's replacement is ``rlk.integrations.trl.compute_loss(trainer, model, inputs)``. Both only read
attributes of the trainer, so the tests call them on a small fake trainer (:class:`FakeTrainer`) that
provides exactly what they read: the per-token log-probs and entropies (leaf tensors, so autograd gives each
side's own gradient), the loss configuration, an identity accelerator with one process, TRL's own mask
methods and a metrics store. The mapping TRL -> rlk is the adapter's (``policy_loss_kwargs``, whose docstring
states it); nothing of it is repeated here, and nothing of TRL's math is re-derived (the re-derivations live in
``test_policy_loss.py``).

Each case runs TRL and the adapter (reference backend, CPU) on the same values and compares:

* float64 inputs: loss, gradient w.r.t. the log-probs and the entropies, and every metric the adapter logs
  under a TRL name, to rounding (``_TIGHT``);
* float32 inputs: the adapter's loss and gradients against TRL run in float64 on the same values, under the
  numerical contract (``rlk.core.contract``, scale ``1 + |truth|`` as in ``test_policy_loss.py``), and the metrics
  against TRL run in float32 (the same clip decisions).

Metrics (the adapter logs under TRL's name only what has TRL's definition)
-------------------------------------------------------------------------
* ``entropy``, ``kl`` (k3, ratio-weighted with ``use_bias_correction_kl``), ``policy_loss`` and
  ``entropy_coef`` (with the entropy bonus): always.
* ``clip_ratio/region_mean`` = rlk ``clip_fraction`` for the ppo family at the token level: both count the
  masked tokens where the clipped branch is the active one (TRL computes it after the ``delta`` cap, which
  changes no decision since ``delta > 1 + eps_high``). At the sequence level TRL averages over sequences
  (empty ones included) and rlk over tokens: not logged under TRL's name (``rlk/clip_fraction`` is; equal on
  batches of full rows, tested).
* Not logged (no rlk counterpart): ``clip_ratio/low_mean``, ``high_mean``, ``low_min``, ``high_max`` (rlk does
  not split by side); ``cispo_clip_ratio`` (TRL counts ``r > epsilon_high`` only where ``A > 0``, rlk's cispo
  ``clip_fraction`` every capped token: equal when every advantage is positive, tested); ``vespo/phi_seq_mean``.
  The adapter adds rlk's ``rlk/clip_fraction``, ``rlk/approx_kl``, ``rlk/ratio_mean``, ``rlk/ratio_max``.

What the adapter refuses (``check_supported``; tested)
------------------------------------------------------
cispo and sapo with ``importance_sampling_level="sequence"`` (rlk's use the token ratio); ``delta`` at the
sequence level (rlk's gspo has no dual clip) or ``delta <= 1 + epsilon_high`` (TRL would cap the ratio below
the clip range); ``use_bias_correction_kl`` with ``beta != 0`` at the sequence level (the KL weighted by the
sequence ratio with its gradient); the MoE auxiliary loss. Everything else of TRL 1.16's loss is computed:
every ``loss_type``, both levels, ``beta`` with and without the bias-corrected KL, ``delta``, the entropy
bonus (static and adaptive), ``top_entropy_quantile``, ``off_policy_mask_threshold`` and the vLLM
importance-sampling ratio (for vespo inside the sequence weight, as TRL).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import types
import zlib

import pytest
import torch

from rlk.core import contract

try:
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    from rlk.integrations import trl as rlk_trl
except ImportError as err:  # pragma: no cover - depends on the environment
    if os.environ.get("RLK_REQUIRE_TRL", "0") not in ("", "0"):
        raise ImportError(
            f"RLK_REQUIRE_TRL is set but trl cannot be imported ({err}); install the pins of ci/requirements-dev.txt"
        ) from err
    pytest.skip(f"trl is not installed ({err}); set RLK_REQUIRE_TRL=1 to make this an error", allow_module_level=True)

ENTRY = contract.entry("policy_loss", torch.float32)
#: float64 against float64: both sides compute the same sums in another order.
_TIGHT = {"rtol": 1e-11, "atol": 1e-13}
#: A fraction of at most a few hundred tokens rounded to float32.
_FRACTION = {"rtol": 1e-6, "atol": 0.0}
_TRL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}


# ----------------------------------------------------------------------------------------------
# a fake trainer for both losses
# ----------------------------------------------------------------------------------------------


class IdentityAccelerator:
    """One process: gather / reduce / pad return their input."""

    def __init__(self, num_processes: int = 1, sync_gradients: bool = True):
        self.num_processes = num_processes
        self.sync_gradients = sync_gradients

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
    adaptive_entropy: bool = False
    accum: int = 1
    steps_per_generation: int = 1
    num_processes: int = 1
    training: bool = True
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    vllm_mode: str | None = None  # TRL's vllm_importance_sampling_mode (None: no vLLM correction)
    bias_correction_kl: bool = _TRL_DEFAULTS["use_bias_correction_kl"]
    vespo: tuple[float, float, float, float] | None = None  # (k_pos, lambda_pos, k_neg, lambda_neg)

    @property
    def eps_low(self) -> float:
        return _TRL_DEFAULTS["epsilon"] if self.epsilon is None else self.epsilon

    @property
    def eps_high(self) -> float:
        # GRPOTrainer.__init__: epsilon_high = args.epsilon_high if not None else args.epsilon
        return self.eps_low if self.epsilon_high is None else self.epsilon_high

    def __str__(self) -> str:
        fields = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if f.name != "loss_type" and getattr(self, f.name) != f.default
        ]
        return "-".join([self.loss_type, *fields])


class FakeTrainer:
    """Exactly the attributes ``GRPOTrainer._compute_loss`` and ``rlk_trl.compute_loss`` read (a missing one
    raises AttributeError); TRL's own entropy and off-policy mask methods."""

    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)
    get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask

    def __init__(self, case: Case, max_completion_length: int):
        self._logprob = self._entropy = None
        self.loss_type = case.loss_type
        self.importance_sampling_level = case.level
        self.beta = case.beta
        self.epsilon_low, self.epsilon_high = case.eps_low, case.eps_high
        self.top_entropy_quantile = case.top_entropy_quantile
        self.off_policy_mask_threshold = case.off_policy_mask_threshold
        self.use_vllm = self.vllm_importance_sampling_correction = case.vllm_mode is not None
        self.vllm_importance_sampling_mode = case.vllm_mode
        self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max = VLLM_CLIP
        self.aux_loss_enabled = False
        self.entropy_coef = case.entropy_coef
        self.use_adaptive_entropy = case.adaptive_entropy
        self._entropy_bonus_enabled = case.entropy_coef != 0.0 or case.adaptive_entropy
        self._last_world_entropy = float("inf")
        self._entropy_window_stats = None
        self.model = types.SimpleNamespace(training=case.training)
        self.current_gradient_accumulation_steps = case.accum
        self.max_completion_length = max_completion_length
        self.accelerator = IdentityAccelerator(case.num_processes)
        self._metrics = collections.defaultdict(lambda: collections.defaultdict(list))
        k_pos, lambda_pos, k_neg, lambda_neg = case.vespo or (
            _TRL_DEFAULTS["vespo_k_pos"],
            _TRL_DEFAULTS["vespo_lambda_pos"],
            _TRL_DEFAULTS["vespo_k_neg"],
            _TRL_DEFAULTS["vespo_lambda_neg"],
        )
        self.args = types.SimpleNamespace(
            delta=case.delta,
            use_bias_correction_kl=case.bias_correction_kl,
            sapo_temperature_pos=_TRL_DEFAULTS["sapo_temperature_pos"],
            sapo_temperature_neg=_TRL_DEFAULTS["sapo_temperature_neg"],
            vespo_k_pos=k_pos,
            vespo_lambda_pos=lambda_pos,
            vespo_k_neg=k_neg,
            vespo_lambda_neg=lambda_neg,
            steps_per_generation=case.steps_per_generation,
            entropy_target=0.9,
            entropy_coef_delta=0.02,
            entropy_coef_min=0.0,
            entropy_coef_max=0.05,
        )

    def feed(self, logprob: torch.Tensor, entropy: torch.Tensor) -> None:
        self._logprob, self._entropy = logprob, entropy

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        assert logits_to_keep == self._logprob.shape[1] and compute_entropy and not compute_aux_loss
        assert all(value is None for value in multimodal.values())
        return self._logprob, self._entropy, None


#: vllm_importance_sampling_clip_min / _max of the cases (the data's ratios lie in [0.5, 1.5]).
VLLM_CLIP = (0.8, 1.3)


def trl_importance_sampling_ratio(mode: str, data: dict) -> torch.Tensor:
    """The ratio TRL's ``_generate_and_score_completions`` puts in the inputs (its formula; TRL's own code for it
    runs in ``test_trl_integration.py``): ``exp`` of the masked log-ratio old - sampling (summed per row in the
    sequence modes), clipped to ``VLLM_CLIP`` (truncate) or 0 outside it (mask). In float64 (TRL computes it once,
    at generation)."""
    diff = torch.nan_to_num((data["old"].double() - data["sampling"].double()) * data["mask"], nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    low, high = VLLM_CLIP
    if mode.endswith("truncate"):
        return ratio.clamp(low, high)
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def make_inputs(data: dict, dtype: torch.dtype, case: Case) -> dict:
    b, t = data["lp"].shape
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
    if case.vllm_mode is not None:
        inputs["sampling_per_token_logps"] = data["sampling"].to(dtype)
        inputs["importance_sampling_ratio"] = trl_importance_sampling_ratio(case.vllm_mode, data).to(dtype)
    return inputs


def run(loss_fn, case: Case, data: dict, dtype: torch.dtype, trainer: FakeTrainer | None = None) -> dict:
    """``loss_fn(trainer, model, inputs)`` on ``data`` in ``dtype``: loss, gradients (log-probs, entropies) and the
    last value of each logged metric."""
    lp = data["lp"].to(dtype).clone().requires_grad_(True)
    ent = data["entropy"].to(dtype).clone().requires_grad_(True)
    trainer = trainer or FakeTrainer(case, data["max_completion_length"])
    trainer.feed(lp, ent)
    loss = loss_fn(trainer, types.SimpleNamespace(), make_inputs(data, dtype, case))
    loss.backward()
    mode = "train" if case.training else "eval"
    metrics = {name: values[-1] for name, values in trainer._metrics[mode].items()}
    grad_ent = ent.grad if ent.grad is not None else torch.zeros_like(ent)
    return {"loss": loss.detach(), "grad": lp.grad, "grad_entropy": grad_ent, "metrics": metrics, "trainer": trainer}


def run_trl(case: Case, data: dict, dtype: torch.dtype, trainer: FakeTrainer | None = None) -> dict:
    return run(GRPOTrainer._compute_loss, case, data, dtype, trainer)


def run_rlk(case: Case, data: dict, dtype: torch.dtype, trainer: FakeTrainer | None = None) -> dict:
    """The adapter on the reference backend (CPU)."""
    return run(rlk_trl.compute_loss, case, data, dtype, trainer)


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------


def make_data(
    b: int = 6,
    t: int = 9,
    seed: int = 0,
    *,
    ragged: bool = True,
    spread: float = 1.5,
    noise: float = 0.3,
    positive_adv: bool = False,
) -> dict:
    """float32 values: right-padded rows (row 0 full; with ``ragged`` row 2 empty), mixed-sign
    advantages (row 3 zero), log-ratios around 0 with some at +-``spread`` (far outside the clip
    ranges), an int completion mask as TRL builds it, ``num_items_in_batch`` of two micro-batches
    plus a few tokens, and ``max_completion_length`` past the padded length. Some reference
    log-probs lie 3 above the policy's (k3 of about 16). ``noise``: the spread of the other log-ratios."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 4 - 0.05
    old = lp + noise * torch.randn(b, t, generator=g)
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
    data = {
        "lp": lp,
        "old": old,
        "ref": ref,
        "adv": adv,
        "mask": mask,
        "entropy": torch.rand(b, t, generator=g) * 2,
        "num_items": 2 * int(mask.sum()) + 5,
        "max_completion_length": t + 3,
    }
    return with_vllm_ratio(data, torch.rand(b, t, generator=g) + 0.5)


def with_vllm_ratio(data: dict, ratio: torch.Tensor) -> dict:
    """vLLM's sampling log-probs that make ``exp(old - sampling)`` equal ``ratio``."""
    data["sampling"] = data["old"] - torch.log(ratio)
    return data


def vespo_data(seed: int) -> dict:
    """make_data with log-ratios of a few hundredths (sequence ratios near 1, where vespo's weight is not ~0),
    vLLM ratios within 10% of 1 and one of 2 (TRL's token_mask: weight 0, log 0 -> the lower clamp)."""
    data = make_data(seed=seed, spread=0.1, noise=0.03)
    ratio = torch.exp(data["old"] - data["sampling"])
    ratio = 1.0 + 0.2 * (ratio - 1.0)
    ratio[4, 0] = 2.0
    return with_vllm_ratio(data, ratio)


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


def expected_metrics(case: Case) -> set[str]:
    """The TRL names the adapter must log in this case (module docstring)."""
    names = {"entropy"}
    if case.beta != 0.0:
        names.add("kl")
    if case.loss_type in rlk_trl.PPO_FAMILY and case.level == "token":
        names.add("clip_ratio/region_mean")
    if case.entropy_coef != 0.0 or case.adaptive_entropy:
        names |= {"policy_loss"} | ({"entropy_coef"} if case.training else set())
    return names


def compare_metrics(case: Case, got: dict, want: dict, tol: dict) -> None:
    """Every metric the adapter logs under a TRL name equals TRL's (and the expected ones are there)."""
    shared = {name for name in got if not name.startswith("rlk/")}
    assert shared == expected_metrics(case), (case, sorted(shared))
    assert shared <= set(want), (case, sorted(shared - set(want)))
    for name in sorted(shared):
        t = _FRACTION if name.startswith("clip_ratio") else tol  # TRL counts clipped tokens as float32
        torch.testing.assert_close(
            torch.tensor(float(got[name]), dtype=torch.float64),
            torch.tensor(float(want[name]), dtype=torch.float64),
            **t,
            msg=lambda m, n=name: f"{case} {n}: {m}",
        )


def compare(case: Case, data: dict, dtype: torch.dtype) -> tuple[dict, dict]:
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
    compare_metrics(case, got["metrics"], want["metrics"], metric_tol)
    return got, truth


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------

GSPO = {"epsilon": 3e-4, "epsilon_high": 4e-4}
NO_BC = {"bias_correction_kl": False}
CASES = [
    Case("grpo"),
    Case("grpo", beta=0.04, accum=2),
    Case("grpo", beta=0.04, accum=2, **NO_BC),
    Case("grpo", delta=3.0, beta=0.04),
    Case("grpo", training=False, accum=4),
    Case("bnpo"),
    Case("bnpo", delta=3.0, accum=3, beta=0.04, **NO_BC),
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
    Case("vespo"),
    Case("vespo", beta=0.04, accum=2, steps_per_generation=2),
    Case("vespo", vespo=(1.0, 0.5, 6.0, -1.0), training=False),  # lambda_neg clamped to 1e-4 by TRL
    Case("vespo", level="sequence", beta=0.04, **NO_BC),  # vespo ignores the level (TRL warns)
    # sequence-level importance sampling (GSPO) -> rlk loss="gspo"
    Case("grpo", level="sequence", **GSPO),
    Case("grpo", level="sequence", beta=0.04, accum=2, **GSPO, **NO_BC),
    Case("bnpo", level="sequence", **GSPO),
    Case("dr_grpo", level="sequence", **GSPO),
    Case("dapo", level="sequence", accum=2, steps_per_generation=2, **GSPO),
    Case("luspo", level="sequence", **GSPO),
    Case("luspo", level="sequence", epsilon=0.2),
    # entropy bonus: a second rlk call (gpg, zero advantages)
    Case("bnpo", entropy_coef=0.01),
    Case("bnpo", entropy_coef=0.05, beta=0.04, accum=3),
    Case("grpo", entropy_coef=0.05, accum=2),
    Case("dapo", entropy_coef=0.05, epsilon_high=0.28, accum=2, steps_per_generation=2),
    Case("vespo", entropy_coef=0.05, training=False),
    Case("grpo", entropy_coef=0.05, top_entropy_quantile=0.5),
    # policy-term masks / weights -> importance_weights (vespo: the ratio in its sequence weight, masks on A)
    Case("bnpo", top_entropy_quantile=0.5, beta=0.04),
    Case("dapo", off_policy_mask_threshold=0.05, beta=0.04),
    Case(
        "grpo", vllm_mode="token_truncate", top_entropy_quantile=0.3, off_policy_mask_threshold=0.05, beta=0.04, accum=2
    ),
    Case("sapo", vllm_mode="token_mask"),
    Case("cispo", epsilon_high=5.0, vllm_mode="sequence_truncate", top_entropy_quantile=0.5),
    Case("dapo", vllm_mode="sequence_mask", beta=0.04),
    Case("grpo", level="sequence", vllm_mode="sequence_truncate", **GSPO),
    Case("vespo", vllm_mode="token_truncate"),
    Case("vespo", vllm_mode="token_mask", top_entropy_quantile=0.5, off_policy_mask_threshold=0.05, beta=0.04),
]


def case_data(case: Case) -> dict:
    seed = zlib.crc32(str(case).encode()) % 1000
    data = vespo_data(seed) if case.loss_type == "vespo" else make_data(seed=seed)
    if case.off_policy_mask_threshold is not None:  # row 1 (A < 0) drifted far: TRL's mask drops it
        data["old"][1] += 2.0
    return data


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_trl_compute_loss(case, dtype):
    """TRL's loss, gradients and metrics equal the adapter's on a batch with an empty row, ragged rows and a zero
    advantage."""
    data = case_data(case)
    got, truth = compare(case, data, dtype)
    assert float(truth["grad"].abs().sum()) > 0
    assert torch.all(truth["grad"][2] == 0) and torch.all(got["grad"][2] == 0)  # the empty row


def test_the_masks_and_weights_are_not_trivial():
    """The cases above exercise TRL's masks: the entropy mask drops some tokens (not all), the off-policy mask a
    sequence with tokens, and vespo's weight is neither ~0 nor ~1 on its data."""
    case = Case("grpo", vllm_mode="token_mask", top_entropy_quantile=0.3, off_policy_mask_threshold=0.05)
    data = case_data(case)
    trainer = FakeTrainer(case, data["max_completion_length"])
    m = data["mask"]
    kept = trainer.get_high_entropy_mask(data["entropy"], m, 0.7)
    assert 0 < int(kept.sum()) < int(m.sum())
    keep = trainer.get_off_policy_mask(data["adv"][:, None], data["lp"], data["old"], m, 0.05)
    assert not bool(keep[m.bool().any(-1)].all())
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        ratio = trl_importance_sampling_ratio(mode, data)
        assert bool((ratio[m.bool().any(-1)] != 1.0).any())
        assert bool((ratio == 0.0).any()) == mode.endswith("mask")
    data = case_data(Case("vespo", vllm_mode="token_mask"))
    phi = GRPOTrainer.get_gamma_weights(
        data["adv"][:, None], data["lp"] - data["old"], data["mask"], trl_importance_sampling_ratio("token_mask", data)
    )
    live = phi[data["mask"].bool().any(-1)]
    assert 0.3 < float(live.max()) and float(live.min()) < 0.1  # the masked vLLM ratio (row 4) sends it to ~0


@pytest.mark.parametrize("case", [c for c in CASES if c.level == "sequence"] + CASES[:3], ids=str)
def test_trl_full_rows(case):
    """Rows all of full length: TRL's clip ratio at the sequence level (a mean over sequences) then equals rlk's
    token mean ``rlk/clip_fraction``; and it is not trivially 0 or 1."""
    data = make_data(seed=11, ragged=False, spread=0.4)
    got, truth = compare(case, data, torch.float64)
    if case.loss_type in rlk_trl.PPO_FAMILY:
        torch.testing.assert_close(
            got["metrics"]["rlk/clip_fraction"], truth["metrics"]["clip_ratio/region_mean"], **_FRACTION
        )
        if case.level == "token" or case.eps_low < 0.01:  # sequence ratios stay inside +-0.2 here
            assert 0.0 < float(got["metrics"]["rlk/clip_fraction"]) < 1.0


def test_trl_metrics_not_trivial():
    """The clip and KL metrics compared above are neither all-zero nor all-one on the test batch."""
    data = make_data(seed=3)
    got, _ = compare(Case("dapo", epsilon_high=0.28, beta=0.04), data, torch.float64)
    assert 0.0 < float(got["metrics"]["clip_ratio/region_mean"]) < 1.0
    assert float(got["metrics"]["kl"]) > 0.0


def test_trl_cispo_clip_ratio():
    """TRL's cispo_clip_ratio counts capped tokens with A > 0 only: equal to rlk's clip_fraction when every
    advantage is positive, at most it otherwise (and here strictly less)."""
    case = Case("cispo", epsilon_high=1.28)
    data = make_data(seed=4, positive_adv=True)
    got, want = compare(case, data, torch.float64)
    assert 0.0 < want["metrics"]["cispo_clip_ratio"] < 1.0
    assert float(got["metrics"]["rlk/clip_fraction"]) == pytest.approx(want["metrics"]["cispo_clip_ratio"], rel=1e-12)
    data = make_data(seed=4)
    got, want = compare(case, data, torch.float64)
    assert want["metrics"]["cispo_clip_ratio"] < float(got["metrics"]["rlk/clip_fraction"])


@pytest.mark.parametrize("loss_type", rlk_trl.LOSS_TYPES)
def test_trl_all_masked(loss_type):
    """A micro-batch without any completion token: loss 0, zero gradients and no NaN on both sides."""
    data = make_data(seed=5)
    data["mask"] = torch.zeros_like(data["mask"])
    data["num_items"] = 0
    case = Case(
        loss_type,
        beta=0.04,
        entropy_coef=0.01 if loss_type == "bnpo" else 0.0,
        epsilon_high=5.0 if loss_type == "cispo" else None,
    )
    got, truth = compare(case, data, torch.float64)
    for side in (got, truth):
        assert float(side["loss"]) == 0.0
        assert torch.all(side["grad"] == 0) and torch.all(side["grad_entropy"] == 0)


def test_trl_adaptive_entropy():
    """Adaptive entropy control over two optimizer steps of two micro-batches each: the coefficient applied, the
    coefficient's updates (up while the window's entropy is at or below the target, down above it), the losses
    and gradients equal TRL's."""
    case = Case("bnpo", adaptive_entropy=True, entropy_coef=0.01, accum=2)
    sides = {}
    for name, fn in (("trl", run_trl), ("rlk", run_rlk)):
        trainer = FakeTrainer(case, 12)
        steps = []
        for step, scale in enumerate((0.3, 0.3, 1.5, 1.5)):  # window entropies ~0.3 then ~1.5, target 0.9
            trainer.accelerator.sync_gradients = step % 2 == 1
            data = make_data(seed=20 + step)
            data["entropy"] = data["entropy"] * scale
            out = fn(case, data, torch.float64, trainer)
            steps.append((out["loss"], out["grad"], out["grad_entropy"], trainer.entropy_coef))
        sides[name] = (steps, dict(trainer._metrics["train"]))
    (trl_steps, trl_log), (rlk_steps, rlk_log) = sides["trl"], sides["rlk"]
    for (loss, grad, grad_ent, coef), (loss_r, grad_r, grad_ent_r, coef_r) in zip(trl_steps, rlk_steps):
        torch.testing.assert_close(loss_r, loss, **_TIGHT)
        torch.testing.assert_close(grad_r, grad, **_TIGHT)
        torch.testing.assert_close(grad_ent_r, grad_ent, **_TIGHT)
        assert coef_r == coef
    assert [s[3] for s in rlk_steps] == pytest.approx([0.01, 0.03, 0.03, 0.01], rel=1e-12)
    assert bool(rlk_steps[2][2].abs().sum() > 0) and bool(rlk_steps[0][2].abs().sum() == 0)  # gated: inf, then on
    assert rlk_log["entropy_coef"] == trl_log["entropy_coef"]


def test_trl_sapo_defaults():
    """rlk's default sapo_tau and vespo shape parameters are TRL's."""
    import rlk

    defaults = rlk.PolicyLossConfig()
    assert defaults.sapo_tau == (_TRL_DEFAULTS["sapo_temperature_pos"], _TRL_DEFAULTS["sapo_temperature_neg"])
    assert defaults.vespo_k == (_TRL_DEFAULTS["vespo_k_pos"], _TRL_DEFAULTS["vespo_k_neg"])
    assert defaults.vespo_lambda == (_TRL_DEFAULTS["vespo_lambda_pos"], _TRL_DEFAULTS["vespo_lambda_neg"])


def test_bias_correction_kl_is_straight_through_k3_with_the_detached_ratio():
    """TRL's use_bias_correction_kl (the default) multiplies k3 by the ratio r with its gradient; its gradient
    r (k3' + k3) = r (lp - ref) is rlk's kl="k3+" weighted by sg(r) (kl_unbiased): both cases above agree with
    TRL. Without the gradient through r (kl_unbiased with plain k3) the gradients differ by beta * w * k3 * r."""
    case = Case("bnpo", beta=0.04)
    data = make_data(seed=6)
    want = run_trl(case, data, torch.float64)
    got = run_rlk(case, data, torch.float64)
    torch.testing.assert_close(got["grad"], want["grad"], **_TIGHT)
    import rlk

    lp = data["lp"].double().clone().requires_grad_(True)
    mask = data["mask"].bool()
    kw = rlk_trl.policy_loss_kwargs(FakeTrainer(case, 12), data["mask"])
    kw.update(kl="k3")
    loss, _ = rlk.policy_loss(
        lp, data["old"].double(), data["adv"].double(), mask, ref_logprob=data["ref"].double(), **kw
    )
    loss.backward()
    torch.testing.assert_close(loss.detach(), want["loss"], **_TIGHT)
    d = data["lp"].double() - data["ref"].double()
    k3 = torch.exp(-d) - 1 + d
    ratio = torch.exp(data["lp"].double() - data["old"].double())
    w = mask.double() / float(kw["global_tokens"])
    torch.testing.assert_close(lp.grad + case.beta * w * k3 * ratio, want["grad"], **_TIGHT)
    assert not torch.allclose(lp.grad, want["grad"])


@pytest.mark.parametrize(
    "case, message",
    [
        (
            Case("cispo", level="sequence", epsilon_high=5.0),
            "importance_sampling_level='sequence' with loss_type='cispo'",
        ),
        (Case("sapo", level="sequence"), "importance_sampling_level='sequence' with loss_type='sapo'"),
        (Case("grpo", level="sequence", delta=3.0), "delta with importance_sampling_level='sequence'"),
        (Case("dapo", delta=1.1, epsilon_high=0.28), "delta=1.1: rlk's dual clip equals"),
        (Case("grpo", level="sequence", beta=0.04), "use_bias_correction_kl=True with importance_sampling_level"),
        (Case("ppo"), "loss_type: expected one of"),
    ],
)
def test_unsupported_configurations_are_refused(case, message):
    """What rlk cannot compute exactly raises, naming the TRL option (module docstring); TRL itself runs them."""
    data = make_data(seed=7)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_rlk(case, data, torch.float64)
    if case.loss_type != "ppo":
        run_trl(case, data, torch.float64)
