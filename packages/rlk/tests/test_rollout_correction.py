"""``rlk.rollout_correction`` on the reference backend: against TRL's and verl's own code, an independent fp64
re-derivation, the fp64 ground truth under the contract, edge cases, bad input, torch.library integration.

* TRL (trl 1.16.0): the importance-sampling correction lives inline in
  ``GRPOTrainer._generate_and_score_completions``; the tests call that method unbound on a small fake trainer
  (:class:`FakeTRLTrainer`) whose generation returns the test's rollout log-probs and whose log-prob pass
  returns its training log-probs, and read the ratio it returns and the metrics it logs.
* verl (verl 0.9.1): ``verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_rejection_mask``,
  called directly; these tests carry the ``verl`` marker (CI runs them in the environment of
  ``ci/install_verl_env.sh``, where ``RLK_REQUIRE_VERL=1`` makes verl's absence an error).
"""

from __future__ import annotations

import collections
import math
import os
import types

import pytest
import torch

import rlk
from rlk.core import abi, contract
from rlk.reference import rollout_correction as ref

ENTRY = contract.entry("rollout_correction", torch.float32)
INF = math.inf
#: float64 against float64: the same sums in another order.
TIGHT = {"rtol": 1e-12, "atol": 1e-14}
SETTINGS = [
    {"level": "token", "mode": "truncate", "upper": 2.0},
    {"level": "token", "mode": "truncate", "upper": 1.3, "lower": 0.8},
    {"level": "token", "mode": "mask", "upper": 1.5, "lower": 0.6},
    {"level": "token", "mode": "mask", "upper": None, "lower": 0.7, "clamp_log_ratio": None},
    {"level": "sequence", "mode": "truncate", "upper": 2.0},
    {"level": "sequence", "mode": "truncate", "upper": None, "lower": 0.5, "clamp_log_ratio": 3.0},
    {"level": "sequence", "mode": "mask", "upper": 3.0, "lower": 0.5},
    {"level": "sequence", "mode": "mask", "upper": 1.5, "lower": None, "clamp_log_ratio": None},
]


def _ids(setting: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in setting.items())


def make_inputs(b: int, t: int, seed: int = 0, spread: float = 0.3, empty_row: bool = True) -> dict:
    """fp32 ``[B, T]`` log-probs (the rollout's within ``spread`` of the training engine's, a few far off both
    ways), a ragged mask with holes (row 0 full, row 3 empty when ``b >= 4`` and ``empty_row``)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 4 - 0.05
    roll = old + spread * torch.randn(b, t, generator=g) + 0.05 * torch.randn(b, 1, generator=g)  # a row bias
    roll[:, ::8] = old[:, ::8] + 1.2  # in pairs: a row's sum stays near 0
    roll[:, 1::8] = old[:, 1::8] - 1.2
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if b > 1:
        mask[1::2] &= torch.rand(mask[1::2].shape, generator=g) > 0.15
    if b >= 4 and empty_row:
        mask[3] = False
    return {"old": old, "roll": roll, "mask": mask}


def spread_of(setting: dict) -> float:
    """Rollout noise that puts ratios on both sides of the thresholds: per token, or per row sum."""
    return 0.3 if setting.get("level", "token") == "token" else 0.2


def primitive_attrs(setting: dict) -> dict:
    """The primitive's attributes of a public-op setting (None bounds as the sentinels)."""
    upper, lower = setting.get("upper", 2.0), setting.get("lower")
    clamp = setting.get("clamp_log_ratio", 20.0)
    return {
        "level": setting.get("level", "token"),
        "mode": setting.get("mode", "truncate"),
        "upper": INF if upper is None else upper,
        "lower": 0.0 if lower is None else lower,
        "clamp": INF if clamp is None else clamp,
    }


def run(x: dict, setting: dict, dtype=torch.float32):
    with rlk.use_backend("reference"):
        return rlk.rollout_correction(x["old"].to(dtype), x["roll"].to(dtype), x["mask"], **setting)


def check_contract(x: dict, setting: dict, weights: torch.Tensor, metrics: dict) -> None:
    """fp32 outputs against the fp64 reference on the same values, under the contract."""
    truth_w, truth_m = run(x, setting, torch.float64)
    scale = ref.contract_scale(x["old"].double(), x["roll"].double(), x["mask"], **primitive_attrs(setting))
    dev = contract.compare_outputs(
        ENTRY, "weights", weights.reshape(-1), truth_w.reshape(-1), scale["weights"].reshape(-1)
    )
    assert dev.ok, dev
    for i, name in enumerate(abi.CORRECTION_METRICS):
        dev = contract.compare_outputs(
            ENTRY, name, metrics[name].reshape(1), truth_m[name].reshape(1), scale["metrics"][i].reshape(1)
        )
        assert dev.ok, dev


# ----------------------------------------------------------------------------------------------
# an independent re-derivation: fp64 Python floats, loops, written from the formulas
# ----------------------------------------------------------------------------------------------


def _clamp(x: float, c: float) -> float:
    return max(-c, min(c, x))


def rederive(old, roll, mask, *, level="token", mode="truncate", upper=2.0, lower=None, clamp_log_ratio=20.0):
    """Weights (list of rows) and every metric, from the docstring of ``rlk.reference.rollout_correction``."""
    hi = INF if upper is None else upper
    lo = 0.0 if lower is None else lower
    c = INF if clamp_log_ratio is None else clamp_log_ratio
    low_threshold = lower if lower is not None else (1.0 / upper if upper is not None else 0.0)
    old, roll, mask = old.tolist(), roll.tolist(), mask.tolist()
    weights, tok, rows = [], collections.defaultdict(list), collections.defaultdict(list)
    for o_row, q_row, m_row in zip(old, roll, mask):
        toks = [t for t, keep in enumerate(m_row) if keep]
        d = {t: (0.0 if math.isnan(o_row[t] - q_row[t]) else o_row[t] - q_row[t]) for t in toks}
        s = math.fsum(d.values())
        s = 0.0 if math.isnan(s) else s
        row_w = [0.0] * len(m_row)
        ws, rs, clipped = [], [], False
        for t in toks:
            r = math.exp(_clamp(s if level == "sequence" else d[t], c))
            w = min(max(r, lo), hi) if mode == "truncate" else (r if lo <= r <= hi else 0.0)
            row_w[t] = w
            ws.append(w)
            rs.append(r)
            clipped |= w != r
            dc = _clamp(d[t], c)
            raw = o_row[t] - q_row[t]
            tok["w"].append(w)
            tok["r"].append(r)
            tok["d"].append(d[t])
            tok["k3"].append(math.exp(dc) - dc - 1.0)
            tok["chi2"].append(math.exp(dc) ** 2 - 1.0)
            tok["clipped"].append(float(w != r))
            if not math.isnan(raw):
                tok["abs"].append(abs(raw))
        weights.append(row_w)
        if toks:
            n = len(toks)
            log_old = math.fsum(o_row[t] for t in toks) / n
            rows["w"].append(math.fsum(ws) / n)
            rows["r"].append(math.fsum(rs) / n)
            rows["clipped"].append(float(clipped))
            rows["chi2"].append(math.exp(2.0 * _clamp(s, c)) - 1.0)
            rows["log_old"].append(log_old)
            rows["log_diff"].append(s / n)

    def mean(xs):
        return math.fsum(xs) / len(xs) if xs else 0.0

    def std(xs, ddof):
        if len(xs) <= ddof:
            return 0.0
        mu = mean(xs)
        return math.sqrt(math.fsum((x - mu) ** 2 for x in xs) / (len(xs) - ddof))

    w, r = tok["w"], tok["r"]
    mean_sq = mean([x * x for x in w])
    metrics = {
        "weight_mean": mean(w),
        "weight_max": max(w, default=0.0),
        "weight_min": min(w, default=0.0),
        "weight_std": std(w, 0),
        "ess": mean(w) ** 2 / mean_sq if mean_sq > 0 else 0.0,
        "ratio_max": max(r, default=0.0),
        "ratio_min": min(r, default=0.0),
        "fraction_high": mean([float(x > hi) for x in r]),
        "fraction_low": mean([float(x < low_threshold) for x in r]),
        "clipped_fraction": mean(tok["clipped"]),
        "abs_log_ratio_mean": mean(tok["abs"]),
        "abs_log_ratio_max": max(tok["abs"], default=0.0),
        "kl": -mean(tok["d"]),
        "k3_kl": mean(tok["k3"]),
        "chi2_token": mean(tok["chi2"]),
        "tokens": float(len(w)),
    }
    sw, lo_, ld = rows["w"], rows["log_old"], rows["log_diff"]
    metrics |= {
        "seq_weight_mean": mean(sw),
        "seq_weight_max": max(sw, default=0.0),
        "seq_weight_min": min(sw, default=0.0),
        "seq_weight_std": std(sw, 1),
        "seq_weight_max_deviation": max((abs(x - 1.0) for x in sw), default=0.0),
        "seq_fraction_high": mean([float(x > hi) for x in rows["r"]]),
        "seq_fraction_low": mean([float(x < low_threshold) for x in rows["r"]]),
        "seq_clipped_fraction": mean(rows["clipped"]),
        "chi2_seq": mean(rows["chi2"]),
        "training_ppl": mean([math.exp(-x) for x in lo_]),
        "training_log_ppl": mean([-x for x in lo_]),
        "rollout_ppl": mean([math.exp(b - a) for a, b in zip(lo_, ld)]),
        "rollout_log_ppl": mean([b - a for a, b in zip(lo_, ld)]),
        "log_ppl_diff": mean([-x for x in ld]),
        "log_ppl_abs_diff": mean([abs(x) for x in ld]),
        "log_ppl_diff_max": max((-x for x in ld), default=0.0),
        "log_ppl_diff_min": min((-x for x in ld), default=0.0),
        "ppl_ratio": mean([math.exp(-x) for x in ld]),
        "sequences": float(len(sw)),
    }
    return weights, metrics


@pytest.mark.parametrize("setting", SETTINGS, ids=_ids)
@pytest.mark.parametrize("shape", [(1, 1), (1, 17), (6, 23)])
def test_matches_rederivation_fp64(setting, shape):
    x = make_inputs(*shape, seed=0, spread=spread_of(setting))
    weights, metrics = run(x, setting, torch.float64)
    want_w, want_m = rederive(x["old"].double(), x["roll"].double(), x["mask"], **setting)
    torch.testing.assert_close(weights, torch.tensor(want_w, dtype=torch.float64), **TIGHT)
    assert set(metrics) == set(abi.CORRECTION_METRICS) == set(want_m)
    for name in abi.CORRECTION_METRICS:
        torch.testing.assert_close(metrics[name], torch.tensor(want_m[name], dtype=torch.float64), **TIGHT, msg=name)


def test_the_cases_are_not_trivial():
    """The settings above truncate or mask some tokens but not all (rows at the sequence level), on both sides."""
    for setting in SETTINGS:
        x = make_inputs(6, 23, seed=0, spread=spread_of(setting))
        _, metrics = run(x, setting, torch.float64)
        assert 0 < float(metrics["clipped_fraction"]) < 1, setting
        if setting["level"] == "sequence":
            assert 0 < float(metrics["seq_clipped_fraction"]) < 1, setting
    _, metrics = run(make_inputs(6, 23, seed=0), SETTINGS[2], torch.float64)
    assert float(metrics["fraction_high"]) > 0 and float(metrics["fraction_low"]) > 0


@pytest.mark.parametrize("setting", SETTINGS, ids=_ids)
@pytest.mark.parametrize("shape", [(1, 61), (7, 300), (33, 128)])
def test_float32_against_the_float64_ground_truth(setting, shape):
    x = make_inputs(*shape, seed=sum(shape), spread=0.3 if setting["level"] == "token" else 0.02)
    weights, metrics = run(x, setting)
    assert weights.dtype == torch.float32 and all(v.dtype == torch.float32 and v.dim() == 0 for v in metrics.values())
    check_contract(x, setting, weights, metrics)


# ----------------------------------------------------------------------------------------------
# TRL: GRPOTrainer._generate_and_score_completions on a fake trainer
# ----------------------------------------------------------------------------------------------


class _IdentityAccelerator:
    device = torch.device("cpu")
    process_index = 0
    num_processes = 1

    def gather(self, x):
        return x

    def unwrap_model(self, model):
        return model


class FakeTRLTrainer:
    """What ``_generate_and_score_completions`` reads, for one process without tools, images or a reference
    model: ``_generate`` returns the completions of the test's mask with the rollout log-probs (None where NaN,
    as vLLM reports an unscored token), ``_get_per_token_logps_and_entropies`` the training log-probs."""

    def __init__(self, old, roll, mask, *, mode, clip_max, clip_min):
        b = old.shape[0]
        self.accelerator = _IdentityAccelerator()
        self.model = types.SimpleNamespace(training=True, is_gradient_checkpointing=False)
        self.args = types.SimpleNamespace(
            steps_per_generation=1,
            num_iterations=1,
            gradient_accumulation_steps=1,
            per_device_train_batch_size=b,
            gradient_checkpointing_kwargs=None,
        )
        self.environment_factories, self.tools, self.environments = None, [], []
        self._tokenizer = types.SimpleNamespace(pad_token_id=0)
        self.pad_to_multiple_of, self.mask_truncated_completions, self.log_multimodal = None, False, False
        self.use_vllm, self.vllm_importance_sampling_correction = True, True
        self.vllm_importance_sampling_mode = mode
        self.vllm_importance_sampling_clip_max, self.vllm_importance_sampling_clip_min = clip_max, clip_min
        self.beta, self.num_iterations, self.num_generations, self.num_generations_eval = 0.0, 1, b, b
        self.multi_objective_aggregation, self.scale_rewards = "sum_then_normalize", "group"
        self.reward_weights, self.reward_func_names = torch.ones(1), ["reward"]
        self._metrics = {"train": collections.defaultdict(list)}
        self._logs = {
            "prompt": [],
            "completion": [],
            "rewards": collections.defaultdict(list),
            "advantages": [],
            "extra": collections.defaultdict(list),
            "images": [],
        }
        self._pending_extra_logs, self._pending_metrics = {}, {}
        # completions: each row up to its last mask token; the holes before it become TRL's tool mask
        self._lengths = [int(row.nonzero().max()) + 1 if bool(row.any()) else 0 for row in mask]
        self._old, self._roll, self._mask = old, roll, mask

    def _generate(self, prompts):
        logps = [
            [None if math.isnan(v) else v for v in self._roll[i, :n].tolist()] for i, n in enumerate(self._lengths)
        ]
        tool_mask = [self._mask[i, :n].long().tolist() for i, n in enumerate(self._lengths)]
        completions = [[1] * n for n in self._lengths]
        b = len(prompts)
        return [[5, 6]] * b, completions, tool_mask, ["text"] * b, logps, {}, None, None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return self._old[:, :logits_to_keep], None, None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        return torch.arange(len(prompts), dtype=torch.float64)[:, None]


def _trl():
    try:
        from trl.trainer.grpo_trainer import GRPOTrainer
    except ImportError as err:  # pragma: no cover - depends on the environment
        if os.environ.get("RLK_REQUIRE_TRL", "0") not in ("", "0"):
            raise
        pytest.skip(f"trl is not installed ({err}); set RLK_REQUIRE_TRL=1 to make this an error")
    return GRPOTrainer


def run_trl(x: dict, mode: str, clip_max, clip_min) -> tuple[torch.Tensor, dict]:
    """TRL's importance-sampling ratio ``[B, T]`` (broadcast at the sequence level) and logged metrics, float64.

    TRL builds the rollout log-prob tensor with ``torch.tensor`` (the default dtype): float64 for the call."""
    trainer_cls = _trl()
    b, t = x["old"].shape
    old = x["old"].double()
    fake = FakeTRLTrainer(old, x["roll"].double(), x["mask"], mode=mode, clip_max=clip_max, clip_min=clip_min)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = trainer_cls._generate_and_score_completions(fake, [{"prompt": "p"}] * b)
    finally:
        torch.set_default_dtype(default)
    width = out["completion_mask"].shape[1]
    ratio = torch.ones(b, t, dtype=torch.float64)
    ratio[:, :width] = out["importance_sampling_ratio"].expand(b, width)
    metrics = {
        k.removeprefix("sampling/"): v[-1] for k, v in fake._metrics["train"].items() if k.startswith("sampling/")
    }
    return ratio, metrics


#: TRL's modes, with its (clip_max, clip_min).
TRL_CASES = [
    ("token_truncate", 3.0, None),
    ("token_truncate", 1.2, 0.9),
    ("token_mask", 1.3, 0.8),
    ("token_mask", None, 0.8),
    ("sequence_truncate", 2.0, 0.5),
    ("sequence_truncate", 1.5, None),
    ("sequence_mask", 3.0, 0.5),
    ("sequence_mask", 1.2, None),
]


def trl_setting(mode: str, clip_max, clip_min) -> dict:
    level, kind = mode.split("_")
    return {"level": level, "mode": kind, "upper": clip_max, "lower": clip_min, "clamp_log_ratio": None}


def trl_inputs(mode: str, seed: int, empty_row: bool) -> dict:
    x = make_inputs(6, 19, seed=seed, spread=0.3 if mode.startswith("token") else 0.2, empty_row=empty_row)
    x["roll"][1, 2] = math.nan  # a token vLLM could not score: TRL's ratio is 1 there
    x["mask"][1, 2] = True
    return x


def _check_trl(x: dict, case: tuple, dtype: torch.dtype) -> None:
    mode = case[0]
    setting = trl_setting(*case)
    trl_ratio, trl_metrics = run_trl(x, *case)
    weights, metrics = run(x, setting, dtype)
    m = x["mask"]
    assert torch.equal(weights[~m], torch.zeros_like(weights[~m]))
    rows = m.any(dim=1)
    pre = "" if mode.startswith("token") else "seq_"
    ours = {
        "sampling_logp_difference/mean": "abs_log_ratio_mean",
        "sampling_logp_difference/max": "abs_log_ratio_max",
        "importance_sampling_ratio/min": pre + "weight_min",
        "importance_sampling_ratio/mean": pre + "weight_mean",
        "importance_sampling_ratio/max": pre + "weight_max",
    }
    assert set(trl_metrics) == set(ours)
    if dtype == torch.float64:
        torch.testing.assert_close(weights[m], trl_ratio[m], **TIGHT)
        for theirs, name in ours.items():
            if pre and name.endswith("_mean") and not bool(rows.all()):
                continue  # TRL's sequence mean counts the empty rows: test_trl_sequence_metrics_count_empty_rows
            torch.testing.assert_close(
                metrics[name], torch.tensor(trl_metrics[theirs], dtype=torch.float64), **TIGHT, msg=name
            )
    else:  # float32 rlk against TRL in float64 on the same values, under the contract
        scale = ref.contract_scale(x["old"].double(), x["roll"].double(), m, **primitive_attrs(setting))
        dev = contract.compare_outputs(ENTRY, "weights", weights[m], trl_ratio[m], scale["weights"][m])
        assert dev.ok, dev


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", TRL_CASES, ids=lambda c: f"{c[0]}-max={c[1]}-min={c[2]}")
def test_trl_importance_sampling_correction(case, dtype):
    """Every TRL mode, with and without clip_min, a NaN rollout log-prob on the mask and holes in it (TRL's tool
    mask); the token modes with an empty row too."""
    x = trl_inputs(case[0], seed=7, empty_row=case[0].startswith("token"))
    _check_trl(x, case, dtype)


def test_trl_cases_are_not_trivial():
    for case in TRL_CASES:
        x = trl_inputs(case[0], seed=7, empty_row=False)
        weights, metrics = run(x, trl_setting(*case), torch.float64)
        pre = "" if case[0].startswith("token") else "seq_"
        assert float(metrics[pre + "clipped_fraction"]) > 0, case
        assert float(metrics[pre + "weight_max"]) > float(metrics[pre + "weight_min"]), case
    trl_ratio, _ = run_trl(trl_inputs("token_mask", 7, False), "token_mask", 1.3, 0.8)
    assert float(trl_ratio[1, 2]) == 1.0  # the unscored token


def test_trl_sequence_metrics_count_empty_rows():
    """TRL's sequence-level ratio statistics run over all B rows, an empty one with the weight of ratio 1; rlk's
    ``seq_weight_mean`` over the rows with tokens. The two means differ by exactly that row."""
    case = ("sequence_truncate", 1.5, 0.5)
    x = trl_inputs(case[0], seed=3, empty_row=True)
    _, trl_metrics = run_trl(x, *case)
    _, metrics = run(x, trl_setting(*case), torch.float64)
    b, s = x["mask"].shape[0], float(metrics["sequences"])
    assert s == b - 1
    empty_weight = min(max(1.0, 0.5), 1.5)
    want = (float(metrics["seq_weight_mean"]) * s + empty_weight) / b
    assert trl_metrics["importance_sampling_ratio/mean"] == pytest.approx(want, rel=1e-12)


# ----------------------------------------------------------------------------------------------
# verl: rollout_corr_helper.compute_rollout_correction_and_rejection_mask
# ----------------------------------------------------------------------------------------------


def _verl():
    """verl's helper (the tests using it carry the ``verl`` marker: deselected where verl does not import, an
    error there with ``RLK_REQUIRE_VERL=1``; CI runs them in the environment of ``ci/install_verl_env.sh``)."""
    from verl.trainer.ppo import rollout_corr_helper

    return rollout_corr_helper


#: verl's IS settings (rollout_is, rollout_is_threshold) and the rlk setting.
VERL_CASES = [
    ("token", 2.0, {"level": "token", "mode": "truncate", "upper": 2.0}),
    ("token", "0.5_1.4", {"level": "token", "mode": "mask", "lower": 0.5, "upper": 1.4}),
    ("sequence", 2.0, {"level": "sequence", "mode": "truncate", "upper": 2.0}),
    ("sequence", "0.5_5.0", {"level": "sequence", "mode": "mask", "lower": 0.5, "upper": 5.0}),
]
#: verl's metric names (without ``rollout_corr/``) that are rlk's under another name; the others are the same.
VERL_NAMES = {
    "rollout_is_mean": "weight_mean",
    "rollout_is_max": "weight_max",
    "rollout_is_min": "weight_min",
    "rollout_is_std": "weight_std",
    "rollout_is_eff_sample_size": "ess",
    "rollout_is_oob_ratio": "clipped_fraction",
    "rollout_is_ratio_fraction_high": "fraction_high",
    "rollout_is_ratio_fraction_low": "fraction_low",
    "rollout_is_seq_mean": "seq_weight_mean",
    "rollout_is_seq_std": "seq_weight_std",
    "rollout_is_seq_max": "seq_weight_max",
    "rollout_is_seq_min": "seq_weight_min",
    "rollout_is_seq_max_deviation": "seq_weight_max_deviation",
    "rollout_is_seq_fraction_high": "seq_fraction_high",
    "rollout_is_seq_fraction_low": "seq_fraction_low",
}
#: At the sequence level verl's max / min and fractions are of the raw sequence ratio over the rows.
VERL_SEQUENCE_NAMES = {
    "rollout_is_max": "ratio_max",
    "rollout_is_min": "ratio_min",
    "rollout_is_ratio_fraction_high": "seq_fraction_high",
    "rollout_is_ratio_fraction_low": "seq_fraction_low",
}
#: verl metrics that average over rows (verl counts empty rows in them, rlk does not).
VERL_ROW_METRICS = {
    "chi2_seq",
    "training_ppl",
    "training_log_ppl",
    "rollout_ppl",
    "rollout_log_ppl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
}
#: verl's masked means divide by (count + 1e-8), its ess by (mean + 1e-8)^2: relative differences up to ~1e-8 / mean.
VERL_TOL = {"rtol": 1e-7, "atol": 1e-12}


def run_verl(x: dict, rollout_is: str, threshold) -> tuple[torch.Tensor, dict]:
    helper = _verl()
    proto, mask, metrics = helper.compute_rollout_correction_and_rejection_mask(
        x["old"].double(), x["roll"].double(), x["mask"].double(), rollout_is=rollout_is, rollout_is_threshold=threshold
    )
    assert torch.equal(mask, x["mask"].double())  # no rejection sampling
    return proto.batch["rollout_is_weights"], {k.removeprefix("rollout_corr/"): v for k, v in metrics.items()}


def _verl_name(name: str, level: str) -> str:
    if level == "sequence" and name in VERL_SEQUENCE_NAMES:
        return VERL_SEQUENCE_NAMES[name]
    return VERL_NAMES.get(name, name)


@pytest.mark.verl
@pytest.mark.parametrize("empty_row", [False, True])
@pytest.mark.parametrize("case", VERL_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_verl_rollout_correction(case, empty_row):
    """Weights and every metric verl logs: all of them on rows with tokens; with an empty row, the token-level
    ones (verl's row statistics count the empty row, rlk's leave it out)."""
    rollout_is, threshold, setting = case
    x = make_inputs(6, 29, seed=11, spread=0.3 if rollout_is == "token" else 0.2, empty_row=empty_row)
    verl_w, verl_m = run_verl(x, rollout_is, threshold)
    weights, metrics = run(x, setting, torch.float64)
    torch.testing.assert_close(weights, verl_w, **TIGHT)
    compared = 0
    for theirs, value in verl_m.items():
        name = _verl_name(theirs, rollout_is)
        assert name in metrics, f"verl's {theirs} has no rlk counterpart"
        row_level = (
            name in VERL_ROW_METRICS
            or name.startswith("seq_")
            or (rollout_is == "sequence" and (name.startswith("ratio_")))
        )
        if empty_row and row_level:
            continue
        torch.testing.assert_close(metrics[name], torch.tensor(value, dtype=torch.float64), **VERL_TOL, msg=theirs)
        compared += 1
    assert compared >= (6 if empty_row else 27)


@pytest.mark.verl
def test_verl_cases_are_not_trivial():
    for rollout_is, threshold, setting in VERL_CASES:
        x = make_inputs(6, 29, seed=11, spread=0.3 if rollout_is == "token" else 0.2, empty_row=False)
        _, metrics = run(x, setting, torch.float64)
        assert 0 < float(metrics["clipped_fraction"]) < 1, (rollout_is, threshold)
        assert float(metrics["seq_weight_std"]) > 0


@pytest.mark.verl
def test_verl_float32_under_the_contract():
    rollout_is, threshold, setting = VERL_CASES[1]
    x = make_inputs(33, 64, seed=5)
    verl_w, _ = run_verl(x, rollout_is, threshold)
    weights, metrics = run(x, setting)
    scale = ref.contract_scale(x["old"].double(), x["roll"].double(), x["mask"], **primitive_attrs(setting))
    dev = contract.compare_outputs(
        ENTRY, "weights", weights.reshape(-1), verl_w.reshape(-1), scale["weights"].reshape(-1)
    )
    assert dev.ok, dev


# ----------------------------------------------------------------------------------------------
# edge cases
# ----------------------------------------------------------------------------------------------


GARBAGE = [math.nan, math.inf, -math.inf, 1e30]


@pytest.mark.parametrize("fill", GARBAGE)
@pytest.mark.parametrize("setting", SETTINGS, ids=_ids)
def test_masked_garbage_does_not_leak(setting, fill):
    """NaN / +-inf / huge values at masked-out positions of either input: bitwise the weights and metrics of the
    same call with 0 there."""
    x = make_inputs(6, 23, seed=2)
    clean = {k: v.clone() for k, v in x.items()}
    clean["old"][~x["mask"]] = 0.0
    clean["roll"][~x["mask"]] = 0.0
    want_w, want_m = run(clean, setting)
    for name in ("old", "roll"):
        dirty = {k: v.clone() for k, v in clean.items()}
        dirty[name][~x["mask"]] = fill
        weights, metrics = run(dirty, setting)
        assert torch.equal(weights, want_w)
        assert all(torch.equal(metrics[k], want_m[k]) for k in abi.CORRECTION_METRICS)


@pytest.mark.parametrize("setting", SETTINGS, ids=_ids)
def test_empty_mask_and_empty_batches(setting):
    x = make_inputs(3, 5, seed=1)
    x["mask"][:] = False
    for fill in (math.nan, -math.inf):
        x["roll"][:] = fill
        weights, metrics = run(x, setting)
        assert torch.equal(weights, torch.zeros(3, 5))
        assert all(float(metrics[k]) == 0.0 for k in abi.CORRECTION_METRICS)
    for shape in ((0, 5), (4, 0)):
        empty = {"old": torch.zeros(shape), "roll": torch.zeros(shape), "mask": torch.ones(shape, dtype=torch.bool)}
        weights, metrics = run(empty, setting)
        assert weights.shape == shape and all(float(metrics[k]) == 0.0 for k in abi.CORRECTION_METRICS)


@pytest.mark.parametrize("setting", SETTINGS, ids=_ids)
def test_extreme_log_ratios(setting):
    """Log-ratios of +-100 (one token, or a row's sum) and far beyond: finite weights, the clamp's or the
    threshold's value; with no clamp, exp's 0 and inf, which a bound takes or masks."""
    x = make_inputs(5, 13, seed=4)
    m = x["mask"]
    m[0, :3] = True
    x["roll"][0, 0] = x["old"][0, 0] - 100.0
    x["roll"][0, 1] = x["old"][0, 1] + 100.0
    x["roll"][0, 2] = x["old"][0, 2] - 1e30
    weights, metrics = run(x, setting)
    assert not bool(torch.isnan(weights).any())
    c = setting.get("clamp_log_ratio", 20.0)
    upper, lower = setting.get("upper", 2.0), setting.get("lower")
    if c is not None or upper is not None:  # else an inf weight makes the weight statistics inf or NaN
        assert all(not math.isnan(float(v)) for v in metrics.values())
        check_contract(x, setting, weights, metrics)
    else:  # exp(100) overflows float32: inf, its correctly rounded value
        assert float(weights[0, 0]) == INF
    if setting["level"] == "token":
        big, small = (math.exp(c), math.exp(-c)) if c is not None else (INF, 0.0)
        for t, r in ((0, big), (2, big), (1, small)):
            r32 = float(torch.tensor(r, dtype=torch.float32))
            if setting["mode"] == "truncate":
                want = min(max(r32, lower or 0.0), INF if upper is None else upper)
            else:
                want = r32 if (lower or 0.0) <= r32 <= (INF if upper is None else upper) else 0.0
            assert float(weights[0, t]) == pytest.approx(want, rel=1e-6), (t, r)


def test_non_finite_log_probs_on_the_mask():
    """On the mask: a NaN log-ratio (an unscored token, -inf - -inf) gives ratio 1; a rollout log-prob of -inf
    (ratio +inf) is clamped, or capped by upper without a clamp; never NaN."""
    x = make_inputs(2, 6, seed=0, empty_row=False)
    x["mask"][:] = True
    x["roll"][0, 0] = math.nan
    x["old"][0, 1] = -math.inf
    x["roll"][0, 1] = -math.inf
    x["roll"][0, 2] = -math.inf
    x["old"][0, 3] = -math.inf
    for clamp in (20.0, None):
        for mode in ("truncate", "mask"):
            weights, metrics = run(x, {"mode": mode, "upper": 3.0, "lower": 0.5, "clamp_log_ratio": clamp})
            assert float(weights[0, 0]) == 1.0 and float(weights[0, 1]) == 1.0
            assert float(weights[0, 2]) == (3.0 if mode == "truncate" else 0.0)
            assert float(weights[0, 3]) == (0.5 if mode == "truncate" else 0.0)
            assert float(metrics["abs_log_ratio_max"]) == INF  # +-inf log-ratios count, NaN ones do not
            assert not any(math.isnan(float(metrics[k])) for k in ("weight_mean", "weight_std", "ess", "ratio_min"))
            assert math.isnan(float(metrics["kl"]))  # the mean of +inf and -inf log-ratios: undefined
    weights, _ = run(x, {"level": "sequence", "upper": 3.0})
    assert torch.equal(weights[0], torch.ones(6))  # +inf and -inf in one row: the NaN sum counts as 0
    x["old"][0, 3] = 0.0
    weights, _ = run(x, {"level": "sequence", "upper": 3.0})
    assert torch.equal(weights[0], torch.full((6,), 3.0))  # an infinite sum: clamped, then truncated


def test_16_bit_inputs_are_upcast_exactly_and_float64_stays():
    x = make_inputs(4, 9, seed=6)
    for dtype in (torch.bfloat16, torch.float16):
        low = {"old": x["old"].to(dtype), "roll": x["roll"].to(dtype), "mask": x["mask"]}
        weights, metrics = run(low, SETTINGS[0])
        want_w, want_m = run({k: v.float() if v.is_floating_point() else v for k, v in low.items()}, SETTINGS[0])
        assert weights.dtype == torch.float32 and torch.equal(weights, want_w)
        assert all(torch.equal(metrics[k], want_m[k]) for k in abi.CORRECTION_METRICS)
    weights, metrics = run(x, SETTINGS[0], torch.float64)
    assert weights.dtype == torch.float64 and metrics["weight_mean"].dtype == torch.float64


def test_mask_dtypes_strides_and_no_gradient():
    x = make_inputs(4, 9, seed=8)
    want_w, want_m = run(x, SETTINGS[4])
    for mask in (x["mask"].float(), x["mask"].long(), x["mask"].to(torch.uint8) * 3):
        weights, metrics = run({**x, "mask": mask}, SETTINGS[4])
        assert torch.equal(weights, want_w) and all(torch.equal(metrics[k], want_m[k]) for k in abi.CORRECTION_METRICS)
    wide = {k: torch.stack([v, v], dim=-1)[..., 0] for k, v in x.items()}  # non-contiguous views
    assert not wide["old"].is_contiguous()
    weights, _ = run(wide, SETTINGS[4])
    assert torch.equal(weights, want_w)
    old = x["old"].clone().requires_grad_()
    with rlk.use_backend("reference"):
        weights, metrics = rlk.rollout_correction(old, x["roll"], x["mask"])
    assert not weights.requires_grad and not any(v.requires_grad for v in metrics.values())
    op = abi.OPS["rollout_correction"]
    assert op.backward is None and op.primitives == ("rollout_correction_fwd",)
    assert ENTRY.grad_rel_l2 is None and ENTRY.batch_invariance == "bitwise"


def test_defaults_are_verl_token_tis():
    """``level="token", mode="truncate", upper=2.0, clamp_log_ratio=20``: verl's default ``rollout_is="token"``,
    ``rollout_is_threshold=2.0``."""
    x = make_inputs(3, 7, seed=9, empty_row=False)
    x["roll"][0, 0] = x["old"][0, 0] - 30.0
    with rlk.use_backend("reference"):
        weights, _ = rlk.rollout_correction(x["old"].double(), x["roll"].double(), x["mask"])
    d = (x["old"] - x["roll"]).double()
    want = torch.where(x["mask"], torch.exp(d.clamp(-20.0, 20.0)).clamp(max=2.0), 0.0)
    torch.testing.assert_close(weights, want, **TIGHT)


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------

_X = torch.zeros(2, 5)
_M = torch.ones(2, 5, dtype=torch.bool)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: rlk.rollout_correction(_X[0], _X[0], _M[0]), ValueError, r"old_logprob: expected shape \[B, T\]"),
        (
            lambda: rlk.rollout_correction(_X, torch.zeros(2, 4), _M),
            ValueError,
            r"rollout_logprob: expected shape \(2, 5\) \(the shape of old_logprob\)",
        ),
        (lambda: rlk.rollout_correction(_X, _X, _M[:, :3]), ValueError, r"mask: expected shape \(2, 5\)"),
        (lambda: rlk.rollout_correction(_X.long(), _X, _M), TypeError, "old_logprob: expected dtype"),
        (lambda: rlk.rollout_correction(_X, [0.0], _M), TypeError, "rollout_logprob: expected a torch.Tensor"),
        (
            lambda: rlk.rollout_correction(_X, _X.double(), _M),
            TypeError,
            "rollout_logprob: expected float64 exactly when old_logprob is float64",
        ),
        (lambda: rlk.rollout_correction(_X, _X, _M.tolist()), TypeError, "mask: expected a torch.Tensor"),
        (lambda: rlk.rollout_correction(_X, _X, torch.ones(2, 5, dtype=torch.complex64)), TypeError, "mask: expected"),
        (
            lambda: rlk.rollout_correction(_X, _X, torch.ones(2, 5, dtype=torch.bool, device="meta")),
            ValueError,
            "mask: expected device cpu",
        ),
        (
            lambda: rlk.rollout_correction(_X, _X, _M, level="geometric"),
            ValueError,
            "level: expected one of 'token', 'sequence', got 'geometric'",
        ),
        (
            lambda: rlk.rollout_correction(_X, _X, _M, mode="clip"),
            ValueError,
            "mode: expected one of 'truncate', 'mask'",
        ),
        (lambda: rlk.rollout_correction(_X, _X, _M, upper=0.0), ValueError, "upper: must be a finite number > 0"),
        (lambda: rlk.rollout_correction(_X, _X, _M, upper=math.inf), ValueError, "upper: must be a finite number"),
        (lambda: rlk.rollout_correction(_X, _X, _M, upper=1e39), ValueError, "upper: 1e[+]?39 overflows"),
        (lambda: rlk.rollout_correction(_X, _X, _M, lower=-1.0), ValueError, "lower: must be a finite number > 0"),
        (lambda: rlk.rollout_correction(_X, _X, _M, lower="0.5"), TypeError, "lower: expected a number"),
        (
            lambda: rlk.rollout_correction(_X, _X, _M, upper=1.0, lower=2.0),
            ValueError,
            "lower: must be <= upper, got lower=2 and upper=1",
        ),
        (
            lambda: rlk.rollout_correction(_X, _X, _M, clamp_log_ratio=0.0),
            ValueError,
            "clamp_log_ratio: must be a finite number > 0",
        ),
        (
            lambda: rlk.rollout_correction(_X, _X, _M, clamp_log_ratio=True),
            TypeError,
            "clamp_log_ratio: expected a number",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ----------------------------------------------------------------------------------------------
# torch.library integration
# ----------------------------------------------------------------------------------------------


def test_opcheck():
    x = make_inputs(3, 8, seed=12)
    for level, mode, params in (("token", "truncate", [2.0, 0.0, 20.0]), ("sequence", "mask", [3.0, 0.5, INF])):
        torch.library.opcheck(
            torch.ops.rlk.rollout_correction_fwd.default, (x["old"], x["roll"], x["mask"], level, mode, params)
        )


def test_meta_tensors_run_the_fake_implementation():
    old = torch.empty(3, 8, device="meta")
    weights, metrics = rlk.rollout_correction(old, old, torch.empty(3, 8, dtype=torch.bool, device="meta"))
    assert weights.shape == (3, 8) and weights.device.type == "meta" and set(metrics) == set(abi.CORRECTION_METRICS)


def test_torch_compile_fullgraph_matches_eager():
    x = make_inputs(4, 10, seed=13)

    def weighted(old, roll, mask):
        weights, metrics = rlk.rollout_correction(old, roll, mask, level="sequence", mode="mask", lower=0.5, upper=3.0)
        return weights * 2.0, metrics["weight_mean"] + metrics["seq_weight_std"]

    eager = weighted(x["old"], x["roll"], x["mask"])
    compiled = torch.compile(weighted, fullgraph=True, backend="aot_eager")(x["old"], x["roll"], x["mask"])
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


# ----------------------------------------------------------------------------------------------
# the benchmark's PyTorch baseline computes what rlk computes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["token/truncate", "sequence/mask"])
def test_benchmark_baseline_matches_rlk(option):
    """``bench_asv/benchmarks/rl_objectives.py``: the eager composition timed against ``rlk.rollout_correction``
    gives its weights and the four metrics it reports (a speedup over a baseline that did something else would
    mean nothing), on the benchmark's own inputs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench_asv"))
    from benchmarks import rl_objectives as bench

    with rlk.use_backend("reference"):
        case = bench.RolloutCorrectionCase("rollout_correction", "rlk", option, (4, 64))
        ours = case.step()
    base = bench.torch_rollout_correction(case.old, case.rollout, case.mask, option)
    assert 0 < float(ours[1]) and float(ours[2]) > float(ours[3])
    assert bool((ours[0] == 0).any() & (ours[0] > 0).any())
    for a, b in zip(ours, base):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
