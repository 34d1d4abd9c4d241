"""``fused_linear_kl`` (distillation) in the parity matrix: cases, inputs, calls, contract scales, invariance.

The same interface as :mod:`parity.chain` (``value_cases``, ``make_inputs``, ``cast``, ``ground_truth``,
``forward_backward``, ``compare``, ``invariance_plan``, ``invariance_checks``), so the runner treats both alike.
Each case runs the public op in bf16, fp16 and fp32, forward and backward (``sum(cotangent * loss)``); ground
truth is the same op on fp64 copies of the inputs as cast to the tested dtype, pinned to the reference backend.
Scale (``contract.json``): per row ``1 + |lse_student| + |lse_teacher|`` of the fp64 logits
(:func:`rlk.core.contract.divergence_scale`), its mean / sum for a reduced loss; gradients: ``compare_grad`` with
``max_scale`` the largest row scale. Batch invariance: a probe row alone versus inside batches at first, middle
and last position: its loss and ``grad_hidden`` rows under ``reduction='none'`` (recomputing backward) and its
``grad_hidden`` row under ``'sum'`` (the gradient made in the forward) must be equal bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from parity.cases import generator
from parity.chain import ChainCase, ChainInvariancePlan, ChainOutputs
from rlk import use_backend as _use_backend
from rlk.core import contract
from rlk.ops.distill import fused_linear_kl
from rlk.reference import distill as ref_distill

DISTILL_OPS = ("fused_linear_kl",)
IGNORE_INDEX = -100

#: ``(N, V, Hs)``; the teacher is 1.5x wider (``Ht = 3 Hs / 2``). GPU: the Qwen vocabulary and a 4096-row batch of
#: the Llama-2 vocabulary; CPU: small (the Triton interpreter).
SIZES = {"cuda": ((1, 151936, 4096), (133, 151936, 1536), (4096, 32000, 4096)), "cpu": ((1, 300, 32), (33, 200, 48))}
#: (label, keyword parameters): divergence, reduction, temperature ("row": a per-row tensor), beta, extreme rows.
VARIANTS = (
    (
        "forward_kl mean",
        (("divergence", "forward_kl"), ("reduction", "mean"), ("temperature", 1.0), ("beta", 0.5), ("extreme", False)),
    ),
    (
        "reverse_kl none T=0.7 1e4",
        (("divergence", "reverse_kl"), ("reduction", "none"), ("temperature", 0.7), ("beta", 0.5), ("extreme", True)),
    ),
    (
        "jsd beta=0.3 sum T=row",
        (("divergence", "jsd"), ("reduction", "sum"), ("temperature", "row"), ("beta", 0.3), ("extreme", False)),
    ),
)
INVARIANCE_BATCHES = {"cuda": (7, 133, 4096), "cpu": (7, 33)}
QUICK_INVARIANCE_BATCHES = (7,)
_PROBE_SIZES = {"cuda": (1, 151936, 4096), "cpu": (1, 200, 48)}
_PROBE_PARAMS = (
    ("divergence", "jsd"),
    ("reduction", "none"),
    ("temperature", "row"),
    ("beta", 0.3),
    ("extreme", False),
)
#: Logit standard deviation of both models.
LOGIT_STD = 2.0


@dataclass(frozen=True)
class DistillCase(ChainCase):
    """A value case: ``size = (N, V, Hs)`` and the variant's parameters."""

    def label(self) -> str:
        n, v, hs = self.size
        return f"N={n} V={v} Hs={hs} Ht={_teacher_width(hs)} [{self.variant}]"


def _teacher_width(hs: int) -> int:
    return hs * 3 // 2


def value_cases(op: str, device_type: str, quick: bool) -> list[DistillCase]:
    """Every variant on every size (quick: the first size, every variant)."""
    sizes = SIZES[device_type][:1] if quick else SIZES[device_type]
    return [DistillCase(op, size, label, params) for size in sizes for label, params in VARIANTS]


# ---------------------------------------------------------------------------
# inputs (fp64 on the CPU), cast per dtype
# ---------------------------------------------------------------------------


def make_inputs(case: ChainCase, seed: int) -> dict[str, torch.Tensor]:
    """fp64 CPU inputs of a case: both models' hidden states and heads, targets (a quarter of the rows ignored when
    N > 1), the per-row temperatures when the variant asks for them, the loss's cotangent."""
    gen = generator(seed, f"distill {case.op} {case.label()}")
    n, v, hs = case.size
    ht = _teacher_width(hs)
    kw = case.kwargs

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {
        "student_hidden": randn(n, hs),
        "student_weight": randn(v, hs) * (LOGIT_STD / hs**0.5),
        "teacher_hidden": randn(n, ht),
        "teacher_weight": randn(v, ht) * (LOGIT_STD / ht**0.5),
    }
    targets = torch.randint(0, v, (n,), generator=gen)
    if n > 1:
        targets[torch.randperm(n, generator=gen)[: max(1, n // 4)]] = IGNORE_INDEX
    x["targets"] = targets
    if kw["extreme"]:  # logits of about +-1e4 in some rows: student in row 0, teacher in row 1 (mod 3)
        x["student_hidden"][0::3] *= 1e4 / (4 * LOGIT_STD)
        x["teacher_hidden"][1::3] *= 1e4 / (4 * LOGIT_STD)
    if kw["temperature"] == "row":
        x["temperature"] = 0.5 + 1.5 * torch.rand(n, generator=gen, dtype=torch.float64)
    x["cot"] = randn(n) if kw["reduction"] == "none" else randn(1)[0]
    return x


def cast(inputs: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Hidden states and heads in ``dtype`` on ``device``; temperatures and the cotangent in fp32 (fp64 for the
    ground truth), targets as they are."""
    aux = torch.float64 if dtype == torch.float64 else torch.float32
    out = {}
    for name, value in inputs.items():
        if not value.is_floating_point():
            out[name] = value.to(device)
        elif name in ("temperature", "cot"):
            out[name] = value.to(device, aux)
        else:
            out[name] = value.to(device, dtype)
    return out


# ---------------------------------------------------------------------------
# one call, ground truth, comparison
# ---------------------------------------------------------------------------


def _call(params: dict, x: dict[str, torch.Tensor], reduction: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = x["student_hidden"].detach().clone().requires_grad_()
    weight = x["student_weight"].detach().clone().requires_grad_()
    temperature = x.get("temperature", params["temperature"])
    loss = fused_linear_kl(
        hidden,
        weight,
        x["teacher_hidden"],
        x["teacher_weight"],
        x["targets"],
        divergence=params["divergence"],
        beta=params["beta"],
        temperature=temperature,
        reduction=reduction,
    )
    cot = x["cot"] if reduction == params["reduction"] else torch.ones_like(loss)
    (cot * loss).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


def forward_backward(op: str, params: dict, x: dict[str, torch.Tensor]) -> ChainOutputs:
    """The public op on the currently pinned backend, forward and backward."""
    loss, grad_hidden, grad_weight = _call(params, x, params["reduction"])
    return ChainOutputs({"loss": loss}, {"grad_hidden": grad_hidden, "grad_weight": grad_weight})


@dataclass
class DistillTruth:
    outputs: ChainOutputs
    scale: torch.Tensor  # of the loss, as it is reduced
    max_scale: float  # the largest row scale of the rows that count


def ground_truth(case: ChainCase, low: dict[str, torch.Tensor]) -> DistillTruth:
    """The public op on fp64 copies of ``low`` pinned to the reference, and the scales from the fp64 lse (the
    reference primitive's statistics)."""
    x64 = {name: value.double() if value.is_floating_point() else value for name, value in low.items()}
    with _use_backend("reference"):
        outputs = forward_backward(case.op, case.kwargs, x64)
    n = x64["student_hidden"].shape[0]
    device = x64["targets"].device
    if "temperature" in x64:
        temperature = x64["temperature"]
    else:
        temperature = torch.full((n,), float(case.kwargs["temperature"]), dtype=torch.float64, device=device)
    loss = torch.empty(n, dtype=torch.float64, device=device)
    stats = torch.empty(3, n, dtype=torch.float64, device=device)
    ref_distill.fused_linear_kl_fwd(
        x64["student_hidden"],
        x64["student_weight"],
        x64["teacher_hidden"],
        x64["teacher_weight"],
        x64["targets"],
        1 / temperature,
        IGNORE_INDEX,
        case.kwargs["divergence"],
        case.kwargs["beta"],
        loss,
        stats,
        None,
        None,
        None,
    )
    rows = contract.divergence_scale(stats[0], stats[1])
    valid = x64["targets"] != IGNORE_INDEX
    reduction = case.kwargs["reduction"]
    if reduction == "none":
        scale = rows
    else:
        scale = torch.where(valid, rows, 0.0).sum()
        if reduction == "mean":
            scale = scale / valid.sum().clamp(min=1)
    max_scale = float(rows[valid].max()) if bool(valid.any()) else 1.0
    return DistillTruth(outputs, scale, max_scale)


def compare(case: ChainCase, dtype: torch.dtype, got: ChainOutputs, truth: DistillTruth) -> list[contract.Deviation]:
    """The loss (per row, or the reduced value) and both gradients under the contract."""
    entry = contract.entry(case.op, dtype)
    ref = truth.outputs
    deviations = [
        contract.compare_outputs(
            entry, "loss", got.values["loss"].reshape(-1), ref.values["loss"].reshape(-1), truth.scale.reshape(-1)
        )
    ]
    deviations += [
        contract.compare_grad(entry, name, got.grads[name], ref.grads[name], truth.max_scale) for name in ref.grads
    ]
    return deviations


# ---------------------------------------------------------------------------
# invariance
# ---------------------------------------------------------------------------


def invariance_plan(op: str, device_type: str, quick: bool) -> ChainInvariancePlan:
    case = DistillCase(op, _PROBE_SIZES[device_type], "invariance jsd beta=0.3 T=row", _PROBE_PARAMS)
    return ChainInvariancePlan(op, case, QUICK_INVARIANCE_BATCHES if quick else INVARIANCE_BATCHES[device_type])


def _probe_outputs(params: dict, x: dict[str, torch.Tensor], position: int) -> dict[str, torch.Tensor]:
    loss, grad_hidden, _ = _call(params, x, "none")
    _, grad_hidden_sum, _ = _call(params, x, "sum")
    rows = slice(position, position + 1)
    return {"loss": loss[rows], "grad_hidden": grad_hidden[rows], "grad_hidden (sum)": grad_hidden_sum[rows]}


def invariance_checks(
    plan: ChainInvariancePlan,
    seed: int,
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    record: Callable[[int, int, list[str]], None],
) -> None:
    """Run the probe of ``plan`` on ``backend``; ``record(batch, position, differing outputs)`` per check. The probe
    row is never ignored; the other rows (some ignored, some extreme) share its heads."""
    probe = make_inputs(plan.case, seed)
    params = plan.case.kwargs
    with _use_backend(backend):
        alone = _probe_outputs(params, cast(probe, dtype, device), 0)
        for batch in plan.batches:
            n, v, hs = plan.case.size
            others = make_inputs(
                DistillCase(plan.op, (batch - 1, v, hs), "others", (*plan.case.params[:-1], ("extreme", True))),
                seed + 1,
            )
            for position in plan.positions(batch):
                inputs = dict(probe)
                for name in ("student_hidden", "teacher_hidden", "targets", "temperature", "cot"):
                    inputs[name] = torch.cat([others[name][:position], probe[name], others[name][position:]])
                got = _probe_outputs(params, cast(inputs, dtype, device), position)
                record(batch, position, [name for name, value in alone.items() if not torch.equal(value, got[name])])
