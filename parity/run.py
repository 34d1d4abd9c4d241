"""Running the parity matrix: values against fp64 ground truth, and batch invariance.

For each op, dtype and backend (pinned with :func:`rlk.use_backend`), every value
case runs the public op forward and backward (loss ``sum(c1 * logprob + c2 *
entropy)``). Ground truth is the same public op on fp64 copies of the same input
values, pinned to the reference backend. Outputs and gradients are compared
with :mod:`rlk.core.contract`; no tolerance is defined here.

Backends that declare ``batch_invariant`` must give a probe row the same bits
alone and inside batches (``torch.equal``); for the others the same check is
run and reported as information only.

The RL-objective ops (``parity.rl``) follow the same scheme with their own cases,
calls and contract scales; they declare float32 only, so their rows are float32.
"""

from __future__ import annotations

import functools
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

import rlk
from parity import cases as cs
from parity import chain, distill, rl
from rlk.core import abi, contract, dispatch

PASS, FAIL, NA = "PASS", "FAIL", "n/a"

#: Every op of the matrix: the log-prob ops (bf16/fp16/fp32), the RL-objective ops (fp32 rows only), the
#: batch-invariant forward chain and the distillation divergence (bf16/fp16/fp32).
ALL_OPS = cs.OPS + rl.RL_OPS + chain.CHAIN_OPS + distill.DISTILL_OPS


def family(op: str):
    """The module of an op run the chain's way (:mod:`parity.chain` or :mod:`parity.distill`: one interface), or
    None for the log-prob and RL ops."""
    if op in chain.CHAIN_OPS:
        return chain
    if op in distill.DISTILL_OPS:
        return distill
    return None


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Outputs:
    """What one op call produced: fp32/fp64 per-row outputs and the input gradients."""

    logprob: torch.Tensor
    entropy: torch.Tensor | None
    grads: dict[str, torch.Tensor]


@dataclass
class CaseResult:
    """One value case on one backend: every deviation, or the error it raised."""

    case: cs.Case | rl.RLCase | chain.ChainCase
    deviations: list[contract.Deviation] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and all(d.ok for d in self.deviations)

    @property
    def worst(self) -> contract.Deviation | None:
        return max(self.deviations, key=lambda d: d.ratio, default=None)


@dataclass
class InvarianceCheck:
    """The probe row inside one batch: which outputs differ from the probe alone."""

    batch: int
    position: int
    differs: list[str]


@dataclass
class InvarianceResult:
    """Batch invariance of one (op, dtype, backend)."""

    claimed: bool
    plan: cs.InvariancePlan | rl.RLInvariancePlan | chain.ChainInvariancePlan
    checks: list[InvarianceCheck] = field(default_factory=list)
    error: str | None = None

    @property
    def bitwise(self) -> bool:
        return self.error is None and not any(c.differs for c in self.checks)

    @property
    def verdict(self) -> str:
        """Short verdict for the matrix: ``bitwise``, ``BROKEN ...`` or ``not claimed (measured: ...)``."""
        if self.error is not None:
            measured = "error"
        elif self.bitwise:
            measured = "bitwise"
        else:
            measured = f"differs in {sum(bool(c.differs) for c in self.checks)}/{len(self.checks)} batches"
        if self.claimed:
            return measured if self.bitwise else f"BROKEN ({measured})"
        return f"not claimed (measured: {measured})"

    @property
    def details(self) -> str:
        """Which batch, position and outputs differ (or the error)."""
        if self.error is not None:
            return self.error
        bad = [f"N={c.batch} at {c.position}: {', '.join(c.differs)}" for c in self.checks if c.differs]
        return "; ".join(bad) or "all equal"

    @property
    def ok(self) -> bool:
        return self.bitwise or not self.claimed


@dataclass
class Cell:
    """One (op, dtype, backend) of the matrix."""

    op: str
    dtype: str
    backend: str
    na_reason: str | None = None
    results: list[CaseResult] = field(default_factory=list)
    skipped: list[tuple[cs.Case, str]] = field(default_factory=list)
    invariance: InvarianceResult | None = None

    @property
    def status(self) -> str:
        if self.na_reason is not None:
            return NA
        if not self.results and self.invariance is None:
            return FAIL  # nothing ran: never a vacuous PASS
        if all(r.ok for r in self.results) and (self.invariance is None or self.invariance.ok):
            return PASS
        return FAIL

    @property
    def worst(self) -> tuple[CaseResult, contract.Deviation] | None:
        """The case and check with the largest deviation / allowed ratio."""
        pairs = [(r, r.worst) for r in self.results if r.worst is not None]
        return max(pairs, key=lambda p: p[1].ratio, default=None)


@dataclass
class Config:
    """What to run (the parsed command line)."""

    device: torch.device
    backends: list[str]
    dtypes: list[str]
    ops: list[str]
    quick: bool
    seed: int


# ---------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------


def runnable_backends(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """Backends that are available and serve ``device``, and why the others don't."""
    run, not_run = [], {}
    for name, status in dispatch.discover().items():
        if not status.available:
            not_run[name] = f"unavailable: {status.reason}"
            continue
        served = status.backend.device_types()
        if device.type in served or "*" in served:
            run.append(name)
        else:
            not_run[name] = f"does not serve device type '{device.type}' (serves: {', '.join(served) or 'none'})"
    return run, not_run


def claims_invariance(backend: str) -> bool:
    return dispatch.discover()[backend].backend.batch_invariant


# ---------------------------------------------------------------------------
# one call
# ---------------------------------------------------------------------------


def forward_backward(op: str, inputs: cs.Inputs, with_entropy: bool) -> Outputs:
    """The public op, forward and backward of ``sum(c1 * logprob + c2 * entropy)``, on the pinned backend."""
    x = inputs.x.detach().requires_grad_()
    kwargs = {"temperature": inputs.temperature, "ignore_index": cs.IGNORE_INDEX, "return_entropy": with_entropy}
    targets, lead = inputs.targets, x
    if inputs.loss_spans is not None:  # the rows as one [1, N] sequence, scored by the span table only
        targets = torch.where(targets == cs.IGNORE_INDEX, 0, targets)[None]
        spans = inputs.loss_spans if inputs.spans_on == "host" else inputs.loss_spans.to(x.device)
        kwargs["loss_spans"], lead = spans, x[None]
    if op == "selected_logprob":
        out = rlk.selected_logprob(lead, targets, **kwargs)
        leaves = {"grad_logits": x}
    else:
        weight = inputs.weight.detach().requires_grad_()
        out = rlk.linear_logprob(lead, weight, targets, **kwargs)
        leaves = {"grad_hidden": x, "grad_weight": weight}
    logprob, entropy = out if with_entropy else (out, None)
    logprob, entropy = logprob.reshape(-1), None if entropy is None else entropy.reshape(-1)
    loss = inputs.c1 * logprob
    if entropy is not None:
        loss = loss + inputs.c2 * entropy
    loss.sum().backward()
    grads = {name: leaf.grad for name, leaf in leaves.items()}
    return Outputs(logprob.detach(), None if entropy is None else entropy.detach(), grads)


def reference_lse(op: str, inputs: cs.Inputs) -> torch.Tensor:
    """Ground-truth ``lse`` of fp64 inputs, from the forward custom op pinned to the reference."""
    t = inputs.temperature
    if not isinstance(t, torch.Tensor):
        t = torch.full((inputs.rows,), t, dtype=torch.float64, device=inputs.x.device)
    inv_t = torch.reciprocal(t.to(torch.float64)).contiguous()
    with rlk.use_backend("reference"), torch.no_grad():
        if op == "selected_logprob":
            _, _, lse = torch.ops.rlk.selected_logprob_fwd(inputs.x, inputs.targets, inv_t, cs.IGNORE_INDEX, False)
        else:
            _, _, lse = torch.ops.rlk.linear_logprob_fwd(
                inputs.x, inputs.weight, inputs.targets, inv_t, cs.IGNORE_INDEX, False
            )
    return lse


@dataclass
class GroundTruth:
    """fp64 reference outputs and gradients of one case, with the contract's row scales and the gradients' terms'
    magnitudes (``rlk.core.contract.compare_grad``)."""

    outputs: Outputs
    scale: torch.Tensor
    max_scale: float
    magnitudes: dict[str, torch.Tensor] = field(default_factory=dict)


#: Rows per step, and the largest ``N * V``, of :func:`linear_grad_magnitudes` (bounded fp64 memory and time).
_MAGNITUDE_ROWS = 256
_MAGNITUDE_MAX_ELEMENTS = 1 << 28


def selected_grad_magnitudes(exact: cs.Inputs, with_entropy: bool) -> dict[str, torch.Tensor]:
    """The size of the terms of ``selected_logprob``'s logits gradient (the loss of :func:`forward_backward`), fp64:
    ``|c1| (onehot + p) / T`` plus, with the entropy, ``|c2| p (|log p| + H) / T``. ``onehot - p`` cancels where
    the target's probability is near 1 (``1 - p`` in fp32 is good to ``ulp(1)``, not to its own size)."""
    t = exact.temperature
    t = t[:, None] if isinstance(t, torch.Tensor) and t.dim() > 0 else t
    valid = exact.targets != cs.IGNORE_INDEX
    logp = torch.log_softmax(torch.where(valid[:, None], exact.x, 0.0) / t, dim=-1)
    p = logp.exp()
    onehot = torch.zeros_like(p)
    onehot[valid.nonzero()[:, 0], exact.targets[valid]] = 1.0
    mag = exact.c1.abs()[:, None] * (onehot + p) / t
    if with_entropy:
        p_abs_logp = torch.where(p > 0, -p * logp, 0.0)
        mag = mag + exact.c2.abs()[:, None] * (p_abs_logp + p * p_abs_logp.sum(-1, keepdim=True)) / t
    return {"grad_logits": torch.where(valid[:, None], mag, 0.0)}


def linear_grad_magnitudes(exact: cs.Inputs, with_entropy: bool) -> dict[str, torch.Tensor]:
    """``|G| @ |W|`` and ``|G|^T @ |h|`` of fp64 inputs, ``G = d loss / d logits`` (the loss of
    :func:`forward_backward`): the size of the terms ``linear_logprob``'s gradients sum. Empty when the logits
    would exceed ``_MAGNITUDE_MAX_ELEMENTS``."""
    h, w = exact.x, exact.weight
    if h.shape[0] * w.shape[0] > _MAGNITUDE_MAX_ELEMENTS:
        return {}
    mag_h, mag_w = torch.zeros_like(h), torch.zeros_like(w)
    t = exact.temperature
    for r0 in range(0, h.shape[0], _MAGNITUDE_ROWS):
        rows = slice(r0, r0 + _MAGNITUDE_ROWS)
        temperature = t[rows] if isinstance(t, torch.Tensor) and t.dim() > 0 else t
        part = cs.Inputs(h[rows] @ w.T, None, exact.targets[rows], temperature, exact.c1[rows], exact.c2[rows])
        with rlk.use_backend("reference"):
            g = forward_backward("selected_logprob", part, with_entropy).grads["grad_logits"].abs()
        mag_h[rows] = g @ w.abs()
        mag_w += g.T @ h[rows].abs()
    return {"grad_hidden": mag_h, "grad_weight": mag_w}


def ground_truth(op: str, low: cs.Inputs, with_entropy: bool) -> GroundTruth:
    """The reference backend on fp64 copies of the low-precision inputs ``low``."""
    exact = replace(low.cast(torch.float64, low.x.device), loss_spans=None)  # ignore_index targets, not spans
    with rlk.use_backend("reference"):
        outputs = forward_backward(op, exact, with_entropy)
    scale = contract.row_scale(outputs.logprob, reference_lse(op, exact))
    valid = exact.targets != cs.IGNORE_INDEX
    max_scale = float(scale[valid].max()) if bool(valid.any()) else 0.0
    if op == "linear_logprob":
        magnitudes = linear_grad_magnitudes(exact, with_entropy)
    else:
        magnitudes = selected_grad_magnitudes(exact, with_entropy)
    return GroundTruth(outputs, scale, max_scale, magnitudes)


def compare(op: str, dtype: torch.dtype, got: Outputs, truth: GroundTruth) -> list[contract.Deviation]:
    """Every output and gradient of ``got`` against the ground truth, under the contract."""
    entry = contract.entry(op, dtype)
    ref = truth.outputs
    deviations = [contract.compare_outputs(entry, "logprob", got.logprob, ref.logprob, truth.scale)]
    if ref.entropy is not None:
        deviations.append(contract.compare_outputs(entry, "entropy", got.entropy, ref.entropy, truth.scale))
    for name, grad in got.grads.items():
        deviations.append(
            contract.compare_grad(entry, name, grad, ref.grads[name], truth.max_scale, truth.magnitudes.get(name))
        )
    return deviations


# ---------------------------------------------------------------------------
# invariance
# ---------------------------------------------------------------------------


def _probe_row(out: Outputs, position: int) -> dict[str, torch.Tensor]:
    """The probe row's outputs and per-row gradients (``grad_weight`` mixes rows: not compared)."""
    row = {"logprob": out.logprob[position], "entropy": out.entropy[position]}
    for name, grad in out.grads.items():
        if name != "grad_weight":
            row[name] = grad[position]
    return row


def check_invariance(
    plan: cs.InvariancePlan,
    probe: cs.Inputs,
    others: cs.Inputs,
    dtype: torch.dtype,
    backend: str,
    device: torch.device,
) -> InvarianceResult:
    """The probe row alone versus inside each batch of ``plan`` at first, middle and last position
    (``probe`` and ``others`` from :func:`parity.cases.make_invariance_inputs`)."""
    result = InvarianceResult(claims_invariance(backend), plan)
    op = plan.op
    probe, others = probe.cast(dtype, device), others.cast(dtype, device)
    try:
        with rlk.use_backend(backend):
            alone = _probe_row(forward_backward(op, probe, True), 0)
            for batch in plan.batches:
                for position in plan.positions(batch):
                    inputs = cs.embed_probe(probe, others, batch, position)
                    row = _probe_row(forward_backward(op, inputs, True), position)
                    differs = [name for name, value in alone.items() if not torch.equal(value, row[name])]
                    result.checks.append(InvarianceCheck(batch, position, differs))
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
    return result


# ---------------------------------------------------------------------------
# the matrix
# ---------------------------------------------------------------------------


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_matrix(config: Config, progress: Callable[[str], None] = _say) -> list[Cell]:
    """Every (op, dtype, backend) cell of the matrix, in the order of ``config``."""
    device = config.device
    cells: dict[tuple[str, str, str], Cell] = {}
    for op in config.ops:
        for dtype in config.dtypes:
            if op in rl.RL_OPS and dtype != "float32":
                continue  # the RL ops declare float32 only (16-bit inputs are upcast by the op layer)
            for backend in config.backends:
                reason = dispatch.why_not(backend, abi.OPS[op], device, DTYPES[dtype])
                cells[op, dtype, backend] = Cell(op, dtype, backend, na_reason=reason)
    live = [c for c in cells.values() if c.na_reason is None]
    total = len(live) + sum(
        1
        for cell in live
        for case in value_cases(cell.op, device.type, config.quick)
        if cell.op in rl.RL_OPS or family(cell.op) is not None or cs.skip_reason(cell.backend, device, case) is None
    )
    counter = _Counter(total, progress)
    for op in config.ops:
        op_cells = [c for c in live if c.op == op]
        for case in value_cases(op, device.type, config.quick):
            if op in rl.RL_OPS:
                _run_rl_case(config, case, op_cells, counter)
            elif family(op) is not None:
                _run_chain_case(config, case, op_cells, counter)
            else:
                _run_case(config, case, op_cells, counter)
    for op in (op for op in config.ops if op in rl.RL_OPS):
        rl_plan = rl.invariance_plan(op, device.type, config.quick)
        if rl_plan is None:
            continue
        for cell in (c for c in live if c.op == op):
            start = time.perf_counter()
            cell.invariance = check_rl_invariance(rl_plan, config.seed, cell.backend, device)
            counter(
                f"{cell.op} {cell.dtype} {cell.backend} invariance (batches {rl_plan.batches}, "
                f"{rl_plan.describe()}): {cell.invariance.verdict} [{cell.invariance.details}] "
                f"({time.perf_counter() - start:.1f}s)"
            )
    for op in (op for op in config.ops if family(op) is not None):
        chain_plan = family(op).invariance_plan(op, device.type, config.quick)
        for cell in (c for c in live if c.op == op):
            start = time.perf_counter()
            cell.invariance = check_chain_invariance(chain_plan, config.seed, cell.backend, device, DTYPES[cell.dtype])
            counter(
                f"{cell.op} {cell.dtype} {cell.backend} invariance (batches {chain_plan.batches}, "
                f"{chain_plan.describe()}): {cell.invariance.verdict} [{cell.invariance.details}] "
                f"({time.perf_counter() - start:.1f}s)"
            )
    for op in (op for op in config.ops if op in cs.OPS):
        plan = cs.invariance_plan(op, device.type, config.quick)
        probe, others = cs.make_invariance_inputs(plan, config.seed)
        for cell in (c for c in live if c.op == op):
            start = time.perf_counter()
            cell.invariance = check_invariance(plan, probe, others, DTYPES[cell.dtype], cell.backend, device)
            counter(
                f"{cell.op} {cell.dtype} {cell.backend} invariance (batches {plan.batches}, V={plan.vocab}): "
                f"{cell.invariance.verdict} [{cell.invariance.details}] ({time.perf_counter() - start:.1f}s)"
            )
    return list(cells.values())


class _Counter:
    """Numbers progress lines: ``[done/total] message``."""

    def __init__(self, total: int, sink: Callable[[str], None]):
        self.total, self.done, self.sink = total, 0, sink

    def __call__(self, message: str) -> None:
        self.done += 1
        self.sink(f"[{self.done}/{self.total}] {message}")


def value_cases(op: str, device_type: str, quick: bool) -> list[cs.Case | rl.RLCase | chain.ChainCase]:
    """The value cases of any op of the matrix."""
    if op in rl.RL_OPS:
        return rl.value_cases(op, device_type, quick)
    if family(op) is not None:
        return family(op).value_cases(op, device_type, quick)
    return cs.value_cases(op, device_type, quick)


def _collect_invariance(
    plan, backend: str, run_checks: Callable[[Callable[[int, int, object], None]], None]
) -> InvarianceResult:
    """An InvarianceResult for ``plan`` on ``backend``: ``run_checks(report)`` reports each (batch, position,
    differs); an exception becomes the result's error."""
    result = InvarianceResult(claims_invariance(backend), plan)
    try:
        run_checks(lambda batch, position, differs: result.checks.append(InvarianceCheck(batch, position, differs)))
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
    return result


def check_rl_invariance(plan: rl.RLInvariancePlan, seed: int, backend: str, device: torch.device) -> InvarianceResult:
    """Batch invariance of an RL op (:func:`parity.rl.invariance_checks`) on ``backend``."""
    return _collect_invariance(plan, backend, lambda report: rl.invariance_checks(plan, seed, backend, device, report))


def check_chain_invariance(
    plan: chain.ChainInvariancePlan, seed: int, backend: str, device: torch.device, dtype: torch.dtype
) -> InvarianceResult:
    """Batch invariance of a chain (or distill) op (:func:`parity.chain.invariance_checks`) on ``backend`` in
    ``dtype``."""
    return _collect_invariance(
        plan, backend, lambda report: family(plan.op).invariance_checks(plan, seed, backend, device, dtype, report)
    )


def _check_case(
    cell: Cell, case, check: Callable[[], list[contract.Deviation]], progress: Callable[[str], None]
) -> None:
    """Run ``check()`` (forward, backward, comparison) pinned to the cell's backend; record and report it."""
    result = CaseResult(case)
    start = time.perf_counter()
    try:
        with rlk.use_backend(cell.backend):
            result.deviations = check()
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
    result.seconds = time.perf_counter() - start
    cell.results.append(result)
    progress(_case_line(cell, result))


def _rl_check(case: rl.RLCase, low, truth) -> list[contract.Deviation]:
    return rl.compare(case, rl.forward_backward(case.op, case.kwargs, low), truth)


def _logprob_check(op: str, dtype: torch.dtype, low, entropy: bool, truth) -> list[contract.Deviation]:
    return compare(op, dtype, forward_backward(op, low, entropy), truth)


def _run_rl_case(config: Config, case: rl.RLCase, cells: list[Cell], progress: Callable[[str], None]) -> None:
    """One value case of an RL op (float32) on every backend of ``cells`` (ground truth computed once)."""
    device = config.device
    todo = [c for c in cells if c.dtype == "float32"]
    if not todo:
        return
    base = rl.make_inputs(case, config.seed)
    truth, truth_error = None, None
    try:
        truth = rl.ground_truth(case, base, device)
    except Exception as exc:
        truth_error = f"ground truth: {type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
    low = rl.cast(base, torch.float32, device)
    for cell in todo:
        if truth_error is not None:
            result = CaseResult(case, error=truth_error)
            cell.results.append(result)
            progress(_case_line(cell, result))
            continue
        _check_case(cell, case, functools.partial(_rl_check, case, low, truth), progress)
    del low, truth
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _chain_check(case: chain.ChainCase, dtype: torch.dtype, low, truth) -> list[contract.Deviation]:
    module = family(case.op)
    return module.compare(case, dtype, module.forward_backward(case.op, case.kwargs, low), truth)


def _run_chain_case(config: Config, case: chain.ChainCase, cells: list[Cell], progress: Callable[[str], None]) -> None:
    """One value case of a chain op in every dtype on every backend of ``cells`` (ground truth per dtype, from
    the inputs as cast to it)."""
    device = config.device
    module = family(case.op)
    base = module.make_inputs(case, config.seed)
    for dtype in config.dtypes:
        todo = [c for c in cells if c.dtype == dtype]
        if not todo:
            continue
        low = module.cast(base, DTYPES[dtype], device)
        truth, truth_error = None, None
        try:
            truth = module.ground_truth(case, low)
        except Exception as exc:
            truth_error = f"ground truth: {type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
        for cell in todo:
            if truth_error is not None:
                result = CaseResult(case, error=truth_error)
                cell.results.append(result)
                progress(_case_line(cell, result))
                continue
            _check_case(cell, case, functools.partial(_chain_check, case, DTYPES[dtype], low, truth), progress)
        del low, truth
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _run_case(config: Config, case: cs.Case, cells: list[Cell], progress: Callable[[str], None]) -> None:
    """One value case in every dtype on every backend of ``cells`` (ground truth computed once per dtype)."""
    device = config.device
    base = cs.make_inputs(case, config.seed)
    for dtype in config.dtypes:
        todo = []
        for cell in (c for c in cells if c.dtype == dtype):
            reason = cs.skip_reason(cell.backend, device, case)
            if reason is None:
                todo.append(cell)
            else:
                cell.skipped.append((case, reason))
        if not todo:
            continue
        low = base.cast(DTYPES[dtype], device)
        truth = ground_truth(case.op, low, case.features.entropy)
        for cell in todo:
            check = functools.partial(_logprob_check, case.op, DTYPES[dtype], low, case.features.entropy, truth)
            _check_case(cell, case, check, progress)
        del low, truth
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _case_line(cell: Cell, result: CaseResult) -> str:
    head = f"{cell.op} {cell.dtype} {cell.backend} {result.case.label()}:"
    if result.error is not None:
        return f"{head} FAIL error {result.error} ({result.seconds:.1f}s)"
    worst = result.worst
    verdict = PASS if result.ok else FAIL
    return f"{head} {verdict} worst {worst.ratio:.3g} ({worst.name}) ({result.seconds:.1f}s)"
