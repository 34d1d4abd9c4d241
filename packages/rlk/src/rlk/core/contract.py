"""The numerical contract: one machine-readable table, read by tests, the parity
suite and the consistency tools. Nothing else hard-codes a tolerance.

The table is ``contract.json`` beside this file; its ``about`` field states the
rules. :func:`compare_outputs` and :func:`compare_grad` apply them and return
:class:`Deviation` records whose ``ratio`` is worst deviation / allowed (a check
passes when ``ratio <= 1``).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from importlib import resources

import torch

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class Entry:
    """Tolerances of one (op, dtype)."""

    op: str
    dtype: str
    atol: float
    rtol: float
    grad_rel_l2: float | None  # None: the op is not differentiable
    batch_invariance: str


@dataclass(frozen=True)
class Deviation:
    """Worst deviation of one output against ground truth, and what was allowed."""

    name: str
    worst: float
    allowed: float

    @property
    def ratio(self) -> float:
        if math.isnan(self.worst):
            return math.inf
        return self.worst / self.allowed if self.allowed > 0 else (0.0 if self.worst == 0 else math.inf)

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0


@functools.cache
def table() -> dict:
    """The raw contract table (parsed ``contract.json``)."""
    return json.loads(resources.files("rlk.core").joinpath("contract.json").read_text())


def dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        return dtype
    if dtype not in _DTYPE_NAMES:
        raise KeyError(f"the contract covers {', '.join(_DTYPE_NAMES.values())}, not {dtype}")
    return _DTYPE_NAMES[dtype]


def entry(op: str, dtype: torch.dtype | str) -> Entry:
    """The contract entry of ``op`` for inputs of ``dtype``."""
    name = dtype_name(dtype)
    ops = table()["ops"]
    if op not in ops or name not in ops[op]:
        raise KeyError(f"the contract has no entry for op {op!r} with dtype {name}")
    e = ops[op][name]
    grad = None if e["grad_rel_l2"] is None else float(e["grad_rel_l2"])
    return Entry(op, name, float(e["atol"]), float(e["rtol"]), grad, e["batch_invariance"])


def row_scale(ref_logprob: torch.Tensor, ref_lse: torch.Tensor) -> torch.Tensor:
    """``1 + |lse| + |z_target|`` per row, from ground truth (fp64)."""
    ref_logprob, ref_lse = ref_logprob.double(), ref_lse.double()
    return 1.0 + ref_lse.abs() + (ref_logprob + ref_lse).abs()


def divergence_scale(ref_lse_student: torch.Tensor, ref_lse_teacher: torch.Tensor) -> torch.Tensor:
    """``1 + |lse_student| + |lse_teacher|`` per row, from ground truth (fp64): the scale of ``fused_linear_kl``."""
    return 1.0 + ref_lse_student.double().abs() + ref_lse_teacher.double().abs()


def compare_outputs(
    e: Entry,
    name: str,
    value: torch.Tensor,
    ref_value: torch.Tensor,
    scale: torch.Tensor,
) -> Deviation:
    """Per-row check ``|value - ref| <= atol + rtol * scale``.

    Reports the row with the worst ratio: its ``|delta|`` and its bound, so
    ``ok`` is exact. NaN in ``value`` where ``ref_value`` is not NaN fails. ``+-inf`` where the ground truth
    lies beyond the range of ``value``'s dtype is its correctly rounded value, hence exact.
    """
    largest = _largest(value)
    value, ref_value, scale = (t.detach().to(ref_value.device, torch.float64) for t in (value, ref_value, scale))
    if value.numel() == 0:
        return Deviation(name, 0.0, e.atol)
    same_nan = torch.isnan(value) & torch.isnan(ref_value)
    same_inf = torch.isinf(value) & ((value == ref_value) | _overflowed(value, ref_value, largest))
    delta = torch.where(same_nan | same_inf, 0.0, (value - ref_value).abs())
    delta = torch.where(torch.isnan(delta), math.inf, delta)
    bound = e.atol + e.rtol * torch.where(torch.isfinite(scale), scale, 0.0)
    worst_row = int(torch.argmax(delta / bound))
    return Deviation(name, float(delta[worst_row]), float(bound[worst_row]))


def compare_grad(
    e: Entry,
    name: str,
    grad: torch.Tensor,
    ref_grad: torch.Tensor,
    max_scale: float,
    magnitude: torch.Tensor | None = None,
) -> Deviation:
    """``||g - g_ref||_2 <= (grad_rel_l2 + rtol * max_scale) ||g_ref||_2 + rtol * max(max_scale, 1) ||magnitude||_2``.

    Without ``magnitude`` this is the relative bound ``||g - g_ref|| / ||g_ref|| <= grad_rel_l2 + rtol * max_scale``.
    ``magnitude`` (from ground truth, the shape of ``g``) is the gradient's formula with every term taken by its
    absolute value, e.g. ``|G| @ |W|`` for ``G @ W``: where the true gradient is a sum of larger terms of mixed
    sign that nearly cancel (a one-feature RMSNorm, a softmax row with one dominant entry, logits sharing a large
    offset), floating point gets it to a small multiple of the terms' size, not of its own.

    Raises ``ValueError`` for an op the contract marks not differentiable.

    The gradient's dtype has no relative precision below its smallest normal number ``tiny`` (bf16 / fp16 outputs,
    flushed subnormals): the error may also reach ``tiny * sqrt(numel)``; and ``+-inf`` where the ground truth lies
    beyond the dtype's range is its correctly rounded value.

    Where the true gradient is exactly zero (``V = 1``, every row ignored) and no ``magnitude`` is given, a
    relative error means nothing; then the RMS of ``g`` must be ``<= atol``.
    """
    if e.grad_rel_l2 is None:
        raise ValueError(f"the contract marks {e.op} as not differentiable (grad_rel_l2 is null)")
    largest, smallest = _largest(grad), _smallest_normal(grad)
    grad, ref_grad = grad.detach().to(ref_grad.device, torch.float64), ref_grad.detach().double()
    relative = e.grad_rel_l2 + e.rtol * max_scale
    overflowed = torch.isinf(grad) & _overflowed(grad, ref_grad, largest)
    if not bool((torch.isfinite(grad) | overflowed).all()):
        return Deviation(name, math.nan, relative)
    grad, ref_grad = torch.where(overflowed, 0.0, grad), torch.where(overflowed, 0.0, ref_grad)
    ref_norm = float(torch.linalg.vector_norm(ref_grad))
    err = float(torch.linalg.vector_norm(grad - ref_grad))
    # the gradient's own dtype holds no relative precision below its smallest normal number (subnormals, flush)
    floor = smallest * math.sqrt(max(grad.numel(), 1))
    if magnitude is not None or floor > 0 and ref_norm > 0:
        terms = 0.0 if magnitude is None else float(torch.linalg.vector_norm(magnitude.detach().double()))
        allowed = relative * ref_norm + e.rtol * max(max_scale, 1.0) * terms + floor
        if allowed > 0:
            return Deviation(name, err, allowed)
    if ref_norm == 0.0:
        return Deviation(name, err / math.sqrt(max(grad.numel(), 1)), e.atol)
    return Deviation(name, err / ref_norm, relative)


def _largest(x: torch.Tensor) -> float:
    """The largest finite value of ``x``'s floating dtype (inf for a non-floating one)."""
    return torch.finfo(x.dtype).max if x.is_floating_point() else math.inf


def _smallest_normal(x: torch.Tensor) -> float:
    """The smallest normal number of ``x``'s dtype below float64 (0 for float64 or a non-floating dtype)."""
    return torch.finfo(x.dtype).smallest_normal if x.is_floating_point() and x.dtype != torch.float64 else 0.0


def _overflowed(value: torch.Tensor, ref_value: torch.Tensor, largest: float) -> torch.Tensor:
    """Where ``value`` is the correctly rounded value of a result beyond its dtype's range: ``+-inf`` of the sign
    of a ground truth larger than ``largest``."""
    return torch.isinf(value) & (torch.sign(value) == torch.sign(ref_value)) & (ref_value.abs() > largest)
