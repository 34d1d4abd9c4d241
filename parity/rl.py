"""The RL-objective ops in the parity matrix: cases, inputs, calls, contract scales, invariance.

Ops: ``policy_loss``, ``kl_penalty``, ``value_loss``, ``dpo_loss`` (differentiable: values and
gradients), ``group_advantages``, ``masked_whiten``, ``discounted_returns``, ``gae``,
``rollout_correction``, ``scatter_rewards`` (values only). They declare float32 only (16-bit inputs are upcast by the op
layer), so each gets one row of the matrix, ``op x float32``.

Each case runs the public op on the pinned backend with fp32 inputs; ground truth is the same
public op on fp64 copies of the same values, pinned to the reference backend. The scales are
the ones each op's contract entry describes (its ``"scale"`` string), computed from the fp64
inputs and ground truth with the helpers of the reference modules
(``rlk.reference.policy_loss.contract_scale``, ``rlk.reference.advantages.*_contract_scale``,
``rlk.reference.rollout_correction.contract_scale``, ``rlk.reference.rewards.contract_scale``).
The recurrence constants (``gamma``, ``gamma * lam``) are dyadic, so the float32-rounded
constants the op layer passes equal the fp64 ones.

Batch invariance (``policy_loss`` with token-sum and with global normalizers,
``discounted_returns``, ``gae``, ``rollout_correction``'s weights): a probe row alone versus inside
batches at first, middle and last position; its per-token outputs / gradient must be equal bit for bit
(``torch.equal``). ``scatter_rewards``: a probe group (its rows, regions and costs) alone versus inside
batches of other groups, likewise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import rlk
from parity.cases import generator
from rlk.core import abi, contract
from rlk.ops.rewards import primitive_inputs as scatter_primitive_inputs
from rlk.reference import advantages as ref_adv
from rlk.reference import aggregation
from rlk.reference import losses as ref_losses
from rlk.reference import policy_loss as ref_pl
from rlk.reference import rewards as ref_rewards
from rlk.reference import rollout_correction as ref_rc

RL_OPS = (
    "policy_loss",
    "kl_penalty",
    "value_loss",
    "dpo_loss",
    "group_advantages",
    "masked_whiten",
    "discounted_returns",
    "gae",
    "rollout_correction",
    "scatter_rewards",
)
INF = float("inf")

#: ``[B, T]`` shapes (``dpo_loss``: ``P`` pairs = B; ``group_advantages``: B sequences, T unused).
SHAPES = {"cuda": ((1, 8192), (64, 2048), (512, 8192)), "cpu": ((1, 61), (7, 300), (33, 128))}
QUICK_SHAPES = ((1, 61), (7, 300))
#: ``group_advantages``: B sequences (groups of GROUP_SIZE where it divides B, else one group).
GROUP_ROWS = {"cuda": (1, 64, 512), "cpu": (1, 7, 264)}
#: Batch invariance of a [1, T] probe row inside batches of these sizes.
INVARIANCE_T = {"cuda": 8192, "cpu": 64}
INVARIANCE_BATCHES = {"cuda": (7, 133, 512), "cpu": (7, 33)}
QUICK_INVARIANCE_BATCHES = (7,)
INVARIANT_OPS = ("policy_loss", "discounted_returns", "gae", "rollout_correction", "scatter_rewards")

#: Dyadic discount / lambda: exact in float32, so fp32 and fp64 runs use the same constants.
GAMMA = 1 - 2**-7
LAM = 15 / 16
GROUP_SIZE = 8
#: ``scatter_rewards``: weights of its reward columns (dyadic: the same in float32 and float64), and the size of the
#: probe group of its invariance check (a group of 3 alone, then among other groups at several positions).
REWARD_WEIGHTS = (1.0, 0.5, 0.25)
PROBE_GROUP = 3


# ---------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RLCase:
    """One value case of an RL op: a ``[rows, cols]`` problem and a variant (keyword arguments)."""

    op: str
    rows: int
    cols: int
    variant: str
    params: tuple[tuple[str, object], ...] = ()

    @property
    def kwargs(self) -> dict:
        return dict(self.params)

    def label(self) -> str:
        if self.op == "dpo_loss":
            size = f"P={self.rows}"
        elif self.op == "group_advantages":
            size = f"B={self.rows} n={self.cols}" if not self.kwargs.get("ragged") else f"B={self.rows}"
        else:
            size = f"B={self.rows} T={self.cols}"
        return f"{size} [{self.variant}]"


def _p(**kwargs) -> tuple[tuple[str, object], ...]:
    return tuple(kwargs.items())


_PPO = _p(loss="ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0)
_GSPO = _p(loss="gspo", clip_low=3e-4, clip_high=4e-4)
_CISPO = _p(loss="cispo", clip_low=0.2, clip_high=0.28)
_TOKEN_MEAN = _p(agg="token-mean")
_SEQ_MEAN = _p(agg="seq-mean-token-mean")

#: Variants per op: (label, keyword arguments of the public op).
VARIANTS: dict[str, tuple[tuple[str, tuple], ...]] = {
    "policy_loss": (
        ("ppo dual-clip token-mean", _PPO + _TOKEN_MEAN),
        ("ppo dual-clip seq-mean-token-mean", _PPO + _SEQ_MEAN),
        ("gspo token-mean", _GSPO + _TOKEN_MEAN),
        ("gspo seq-mean-token-mean", _GSPO + _SEQ_MEAN),
        ("cispo token-mean", _CISPO + _TOKEN_MEAN),
        ("cispo seq-mean-token-mean", _CISPO + _SEQ_MEAN),
        ("ppo dual-clip token-mean, loss_spans", _PPO + _TOKEN_MEAN + _p(spans=True)),
    ),
    "kl_penalty": (
        ("k1", _p(estimator="k1")),
        ("k3", _p(estimator="k3")),
        ("k3 unclamped, importance-weighted", _p(estimator="k3", k3_clamp=False, unbiased=True)),
        ("k3, loss_spans", _p(estimator="k3", spans=True)),
    ),
    "value_loss": (
        ("clip=0.5 token-mean", _p(clip=0.5, agg="token-mean")),
        ("clip=0.2 seq-mean-token-mean", _p(clip=0.2, agg="seq-mean-token-mean")),
    ),
    "dpo_loss": (
        ("sigmoid beta=0.1", _p(loss="sigmoid", beta=0.1, label_smoothing=0.0)),
        ("sigmoid beta=0.1 smoothing=0.1", _p(loss="sigmoid", beta=0.1, label_smoothing=0.1)),
        ("ipo beta=0.5", _p(loss="ipo", beta=0.5, label_smoothing=0.0)),
    ),
    "group_advantages": (
        ("grpo", _p(mode="grpo", ragged=False)),
        ("rloo", _p(mode="rloo", ragged=False)),
        ("grpo, ragged group_index", _p(mode="grpo", ragged=True)),
    ),
    "masked_whiten": (
        ("unbiased", _p(unbiased=True)),
        ("biased", _p(unbiased=False)),
    ),
    "discounted_returns": (
        ("carry gamma=1", _p(mask_mode="carry", gamma=1.0)),
        (f"reset gamma={GAMMA}", _p(mask_mode="reset", gamma=GAMMA)),
        (f"zero gamma={GAMMA}", _p(mask_mode="zero", gamma=GAMMA)),
    ),
    "gae": (
        ("gamma=1 lam=1", _p(gamma=1.0, lam=1.0)),
        (f"gamma={GAMMA} lam={LAM}", _p(gamma=GAMMA, lam=LAM)),
    ),
    "rollout_correction": (
        ("token truncate upper=2 (TIS)", _p(level="token", mode="truncate", upper=2.0)),
        ("sequence mask [0.5, 3] (IcePop)", _p(level="sequence", mode="mask", lower=0.5, upper=3.0)),
        (
            "token mask [0.8, 1.25], no clamp",
            _p(level="token", mode="mask", lower=0.8, upper=1.25, clamp_log_ratio=None),
        ),
        ("sequence truncate [0.5, 2]", _p(level="sequence", mode="truncate", lower=0.5, upper=2.0)),
    ),
    "scatter_rewards": (
        (
            "grpo broadcast, 3 columns, overlong, regions, costs",
            _p(group_mode="grpo", placement="broadcast", columns=3, overlong=True, regions=True, costs=True),
        ),
        (
            "rloo last, regions, ragged group_index",
            _p(group_mode="rloo", placement="last", columns=1, overlong=False, regions=True, ragged=True),
        ),
        ("no group, last (verl's reward tensor), overlong", _p(group_mode=None, placement="last", overlong=True)),
        (
            "dr_grpo last, 2 columns, region costs",
            _p(group_mode="dr_grpo", placement="last", columns=2, regions=True, costs=True),
        ),
    ),
}


def _sizes(op: str, device_type: str, quick: bool) -> tuple[tuple[int, int], ...]:
    shapes = QUICK_SHAPES if quick else SHAPES[device_type]
    if op == "group_advantages":  # (B sequences, group size): B = 1 is one singleton group
        return tuple((b, GROUP_SIZE if b % GROUP_SIZE == 0 else b) for b in GROUP_ROWS[device_type][: len(shapes)])
    if op == "masked_whiten":  # needs two masked entries for the unbiased variance
        return tuple((b, max(t, 2)) for b, t in shapes)
    return shapes


def value_cases(op: str, device_type: str, quick: bool) -> list[RLCase]:
    """Every variant of ``op`` on every shape (the quick set: the first two variants)."""
    variants = VARIANTS[op][:2] if quick else VARIANTS[op]
    cases = []
    for b, t in _sizes(op, device_type, quick):
        for label, params in variants:
            if op == "group_advantages" and not dict(params)["ragged"]:
                params = params + _p(group_size=t)
            cases.append(RLCase(op, b, t, label, params))
    return cases


@dataclass(frozen=True)
class RLInvariancePlan:
    """A ``[1, cols]`` probe row alone versus inside batches of ``batches`` rows, for each variant."""

    op: str
    cols: int
    batches: tuple[int, ...]
    variants: tuple[tuple[str, tuple], ...]

    def positions(self, batch: int) -> tuple[int, ...]:
        return tuple(sorted({0, batch // 2, batch - 1}))

    def describe(self) -> str:
        return f"T={self.cols}, variants: {'; '.join(label for label, _ in self.variants)}"


def invariance_plan(op: str, device_type: str, quick: bool) -> RLInvariancePlan | None:
    """Where ``op``'s batch-invariance probe runs, or None where a row's bits may depend on the batch
    (call-wide statistics or normalizers)."""
    if op not in INVARIANT_OPS:
        return None
    batches = QUICK_INVARIANCE_BATCHES if quick else INVARIANCE_BATCHES[device_type]
    if op == "policy_loss":
        variants = (
            ("ppo dual-clip token-sum", _PPO + _p(agg="token-sum")),
            (
                "gspo seq-mean-token-mean, global normalizers",
                _GSPO + _p(agg="seq-mean-token-mean", global_tokens=4096.0, global_seqs=64.0),
            ),
        )
    elif op in ("rollout_correction", "scatter_rewards"):
        variants = VARIANTS[op][:2]  # both levels; both placements
    else:
        variants = VARIANTS[op][1:2]  # a discount below 1 (and reset mode for the returns)
    return RLInvariancePlan(op, INVARIANCE_T[device_type], batches, variants)


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------


def _ragged_mask(b: int, t: int, gen: torch.Generator, holes: bool = True) -> torch.Tensor:
    """Right-padded rows of random lengths (row 0 full, row 3 empty when B >= 4), a few holes
    (multi-turn observation tokens) in odd rows."""
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[0] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if holes and b > 1:
        mask[1::2] &= torch.rand(mask[1::2].shape, generator=gen) > 0.1
    if b >= 4:
        mask[3] = False
    return mask


def make_inputs(case: RLCase, seed: int, rows: int | None = None) -> dict[str, torch.Tensor]:
    """fp32 (bool for masks, int64 for indices) CPU inputs of a case; ``rows`` overrides its B."""
    gen = generator(seed, f"{case.op} {case.label()}")
    b, t, op = case.rows if rows is None else rows, case.cols, case.op
    if op in ("policy_loss", "kl_penalty"):
        lp = -torch.rand(b, t, generator=gen) * 4 - 0.05
        old = lp + 0.3 * torch.randn(b, t, generator=gen)
        old[:, ::5] = lp[:, ::5] - 1.5  # ratios far outside the clip range, both sides
        old[:, 1::7] = lp[:, 1::7] + 1.5
        out = {"logprob": lp, "old_logprob": old, "ref_logprob": lp + 0.7 * torch.randn(b, t, generator=gen)}
        if op == "kl_penalty":
            out["c"] = torch.randn(b, t, generator=gen)
            if case.kwargs.get("spans"):
                out["mask"] = _ragged_mask(b, t, gen)
            return out
        per_seq = case.kwargs.get("loss") == "gspo"
        out["advantages"] = torch.randn(b, 1, generator=gen) if per_seq else torch.randn(b, t, generator=gen)
        out["mask"] = _ragged_mask(b, t, gen)
        out["importance_weights"] = torch.rand(b, t, generator=gen) + 0.5
        out["entropy"] = torch.rand(b, t, generator=gen) * 2
        return out
    if op == "rollout_correction":
        old = -torch.rand(b, t, generator=gen) * 4 - 0.05
        if case.kwargs["level"] == "token":
            roll = old + 0.3 * torch.randn(b, t, generator=gen)
        else:  # row sums of log-ratios of about N(0, 1.4^2), ratios on both sides of the thresholds
            roll = old + torch.randn(b, t, generator=gen) / t**0.5 + torch.randn(b, 1, generator=gen) / t
        return {"old_logprob": old, "rollout_logprob": roll, "mask": _ragged_mask(b, t, gen)}
    if op == "value_loss":
        values = torch.randn(b, t, generator=gen) * 2
        return {
            "values": values,
            "old_values": values + 0.7 * torch.randn(b, t, generator=gen),
            "returns": torch.randn(b, t, generator=gen) * 2,
            "mask": _ragged_mask(b, t, gen),
        }
    if op == "dpo_loss":
        len_c = torch.randint(1, 500, (b,), generator=gen).float()
        len_r = torch.randint(1, 500, (b,), generator=gen).float()
        lc = -len_c * (0.2 + torch.rand(b, generator=gen))
        lr = -len_r * (0.2 + torch.rand(b, generator=gen))
        return {
            "chosen": lc,
            "rejected": lr,
            "ref_chosen": lc + 10 * torch.randn(b, generator=gen),
            "ref_rejected": lr + 10 * torch.randn(b, generator=gen),
            "len_chosen": len_c,
            "len_rejected": len_r,
            "c": torch.randn(b, generator=gen),
        }
    if op == "scatter_rewards":
        return _scatter_inputs(case.kwargs, b, t, gen)
    if op == "group_advantages":
        scores = (torch.rand(b, generator=gen) < 0.5).float() + 0.1 * torch.randn(b, generator=gen)
        out = {"scores": scores}
        if case.kwargs["ragged"]:  # arbitrary id values in any order: groups of random sizes, singletons too
            out["group_index"] = 37 * torch.randint(0, b // 4 + 1, (b,), generator=gen) - 5
        return out
    mask = _ragged_mask(b, t, gen)
    rewards = 0.1 * torch.randn(b, t, generator=gen)  # per-token shaping (e.g. a KL penalty)
    last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & mask
    rewards = torch.where(last, torch.randn(b, t, generator=gen).sign(), rewards)  # terminal +-1
    if op == "masked_whiten":
        mask[0, :2] = True
        return {"x": rewards + torch.randn(b, t, generator=gen), "mask": mask}
    out = {"rewards": rewards, "mask": mask}
    if op == "gae":
        out["values"] = torch.randn(b, t, generator=gen) * 0.5
    return out


def _scatter_inputs(params: dict, b: int, t: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``scatter_rewards``: verifier-like reward columns (0 / 1 plus noise; NaN in every third entry of the second
    column: a reward function that does not apply there), a ragged mask, two regions per sequence (random spans,
    empty ones included) with values, 0 / 1 costs and region costs, arbitrary group ids (``ragged``)."""
    columns = params.get("columns", 1)
    rewards = (torch.rand(b, columns, generator=gen) < 0.5).float() + 0.1 * torch.randn(b, columns, generator=gen)
    if columns > 1:
        rewards[::3, 1] = float("nan")
    out = {"rewards": rewards, "mask": _ragged_mask(b, t, gen)}
    if params.get("regions"):
        start = torch.randint(0, t + 1, (2 * b,), generator=gen)
        end = start + (torch.rand(2 * b, generator=gen) * (t + 1 - start)).long()
        out["region_spans"] = torch.stack([torch.arange(b).repeat_interleave(2), start, end], 1)
        out["region_values"] = torch.randn(2 * b, generator=gen)
    if params.get("costs"):
        out["costs"] = (torch.rand(b, generator=gen) < 0.3).float()
        if params.get("regions"):
            out["region_costs"] = (torch.rand(2 * b, generator=gen) < 0.2).float()
    if params.get("ragged"):
        out["group_index"] = 37 * torch.randint(0, b // 4 + 1, (b,), generator=gen) - 5
    return out


def cast(inputs: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Floating tensors in ``dtype`` on ``device`` (masks and indices keep theirs)."""
    return {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in inputs.items()}


# ---------------------------------------------------------------------------
# one call: values and gradients of the public op
# ---------------------------------------------------------------------------


@dataclass
class RLOutputs:
    values: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]


def _policy_kwargs(params: dict, x: dict) -> dict:
    return {
        **params,
        "importance_weights": x["importance_weights"],
        "ref_logprob": x["ref_logprob"],
        "kl": "k3",
        "kl_coef": 0.1,
        "entropy_coef": 0.01,
    }


def _scatter_arguments(params: dict, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``scatter_rewards``' ``(rewards, response_mask, keywords)`` for a case: one column as ``[B]``, the weights of
    :data:`REWARD_WEIGHTS`, the overlong penalty at ``(T, T // 4, 1)``, groups by ``group_index`` when the inputs
    have one, else of :data:`GROUP_SIZE` (one group when it does not divide B)."""
    b, t = x["mask"].shape
    columns = x["rewards"].shape[1]
    kw: dict = {"placement": params["placement"], "group_mode": params["group_mode"]}
    if params["group_mode"] is not None:
        if "group_index" in x:
            kw["group_index"] = x["group_index"]
        else:
            kw["group_size"] = GROUP_SIZE if b % GROUP_SIZE == 0 else b
    if columns > 1:
        kw["reward_weights"] = list(REWARD_WEIGHTS[:columns])
    if params.get("overlong"):
        kw["overlong"] = (t, t // 4, 1.0)
    if "region_values" in x:
        kw["region_rewards"] = (x["region_values"], x["region_spans"])
    if "costs" in x:
        kw["costs"] = x["costs"]
    if "region_costs" in x:
        kw["region_costs"] = (x["region_costs"], x["region_spans"])
    return (x["rewards"][:, 0] if columns == 1 else x["rewards"]), x["mask"], kw


def forward_backward(op: str, params: dict, x: dict[str, torch.Tensor]) -> RLOutputs:
    """The public op on the pinned backend; differentiable ops also run backward."""
    params = dict(params)
    spans = params.pop("spans", False)  # True: the mask as a span table on its device; "dense": the mask (ground truth)
    table = rlk.multimodal.mask_to_spans(x["mask"]) if spans is True else None
    if op == "policy_loss":
        lp, ent = x["logprob"].clone().requires_grad_(), x["entropy"].clone().requires_grad_()
        mask, extra = (None, {"loss_spans": table}) if table is not None else (x["mask"], {})
        loss, metrics = rlk.policy_loss(
            lp, x["old_logprob"], x["advantages"], mask, entropy=ent, **_policy_kwargs(params, x), **extra
        )
        loss.backward()
        values = {"loss": loss.detach().reshape(1), **{k: v.reshape(1) for k, v in metrics.items()}}
        return RLOutputs(values, {"grad_logprob": lp.grad, "grad_entropy": ent.grad})
    if op == "kl_penalty":
        lp = x["logprob"].clone().requires_grad_()
        extra = {"old_logprob": x["old_logprob"]} if params.get("unbiased") else {}
        if table is not None:
            extra["loss_spans"] = table
        kl = rlk.kl_penalty(lp, x["ref_logprob"], params["estimator"], k3_clamp=params.get("k3_clamp", True), **extra)
        if spans == "dense":
            kl = torch.where(x["mask"], kl, 0.0)
        (x["c"] * kl).sum().backward()
        return RLOutputs({"kl": kl.detach().reshape(-1)}, {"grad_logprob": lp.grad})
    if op == "rollout_correction":
        weights, metrics = rlk.rollout_correction(x["old_logprob"], x["rollout_logprob"], x["mask"], **params)
        return RLOutputs({"weights": weights, **{k: m.reshape(1) for k, m in metrics.items()}}, {})
    if op == "value_loss":
        v = x["values"].clone().requires_grad_()
        loss, metrics = rlk.value_loss(v, x["old_values"], x["returns"], x["mask"], **params)
        loss.backward()
        return RLOutputs(
            {"loss": loss.detach().reshape(1), **{k: m.reshape(1) for k, m in metrics.items()}}, {"grad_values": v.grad}
        )
    if op == "dpo_loss":
        lc, lr = x["chosen"].clone().requires_grad_(), x["rejected"].clone().requires_grad_()
        kwargs = dict(params)
        if kwargs["loss"] == "ipo":
            kwargs.update(chosen_length=x["len_chosen"], rejected_length=x["len_rejected"])
        loss, metrics = rlk.dpo_loss(lc, lr, x["ref_chosen"], x["ref_rejected"], **kwargs)
        loss.backward()
        with torch.no_grad():
            losses, _ = rlk.dpo_loss(
                x["chosen"], x["rejected"], x["ref_chosen"], x["ref_rejected"], reduction="none", **kwargs
            )
        values = {"losses": losses, "loss": loss.detach().reshape(1), **{k: m.reshape(1) for k, m in metrics.items()}}
        return RLOutputs(values, {"grad_chosen": lc.grad, "grad_rejected": lr.grad})
    if op == "group_advantages":
        if "group_index" in x:
            adv = rlk.group_advantages(x["scores"], group_index=x["group_index"], mode=params["mode"])
        else:
            adv = rlk.group_advantages(x["scores"], group_size=params["group_size"], mode=params["mode"])
        return RLOutputs({"advantages": adv}, {})
    if op == "scatter_rewards":
        rewards, mask, kw = _scatter_arguments(params, x)
        out = rlk.scatter_rewards(rewards, mask, **kw)
        if isinstance(out, tuple):
            return RLOutputs({"token_rewards": out[0], "token_costs": out[1]}, {})
        return RLOutputs({"token_rewards": out}, {})
    if op == "masked_whiten":
        return RLOutputs({"whitened": rlk.masked_whiten(x["x"], x["mask"], **params).reshape(-1)}, {})
    if op == "discounted_returns":
        out = rlk.discounted_returns(x["rewards"], x["mask"], params["gamma"], mask_mode=params["mask_mode"])
        return RLOutputs({"returns": out}, {})
    if op == "gae":
        adv, ret = rlk.gae(x["rewards"], x["values"], x["mask"], **params)
        return RLOutputs({"advantages": adv, "returns": ret}, {})
    raise KeyError(op)


# ---------------------------------------------------------------------------
# the contract's scales, from the fp64 inputs and ground truth
# ---------------------------------------------------------------------------


def _policy_contract_scale(params: dict, x: dict) -> dict[str, torch.Tensor]:
    """``rlk.reference.policy_loss.contract_scale`` for the parity case's keywords."""
    kw = _policy_kwargs(params, x)
    agg_kw = {k: kw.get(k) for k in ("global_tokens", "global_seqs", "loss_scale")}
    row_weight = aggregation.row_weights(x["mask"], kw["agg"], dtype=torch.float64, **agg_kw)
    attrs = {
        "loss": kw["loss"],
        "cispo_upper": False,
        "clip_low": kw["clip_low"],
        "clip_high": kw["clip_high"],
        "dual_clip": kw.get("dual_clip") or 0.0,
        "clamp_low": -INF,
        "clamp_high": INF,
        "tau_pos": 1.0,
        "tau_neg": 1.05,
        "kl": kw["kl"],
        "kl_coef": kw["kl_coef"],
        "kl_k3_clamp": True,
        "kl_clamp": INF,
        "kl_straight_through": False,
        "kl_unbiased": False,
        "entropy_coef": kw["entropy_coef"],
    }
    return ref_pl.contract_scale(
        x["logprob"],
        x["old_logprob"],
        x["advantages"],
        x["mask"],
        row_weight,
        x["importance_weights"],
        x["ref_logprob"],
        x["entropy"],
        **attrs,
    )


def _policy_scales(params: dict, x: dict, truth: RLOutputs) -> tuple[dict[str, torch.Tensor], float]:
    s = _policy_contract_scale(params, x)
    extra = {"loss": s["loss"].reshape(1)}
    extra |= {name: s["metrics"][abi.POLICY_METRICS.index(name)].reshape(1) for name in truth.values if name != "loss"}
    return {name: 1.0 + truth.values[name].abs() + extra[name] for name in truth.values}, float(s["grad_max_scale"])


def magnitudes(case: RLCase, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients' terms by absolute value where they may cancel (``rlk.core.contract.compare_grad``'s
    ``magnitude``): the policy loss's and the KL penalty's ``grad_logprob`` (k3's ``1 - exp(-delta)``)."""
    if case.op == "policy_loss":
        return {"grad_logprob": _policy_contract_scale(case.kwargs, x)["grad_magnitude"]}
    if case.op == "kl_penalty":
        terms = ref_pl.kl_grad_terms(x["logprob"] - x["ref_logprob"], k3_clamp=case.kwargs.get("k3_clamp", True))
        if case.kwargs.get("unbiased"):
            terms = terms * torch.exp(x["logprob"] - x["old_logprob"])
        return {"grad_logprob": x["c"].abs() * terms}
    return {}


def _dpo_scales(params: dict, x: dict, truth: RLOutputs) -> tuple[dict[str, torch.Tensor], float]:
    lc, lr, lc_ref, lr_ref = x["chosen"], x["rejected"], x["ref_chosen"], x["ref_rejected"]
    beta, loss_type, eps = params["beta"], params["loss"], params["label_smoothing"]
    if loss_type == "ipo":
        n_c, n_r = x["len_chosen"].clamp(min=1), x["len_rejected"].clamp(min=1)
        lc, lc_ref, lr, lr_ref = lc / n_c, lc_ref / n_c, lr / n_r, lr_ref / n_r
    s = 1 + lc.abs() + lr.abs() + lc_ref.abs() + lr_ref.abs()
    _, dl_dx, *_ = ref_losses._dpo_terms(
        x["chosen"],
        x["rejected"],
        x["ref_chosen"],
        x["ref_rejected"],
        x["len_chosen"],
        x["len_rejected"],
        beta,
        loss_type,
        eps,
    )
    per_pair = 1 + truth.values["losses"].abs() + dl_dx.abs() * s
    reward = (1 + beta * s.mean()).reshape(1)
    # reward_accuracy counts [margin > 0]: a pair whose exact margin is within fp32 rounding of 0 may count either
    # way, so each such pair adds 1 / P to the allowed error (scale * rtol)
    raw = 1 + x["chosen"].abs() + x["rejected"].abs() + x["ref_chosen"].abs() + x["ref_rejected"].abs()
    margin = beta * ((x["chosen"] - x["ref_chosen"]) - (x["rejected"] - x["ref_rejected"]))
    rtol = contract.entry("dpo_loss", torch.float32).rtol
    ties = (margin.abs() <= 8 * torch.finfo(torch.float32).eps * beta * raw).sum()
    accuracy = (1 + ties / (max(margin.numel(), 1) * rtol)).reshape(1)
    scales = {"losses": per_pair, "loss": per_pair.mean().reshape(1), "reward_accuracy": accuracy}
    scales |= {name: reward for name in ("rewards_chosen", "rewards_rejected", "reward_margin")}
    k = 1.0 if loss_type == "ipo" else beta
    return scales, float((k * s).max())


def scales(case: RLCase, x: dict[str, torch.Tensor], truth: RLOutputs) -> tuple[dict[str, torch.Tensor], float]:
    """Per-output scales and the gradients' ``max_scale``, as the op's contract entry describes them."""
    op, params, v = case.op, case.kwargs, truth.values
    if op == "policy_loss":
        return _policy_scales(params, x, truth)
    if op == "kl_penalty":
        return {"kl": 1.0 + v["kl"].abs()}, 1.0
    if op == "rollout_correction":
        upper, lower, clamp = params.get("upper", 2.0), params.get("lower"), params.get("clamp_log_ratio", 20.0)
        s = ref_rc.contract_scale(
            x["old_logprob"],
            x["rollout_logprob"],
            x["mask"],
            level=params["level"],
            mode=params["mode"],
            upper=INF if upper is None else upper,
            lower=0.0 if lower is None else lower,
            clamp=INF if clamp is None else clamp,
        )
        out = {"weights": s["weights"]}
        return out | {name: s["metrics"][i].reshape(1) for i, name in enumerate(abi.CORRECTION_METRICS)}, 1.0
    if op == "value_loss":
        m = x["mask"]
        v_abs = torch.where(m, x["values"].abs(), 0.0).sum() / m.sum().clamp(min=1)
        return {
            "loss": 1.0 + v["loss"].abs(),
            "vf_clip_fraction": torch.ones_like(v["loss"]),
            "values_mean": (1.0 + v_abs).reshape(1),
        }, 1.0
    if op == "dpo_loss":
        return _dpo_scales(params, x, truth)
    if op == "group_advantages":
        return {
            "advantages": ref_adv.group_contract_scale(
                v["advantages"], x.get("group_index"), params.get("group_size", 0)
            )
        }, 1.0
    if op == "scatter_rewards":
        rewards, mask, kw = _scatter_arguments(params, x)
        per_channel = ref_rewards.contract_scale(*scatter_primitive_inputs(rewards, mask, **kw))
        return {f"token_{name}": scale for name, scale in per_channel.items()}, 1.0
    if op == "masked_whiten":
        scale = ref_adv.whiten_contract_scale(
            x["x"], x["mask"], params["unbiased"], 1e-8, "add", v["whitened"].view_as(x["x"])
        )
        return {"whitened": scale.reshape(-1)}, 1.0
    if op == "discounted_returns":
        return {
            "returns": ref_adv.returns_contract_scale(x["rewards"], x["mask"], params["gamma"], params["mask_mode"])
        }, 1.0
    if op == "gae":
        gamma, lam = params["gamma"], params["lam"]
        adv, ret = ref_adv.gae_contract_scale(x["rewards"], x["values"], x["mask"], gamma, gamma * lam)
        return {"advantages": adv, "returns": ret}, 1.0
    raise KeyError(op)


@dataclass
class RLTruth:
    outputs: RLOutputs
    scales: dict[str, torch.Tensor]
    max_scale: float
    magnitudes: dict[str, torch.Tensor]


def ground_truth(case: RLCase, base: dict[str, torch.Tensor], device: torch.device) -> RLTruth:
    """The public op on fp64 copies of the inputs, pinned to the reference backend, and the scales."""
    x64 = cast(base, torch.float64, device)
    params = {**case.kwargs, "spans": "dense"} if case.kwargs.get("spans") else case.kwargs  # spans: the mask
    with rlk.use_backend("reference"):
        outputs = forward_backward(case.op, params, x64)
    scale, max_scale = scales(case, x64, outputs)
    return RLTruth(outputs, scale, max_scale, magnitudes(case, x64))


def compare(case: RLCase, got: RLOutputs, truth: RLTruth) -> list[contract.Deviation]:
    """Every output (per element, ``compare_outputs``) and gradient (``compare_grad``) under the contract."""
    entry = contract.entry(case.op, torch.float32)
    ref = truth.outputs
    deviations = [
        contract.compare_outputs(
            entry, name, got.values[name].reshape(-1), ref.values[name].reshape(-1), truth.scales[name].reshape(-1)
        )
        for name in ref.values
    ]
    deviations += [
        contract.compare_grad(
            entry, name, got.grads[name], ref.grads[name], truth.max_scale, truth.magnitudes.get(name)
        )
        for name in ref.grads
    ]
    return deviations


# ---------------------------------------------------------------------------
# invariance
# ---------------------------------------------------------------------------


def _row_outputs(op: str, params: dict, x: dict[str, torch.Tensor], position: int) -> dict[str, torch.Tensor]:
    """The per-token outputs / gradients of one row (``policy_loss``: its gradient coefficients;
    ``rollout_correction``: its weights, not the call's metrics)."""
    out = forward_backward(op, params, x)
    rows = out.grads if op == "policy_loss" else out.values
    if op == "rollout_correction":
        rows = {"weights": rows["weights"]}
    return {name: t[position] for name, t in rows.items()}


def invariance_checks(
    plan: RLInvariancePlan, seed: int, backend: str, device: torch.device, record: Callable[[int, int, list[str]], None]
) -> None:
    """Run the probe of ``plan`` on ``backend``; ``record(batch, position, differing outputs)`` per check."""
    if plan.op == "scatter_rewards":
        _scatter_invariance_checks(plan, seed, backend, device, record)
        return
    for label, params in plan.variants:
        case = RLCase(plan.op, max(plan.batches), plan.cols, f"invariance {label}", params)
        everything = make_inputs(case, seed)
        everything["mask"][0, : plan.cols // 2] = True  # the probe row has tokens
        x = cast(everything, torch.float32, device)
        kwargs = dict(params)
        probe = {k: v[:1] for k, v in x.items()}
        with rlk.use_backend(backend):
            alone = _row_outputs(plan.op, kwargs, probe, 0)
            for batch in plan.batches:
                for position in plan.positions(batch):
                    inputs = {k: torch.cat([v[1 : position + 1], v[:1], v[position + 1 : batch]]) for k, v in x.items()}
                    row = _row_outputs(plan.op, kwargs, inputs, position)
                    differs = [
                        f"{name} ({label})" for name, value in alone.items() if not torch.equal(value, row[name])
                    ]
                    record(batch, position, differs)


def _scatter_rows(x: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """``scatter_rewards``' inputs of the sequences ``rows`` (in that order): their rows, ids and regions (renumbered,
    ordered by their new sequence, keeping their order within a sequence)."""
    out = {k: x[k][rows] for k in ("rewards", "mask", "group_index", "costs") if k in x}
    if "region_spans" in x:
        where = torch.full((x["mask"].shape[0],), -1, dtype=torch.long, device=rows.device)
        where[rows] = torch.arange(rows.shape[0], device=rows.device)
        seq = where[x["region_spans"][:, 0]]
        keep = (seq >= 0).nonzero().squeeze(1)
        keep = keep[torch.sort(seq[keep], stable=True).indices]
        out["region_spans"] = torch.cat([seq[keep, None], x["region_spans"][keep, 1:]], 1)
        for k in ("region_values", "region_costs"):
            if k in x:
                out[k] = x[k][keep]
    return out


def _scatter_invariance_checks(plan: RLInvariancePlan, seed: int, backend: str, device: torch.device, record) -> None:
    """``scatter_rewards``: a group of :data:`PROBE_GROUP` sequences (with its regions) alone, then among other groups
    (random ids) at the first, middle and last position of each batch; its token rewards and costs must be equal
    bit for bit."""
    for label, variant in plan.variants:
        n = max(plan.batches)
        case = RLCase(plan.op, n, plan.cols, f"invariance {label}", variant)
        params = dict(variant)
        everything = make_inputs(case, seed)
        ids = torch.randint(0, 4, (n,), generator=generator(seed, f"{case.label()} ids"))
        ids[:PROBE_GROUP] = -1  # the probe group: the first rows
        everything["group_index"] = ids
        x = cast(everything, torch.float32, device)
        probe = torch.arange(PROBE_GROUP, device=device)
        with rlk.use_backend(backend):
            alone = forward_backward(plan.op, params, _scatter_rows(x, probe)).values
            for batch in plan.batches:
                others = torch.arange(PROBE_GROUP, batch, device=device)
                for position in sorted({0, (batch - PROBE_GROUP) // 2, batch - PROBE_GROUP}):
                    rows = torch.cat([others[:position], probe, others[position:]])
                    got = forward_backward(plan.op, params, _scatter_rows(x, rows)).values
                    window = slice(position, position + PROBE_GROUP)
                    record(
                        batch,
                        position,
                        [f"{name} ({label})" for name, v in alone.items() if not torch.equal(v, got[name][window])],
                    )
