"""``--against DIR``: this machine's backends against outputs another machine stored (:mod:`parity.stored`).

The stored run is another backend's low-precision result, not ground truth. Per case the fp64 reference is computed
here, and every output and gradient gets three checks under the contract (``rlk.core.contract``), each a
:class:`Check` with a side:

* ``stored vs fp64``: the stored outputs against the reference (is the other machine's side off?);
* ``vs fp64``: this backend against the reference (the suite's check: is this machine's side off?);
* ``vs stored``: this backend against the stored outputs within the sum of both allowances, twice the contract's
  bound against the reference (implied by the two above, by the triangle inequality; reported as a ratio).

A tensor stored as a sample and a norm is checked on the sample (outputs per element, gradients in L2) and on the
norm, with the whole tensor's bound: ``||a[I] - b[I]|| <= ||a - b||`` and ``| ||a|| - ||b|| | <= ||a - b||``, so a
backend within the contract never fails these.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import rlk
from parity import run as pr
from parity import stored as st
from rlk.core import contract

PASS, FAIL, NA = "PASS", "FAIL", "n/a"
VS_STORED, VS_FP64, STORED_VS_FP64 = "vs stored", "vs fp64", "stored vs fp64"


@dataclass(frozen=True)
class Check:
    """One check: its side (``VS_STORED``, ``VS_FP64`` or ``STORED_VS_FP64``) and deviation / allowed."""

    side: str
    deviation: contract.Deviation


@dataclass
class Cell:
    """One stored case on one backend of this machine."""

    backend: str
    checks: list[Check] = field(default_factory=list)
    na_reason: str | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def status(self) -> str:
        if self.na_reason is not None:
            return NA
        return PASS if self.error is None and all(c.deviation.ok for c in self.checks) else FAIL

    def worst(self, side: str) -> Check | None:
        return max((c for c in self.checks if c.side == side), key=lambda c: c.deviation.ratio, default=None)


@dataclass
class Outcome:
    """One stored case: the stored side's checks against this machine's fp64 reference and every backend's cell."""

    sc: st.StoredCase
    stored_backend: str
    stored_checks: list[Check] = field(default_factory=list)
    cells: list[Cell] = field(default_factory=list)
    error: str | None = None

    @property
    def stored_ok(self) -> bool:
        return self.error is None and all(c.deviation.ok for c in self.stored_checks)

    @property
    def failed(self) -> bool:
        return not self.stored_ok or any(c.status == FAIL for c in self.cells)

    def sides_off(self, cell: Cell) -> str:
        """Which side a failure points to: ``stored``, ``this machine``, ``both``, or ``neither alone``."""
        stored_off = not self.stored_ok
        mine_off = cell.error is not None or any(not c.deviation.ok for c in cell.checks if c.side == VS_FP64)
        if stored_off and mine_off:
            return "both"
        if stored_off or mine_off:
            return "stored" if stored_off else "this machine"
        return "neither alone"


# ---------------------------------------------------------------------------
# the checks of one tensor
# ---------------------------------------------------------------------------


def _twice(entry: contract.Entry) -> contract.Entry:
    return dataclasses.replace(entry, atol=2 * entry.atol, rtol=2 * entry.rtol)


def _label(name: str, record: dict) -> str:
    return name if "full" in record else f"{name}[sample]"


def _value_bound(entry: contract.Entry, scale: torch.Tensor) -> float:
    """``||atol + rtol scale||_2`` over all elements (a non-finite scale counts 0, as in ``compare_outputs``): the
    per-element bounds taken together bound ``||v - ref||_2``."""
    finite = torch.where(torch.isfinite(scale), scale.double(), 0.0)
    return _norm(entry.atol + entry.rtol * finite)


def value_checks(
    entry: contract.Entry, name: str, got: torch.Tensor, record: dict, ref: torch.Tensor, scale: torch.Tensor
) -> list[Check]:
    """An output: this backend against the reference (all of it, per element), against the stored part
    (``|got - stored| <= 2 (atol + rtol scale)``) and, when sampled, the norms' gap within twice
    :func:`_value_bound`."""
    stored = st.stored_tensor(record).to(got.device).reshape(-1)
    part, part_scale = st.take(got, record).reshape(-1), st.take(scale, record).reshape(-1)
    checks = [
        Check(VS_FP64, contract.compare_outputs(entry, name, got.reshape(-1), ref.reshape(-1), scale.reshape(-1))),
        Check(VS_STORED, contract.compare_outputs(_twice(entry), _label(name, record), part, stored, part_scale)),
    ]
    if "full" in record:
        return checks
    gap = _norm_gap(_norm(got), record["norm"])
    return checks + [Check(VS_STORED, contract.Deviation(f"{name}[norm]", gap, 2 * _value_bound(entry, scale)))]


def stored_value_checks(
    entry: contract.Entry, name: str, record: dict, ref: torch.Tensor, scale: torch.Tensor
) -> list[Check]:
    """A stored output against the reference: per element (whole or its sample) and, when sampled, its norm's gap
    to the reference's within :func:`_value_bound`."""
    stored = st.stored_tensor(record).to(ref.device).reshape(-1)
    part, part_scale = st.take(ref, record).reshape(-1), st.take(scale, record).reshape(-1)
    checks = [Check(STORED_VS_FP64, contract.compare_outputs(entry, _label(name, record), stored, part, part_scale))]
    if "full" in record:
        return checks
    gap = _norm_gap(record["norm"], _norm(ref))
    return checks + [Check(STORED_VS_FP64, contract.Deviation(f"{name}[norm]", gap, _value_bound(entry, scale)))]


def grad_bound(
    entry: contract.Entry,
    name: str,
    ref: torch.Tensor,
    dtype: torch.dtype,
    max_scale: float,
    magnitude: torch.Tensor | None,
) -> float:
    """The contract's bound on ``||g - ref||_2`` for a gradient ``g`` of ``dtype`` shaped like ``ref`` (fp64):
    ``compare_grad``'s allowance, read from it (``RMS <= atol`` where ``ref`` is zero and has no magnitude)."""
    ref_norm = float(torch.linalg.vector_norm(ref.double()))
    if magnitude is None and ref_norm == 0.0:
        return entry.atol * math.sqrt(max(ref.numel(), 1))
    return contract.compare_grad(entry, name, ref.to(dtype), ref, max_scale, magnitude).allowed


def _l2_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b||_2`` in fp64 (equal infinities count 0; any other non-finite entry makes it NaN: a failure)."""
    a, b = a.double(), b.to(a.device).double()
    diff = torch.where(a == b, 0.0, a - b)
    return float(torch.linalg.vector_norm(diff)) if bool(torch.isfinite(diff).all()) else math.nan


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.double()))


def _norm_gap(a: float, b: float) -> float:
    """``|a - b|`` of two norms (0 for equal infinities; NaN, a failure, for a NaN norm)."""
    return 0.0 if a == b else abs(a - b)


def grad_checks(entry: contract.Entry, name: str, got: torch.Tensor, record: dict, truth: st.Truth, bound: float):
    """A gradient: this backend against the reference (``compare_grad``) and against the stored tensor within
    ``2 bound`` (L2; a sample's gap and the norms' gap)."""
    ref = truth.produced.grads[name]
    mine = contract.compare_grad(entry, name, got, ref, truth.max_scale, truth.magnitudes.get(name))
    checks = [Check(VS_FP64, mine)]
    stored = st.stored_tensor(record)
    if "full" in record:
        return checks + [Check(VS_STORED, contract.Deviation(name, _l2_gap(got, stored), 2 * bound))]
    gaps = {f"{name}[sample]": _l2_gap(st.take(got, record), stored)}
    gaps[f"{name}[norm]"] = _norm_gap(_norm(got), record["norm"])
    return checks + [Check(VS_STORED, contract.Deviation(n, gap, 2 * bound)) for n, gap in gaps.items()]


def stored_grad_checks(entry: contract.Entry, name: str, record: dict, truth: st.Truth, bound: float) -> list[Check]:
    """A stored gradient against the reference: ``compare_grad`` when whole; else its sample's and its norm's gap
    within ``bound``."""
    ref = truth.produced.grads[name]
    stored = st.stored_tensor(record).to(ref.device)
    if "full" in record:
        mag = truth.magnitudes.get(name)
        return [Check(STORED_VS_FP64, contract.compare_grad(entry, name, stored, ref, truth.max_scale, mag))]
    gaps = {f"{name}[sample]": _l2_gap(stored, st.take(ref, record))}
    gaps[f"{name}[norm]"] = _norm_gap(record["norm"], _norm(ref))
    return [Check(STORED_VS_FP64, contract.Deviation(n, gap, bound)) for n, gap in gaps.items()]


# ---------------------------------------------------------------------------
# one case
# ---------------------------------------------------------------------------


def _bounds(sc: st.StoredCase, truth: st.Truth) -> dict[str, float]:
    entry, dtype = contract.entry(sc.op, sc.dtype), pr.DTYPES[sc.dtype]
    return {
        name: grad_bound(entry, name, ref, dtype, truth.max_scale, truth.magnitudes.get(name))
        for name, ref in truth.produced.grads.items()
    }


def _same_names(record: dict, produced: st.Produced) -> None:
    for kind, have in (("values", produced.values), ("grads", produced.grads)):
        if set(record[kind]) != set(have):
            raise ValueError(f"stored {kind} {sorted(record[kind])}, this run's {sorted(have)}")


def stored_side(sc: st.StoredCase, record: dict, truth: st.Truth, bounds: dict[str, float]) -> list[Check]:
    """Every stored output and gradient against the fp64 reference computed here."""
    _same_names(record, truth.produced)
    entry = contract.entry(sc.op, sc.dtype)
    checks = []
    for name, ref in truth.produced.values.items():
        checks += stored_value_checks(entry, name, record["values"][name], ref, truth.scales[name])
    for name in truth.produced.grads:
        checks += stored_grad_checks(entry, name, record["grads"][name], truth, bounds[name])
    return checks


def backend_side(sc: st.StoredCase, record: dict, got: st.Produced, truth: st.Truth, bounds: dict[str, float]):
    """This backend's outputs and gradients against the reference and against the stored ones."""
    _same_names(record, got)
    entry = contract.entry(sc.op, sc.dtype)
    checks = []
    for name, ref in truth.produced.values.items():
        checks += value_checks(entry, name, got.values[name], record["values"][name], ref, truth.scales[name])
    for name in truth.produced.grads:
        checks += grad_checks(entry, name, got.grads[name], record["grads"][name], truth, bounds[name])
    return checks


def _run_cell(sc: st.StoredCase, record: dict, low, truth: st.Truth, bounds: dict[str, float], cell: Cell) -> None:
    start = time.perf_counter()
    try:
        with rlk.use_backend(cell.backend):
            got = st.produce(sc, low)
        cell.checks = backend_side(sc, record, got, truth, bounds)
    except Exception as exc:
        cell.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
    cell.seconds = time.perf_counter() - start


def compare_case(sc: st.StoredCase, record: dict, seed: int, backends: list[str], device: torch.device) -> Outcome:
    """The reference here, the stored side's checks, then every backend of ``backends`` (n/a where it declines)."""
    outcome = Outcome(sc, record["backend"])
    try:
        low_cpu = st.make_low(sc, seed)
        low = st.to_device(sc, low_cpu, device)
        truth = st.reference(sc, low, low_cpu, device)
        bounds = _bounds(sc, truth)
        outcome.stored_checks = stored_side(sc, record, truth, bounds)
    except Exception as exc:
        outcome.error = f"reference or stored record: {type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
        return outcome
    for backend in backends:
        cell = Cell(backend, na_reason=st.why_not(sc, backend, device))
        outcome.cells.append(cell)
        if cell.na_reason is None:
            _run_cell(sc, record, low, truth, bounds, cell)
    del low, truth
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return outcome


def compare_all(
    cases: list[st.StoredCase],
    payload: dict,
    backends: list[str],
    device: torch.device,
    progress: Callable[[str], None],
) -> list[Outcome]:
    """:func:`compare_case` for every case, one progress line each."""
    seed = int(payload["seed"])
    outcomes = []
    for i, sc in enumerate(cases, 1):
        outcome = compare_case(sc, payload["cases"][sc.key], seed, backends, device)
        outcomes.append(outcome)
        progress(f"[{i}/{len(cases)}] {sc.key}: {line(outcome)}")
    return outcomes


def line(outcome: Outcome) -> str:
    """A one-line summary of a case: the stored side, then each backend."""
    if outcome.error is not None:
        return f"FAIL {outcome.error}"
    worst = max((c.deviation.ratio for c in outcome.stored_checks), default=0.0)
    parts = [f"stored ({outcome.stored_backend}) vs fp64 {worst:.3g}"]
    for cell in outcome.cells:
        parts.append(f"{cell.backend} {cell_text(cell)}")
    return "; ".join(parts)


def cell_text(cell: Cell) -> str:
    """``PASS · vs stored 0.12 · vs fp64 0.3``, ``FAIL · error ...`` or ``n/a (reason)``."""
    if cell.status == NA:
        return f"n/a ({cell.na_reason})"
    if cell.error is not None:
        return f"FAIL · error {cell.error}"
    ratios = [f"{side} {cell.worst(side).deviation.ratio:.3g}" for side in (VS_STORED, VS_FP64) if cell.worst(side)]
    return " · ".join([cell.status, *ratios])


def exit_code(outcomes: list[Outcome]) -> int:
    """1 if any case failed or nothing was compared at all (never a vacuous pass), else 0."""
    compared = any(c.status != NA for o in outcomes for c in o.cells)
    return 1 if any(o.failed for o in outcomes) or not compared else 0
