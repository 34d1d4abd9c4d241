"""Property-based fuzzing of the positions an op leaves out (profiles, backends and repro lines: ``fuzz_support.py``;
what is fuzzed and how to run it: ``docs/fuzzing.md``).

Every op that takes a mask, ignored targets or ``loss_spans`` treats a position left out as absent: NaN, +inf or
-inf there (drawn per element) versus 0 gives bitwise equal (``torch.equal``) outputs and gradients, the weight's
gradient included. The dense-mask forms are fuzzed beside each op's other properties: ``policy_loss``,
``value_loss`` and ``fused_linear_policy_loss`` (its hidden states too) in ``test_fuzz_policy.py``,
``masked_whiten``, ``discounted_returns`` and ``gae`` in ``test_fuzz_advantages.py``, the ignored rows of
``selected_logprob`` and ``linear_logprob`` in ``test_fuzz_logprob.py``. This module adds (each a test, on every
backend that implements the op):

* the positions off ``loss_spans`` (tagged or not, some tags selected by ``span_tags``; a table on the CPU or on the
  device) of ``selected_logprob``, ``linear_logprob``, ``policy_loss``, ``kl_penalty``, ``value_loss`` and
  ``fused_linear_policy_loss`` (both modes): every per-token input there (logits, hidden states, log-probs,
  advantages, reference log-probs, entropy, importance weights, values, returns);
* the ignored rows of ``fused_linear_kl`` (student and teacher hidden states; every divergence and reduction) and of
  ``rlk.distributed.vocab_parallel_linear_logprob`` (hidden states; the shards' weight gradients; 1, 2 and 4
  simulated ranks);
* the masked positions of ``rollout_correction`` (both log-probs; every level and mode).

No exclusions: the values that are kept are ordinary (log-ratios within +-2, logits of a few units).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from fuzz_support import (
    DEVICE,
    DTYPES,
    FILTERS,
    MASK_KINDS,
    backend_names,
    check_equal,
    dtype_names,
    fuzz_run,
    generator,
    grad_or_zeros,
    interpreted,
    limit,
    make_mask,
    on_backend,
    poisoned,
    seeds,
    sizes,
    zeroed,
)
from hypothesis import strategies as st

import rlk
from rlk.core import abi
from rlk.distributed import SimulatedGroup, vocab_parallel_linear_logprob

pytestmark = FILTERS

IGNORE = -100


def _marks(name: str) -> list:
    if name == "reference":
        return []
    return [pytest.mark.triton_interpreter] if interpreted(name) else [pytest.mark.gpu]


def _params(pairs: list[tuple[str, str]]) -> list:
    return [pytest.param(backend, op, marks=_marks(backend), id=f"{backend}-{op}") for backend, op in pairs]


def _outputs_equal(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> None:
    assert set(a) == set(b), f"{sorted(a)} vs {sorted(b)}"
    for name in a:
        check_equal(name, a[name], b[name])


# =============================================================================================
# positions off loss_spans
# =============================================================================================

#: Each op with loss_spans, and the ABI ops a backend must implement to run it.
SPAN_OPS = {
    "selected_logprob": ("selected_logprob",),
    "linear_logprob": ("linear_logprob",),
    "policy_loss": ("policy_loss",),
    "kl_penalty": ("kl_penalty",),
    "value_loss": ("value_loss",),
    "fused_linear_policy_loss": ("linear_logprob", "policy_loss"),
}


@dataclass(frozen=True)
class SpanCase:
    """One call of ``op`` on ``[B, T]`` positions with a span table of ``spans`` rows drawn from ``seed``."""

    op: str
    b: int
    t: int
    seed: int
    spans: int
    tags: tuple[int, ...] | None = None  # span_tags (then the table has a tag column in 0..2)
    host_table: bool = True  # the table on the CPU (else on the device)
    v: int = 0  # vocabulary of the log-prob ops
    h: int = 0  # hidden size of linear_logprob and fused_linear_policy_loss
    dtype: str = "float32"
    kwargs: tuple[tuple[str, object], ...] = ()


@st.composite
def span_cases(draw, backend: str, op: str) -> SpanCase:
    kw: dict[str, object] = {}
    if op in ("policy_loss", "fused_linear_policy_loss", "value_loss"):
        kw["agg"] = draw(st.sampled_from(abi.AGG_MODES))
        if kw["agg"] == "seq-mean-token-sum-norm":
            kw["loss_scale"] = draw(st.sampled_from([1.0, 17.0]))
    if op in ("policy_loss", "fused_linear_policy_loss"):
        kw["loss"] = draw(st.sampled_from(abi.LOSSES))
        if draw(st.booleans()):
            kw |= {"kl_coef": 0.1, "kl": draw(st.sampled_from(abi.KL_ESTIMATORS))}
        if draw(st.booleans()):
            kw["entropy_coef"] = draw(st.sampled_from([0.01, -0.5]))
        if op == "policy_loss" and draw(st.booleans()):
            kw["importance_weights"] = True
        if op == "fused_linear_policy_loss":
            one_pass = backend in backend_names("linear_logprob_stored") and draw(st.booleans())
            kw["mode"] = "one_pass" if one_pass else "lean"
            kw["chunk_tokens"] = draw(st.sampled_from([1, 5, 2048]))
    elif op == "kl_penalty":
        kw |= {"estimator": draw(st.sampled_from(abi.KL_ESTIMATORS)), "straight_through": draw(st.booleans())}
        if draw(st.booleans()):
            kw["old_logprob"] = True
    elif op == "value_loss":
        kw["clip"] = draw(st.sampled_from([None, 0.2]))
    logprob_op = op in ("selected_logprob", "linear_logprob", "fused_linear_policy_loss")
    hidden = op in ("linear_logprob", "fused_linear_policy_loss")
    return SpanCase(
        op=op,
        b=draw(sizes(1, limit(backend, 3, 8))),
        t=draw(sizes(1, limit(backend, 9, 129))),
        seed=draw(seeds),
        spans=draw(st.integers(0, 4)),
        tags=draw(st.sampled_from([None, (0,), (1, 2)])),
        host_table=draw(st.booleans()),
        v=draw(sizes(1, limit(backend, 33, 1000))) if logprob_op else 0,
        h=draw(sizes(1, limit(backend, 17, 64))) if hidden else 0,
        dtype=draw(st.sampled_from(dtype_names(backend, SPAN_OPS[op][0], ("float32", "float16")))),
        kwargs=tuple(sorted(kw.items())),
    )


def span_table(case: SpanCase, g: torch.Generator) -> torch.Tensor:
    """An int32 ``[S, 4]`` table (``[S, 3]`` without tags): random rows, spans in range, empty ones and overlaps
    included."""
    seq = torch.randint(0, case.b, (case.spans,), generator=g)
    ends = torch.randint(0, case.t + 1, (2, case.spans), generator=g).sort(dim=0).values
    tag = torch.randint(0, 3, (case.spans,), generator=g)
    table = torch.stack([seq, ends[0], ends[1], tag], dim=1).to(torch.int32)
    return table if case.tags is not None else table[:, :3]


def span_inputs(case: SpanCase) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The per-token inputs of a case (CPU, fp32), its span table and the ``[B, T]`` positions off the spans."""
    g = generator(case.seed)
    b, t = case.b, case.t
    lp = -torch.rand(b, t, generator=g) * 4 - 0.05
    x: dict[str, torch.Tensor] = {}
    if case.op == "selected_logprob":
        x["logits"] = torch.randn(b, t, case.v, generator=g) * 3
    if case.op in ("linear_logprob", "fused_linear_policy_loss"):
        x["hidden"] = torch.randn(b, t, case.h, generator=g)
        x["weight"] = torch.randn(case.v, case.h, generator=g) * (3 / math.sqrt(case.h))
    if case.op in ("selected_logprob", "linear_logprob", "fused_linear_policy_loss"):
        x["targets"] = torch.randint(0, case.v, (b, t), generator=g)
    if case.op in ("policy_loss", "kl_penalty"):
        x["logprob"] = lp
    if case.op in ("policy_loss", "fused_linear_policy_loss", "kl_penalty"):
        x["old_logprob"] = lp - 0.3 * torch.randn(b, t, generator=g)
        x["ref_logprob"] = lp - 0.5 * torch.randn(b, t, generator=g)
    if case.op in ("policy_loss", "fused_linear_policy_loss"):
        x["advantages"] = torch.randn(b, t, generator=g)
    if case.op == "policy_loss":
        x["entropy"] = torch.rand(b, t, generator=g) * 2
        x["importance_weights"] = torch.rand(b, t, generator=g) + 0.5
    if case.op == "value_loss":
        x["values"] = torch.randn(b, t, generator=g)
        x["old_values"] = x["values"] + 0.3 * torch.randn(b, t, generator=g)
        x["returns"] = torch.randn(b, t, generator=g)
    table = span_table(case, g)
    off = ~rlk.ops.spans.mask(table.long(), (b, t), tags=case.tags)
    return x, table, off


def span_call(case: SpanCase, x: dict[str, torch.Tensor], table: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """The op with ``loss_spans`` on the pinned backend, and its backward: outputs and gradients by name."""
    dtype = DTYPES[case.dtype]
    kw = dict(case.kwargs)
    spans = {"loss_spans": table if case.host_table else table.to(DEVICE), "span_tags": case.tags}
    leaf = {}

    def tensor(name: str, grad: bool = False) -> torch.Tensor:
        value = x[name].to(DEVICE)
        if value.is_floating_point():
            value = value.to(dtype)
        if grad:
            value = value.detach().requires_grad_()
            leaf[name] = value
        return value

    c = torch.randn(2, case.b, case.t, generator=generator(case.seed + 2)).to(DEVICE)
    out: dict[str, torch.Tensor | None] = {}
    if case.op in ("selected_logprob", "linear_logprob"):
        if case.op == "selected_logprob":
            lp, ent = rlk.selected_logprob(tensor("logits", True), tensor("targets"), return_entropy=True, **spans)
        else:
            args = (tensor("hidden", True), tensor("weight", True), tensor("targets"))
            lp, ent = rlk.linear_logprob(*args, return_entropy=True, **spans)
        out |= {"logprob": lp, "entropy": ent}
        loss = (c[0] * lp + c[1] * ent).sum()
    elif case.op == "kl_penalty":
        old = tensor("old_logprob") if kw.pop("old_logprob", False) else None
        kl = rlk.kl_penalty(tensor("logprob", True), tensor("ref_logprob"), old_logprob=old, **kw, **spans)
        out["kl"] = kl
        loss = (c[0] * kl).sum()
    elif case.op == "value_loss":
        loss, metrics = rlk.value_loss(tensor("values", True), tensor("old_values"), tensor("returns"), **kw, **spans)
        out |= metrics
    elif case.op == "policy_loss":
        iw = tensor("importance_weights") if kw.pop("importance_weights", False) else None
        entropy = tensor("entropy", True) if kw.get("entropy_coef") else None
        ref = tensor("ref_logprob") if kw.get("kl_coef") else None
        loss, metrics = rlk.policy_loss(
            tensor("logprob", True),
            tensor("old_logprob"),
            tensor("advantages"),
            importance_weights=iw,
            ref_logprob=ref,
            entropy=entropy,
            **kw,
            **spans,
        )
        out |= metrics
    else:  # fused_linear_policy_loss
        ref = tensor("ref_logprob") if kw.get("kl_coef") else None
        loss, metrics, entropy = rlk.fused_linear_policy_loss(
            tensor("hidden", True),
            tensor("weight", True),
            tensor("targets"),
            tensor("old_logprob"),
            tensor("advantages"),
            ref_logprob=ref,
            return_entropy=True,
            **kw,
            **spans,
        )
        out |= metrics | {"entropy": entropy}
    loss.backward()
    out["loss"] = loss.detach()
    out |= {f"grad_{name}": grad_or_zeros(value) for name, value in leaf.items()}
    return out


def check_off_span_positions(backend: str, case: SpanCase) -> None:
    """NaN / +-inf in every per-token input at the positions off the spans (the whole row of logits or hidden
    states) versus 0 there: bitwise equal outputs and gradients."""
    x, table, off = span_inputs(case)
    g = generator(case.seed + 1)
    rows = off[..., None]
    poison = [name for name, v in x.items() if v.is_floating_point() and name != "weight"]
    bad = {n: (poisoned(v, rows if v.dim() == 3 else off, g) if n in poison else v) for n, v in x.items()}
    clean = {n: (zeroed(v, rows if v.dim() == 3 else off) if n in poison else v) for n, v in x.items()}
    with on_backend(backend):
        _outputs_equal(span_call(case, bad, table), span_call(case, clean, table))


SPAN_PAIRS = [(backend, op) for op, needs in SPAN_OPS.items() for backend in backend_names(*needs)]


@pytest.mark.parametrize(("backend", "op"), _params(SPAN_PAIRS))
def test_positions_off_the_loss_spans_never_matter(backend, op):
    fuzz_run(check_off_span_positions, backend, span_cases(backend, op), ci=1)


# =============================================================================================
# ignored rows of fused_linear_kl and vocab_parallel_linear_logprob
# =============================================================================================


@dataclass(frozen=True)
class IgnoredRowsCase:
    """``n`` rows over ``v`` classes (hidden sizes ``h`` and, for the teacher, ``ht``), a share ``ignored`` of them
    ignored (one at least); ``ranks`` simulated ranks of the vocab-parallel op (``v`` a multiple of it)."""

    op: str
    n: int
    v: int
    h: int
    seed: int
    ignored: float = 0.3
    ht: int = 0
    divergence: str = "forward_kl"
    beta: float = 0.5
    reduction: str = "mean"
    temperature: float = 1.0
    ranks: int = 1
    entropy: bool = True
    dtype: str = "float32"


@st.composite
def ignored_rows_cases(draw, backend: str, op: str) -> IgnoredRowsCase:
    ranks = draw(st.sampled_from([1, 2, 4])) if op == "vocab_parallel_linear_logprob" else 1
    abi_op = "linear_logprob" if op == "vocab_parallel_linear_logprob" else op
    return IgnoredRowsCase(
        op=op,
        n=draw(sizes(1, limit(backend, 9, 257))),
        v=ranks * draw(sizes(1, limit(backend, 17, 1000))),
        h=draw(sizes(1, limit(backend, 17, 64))),
        seed=draw(seeds),
        ignored=draw(st.sampled_from([0.3, 1.0])),
        ht=draw(sizes(1, limit(backend, 17, 64))),
        divergence=draw(st.sampled_from(abi.DIVERGENCES)),
        beta=draw(st.sampled_from([0.5, 0.1])),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        temperature=draw(st.sampled_from([1.0, 0.7])),
        ranks=ranks,
        entropy=draw(st.booleans()),
        dtype=draw(st.sampled_from(dtype_names(backend, abi_op, ("float32", "float16")))),
    )


def ignored_rows_call(case: IgnoredRowsCase, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    dtype = DTYPES[case.dtype]
    c = torch.randn(2, case.n, generator=generator(case.seed + 2)).to(DEVICE)
    hidden = x["hidden"].to(DEVICE, dtype).requires_grad_()
    targets = x["targets"].to(DEVICE)
    if case.op == "fused_linear_kl":
        weight = x["weight"].to(DEVICE, dtype).requires_grad_()
        loss = rlk.fused_linear_kl(
            hidden,
            weight,
            x["teacher_hidden"].to(DEVICE, dtype),
            x["teacher_weight"].to(DEVICE, dtype),
            targets,
            divergence=case.divergence,
            beta=case.beta,
            temperature=case.temperature,
            reduction=case.reduction,
        )
        (c[0] * loss).sum().backward()
        return {"loss": loss.detach(), "grad_hidden": grad_or_zeros(hidden), "grad_weight": grad_or_zeros(weight)}
    shards = [w.to(DEVICE, dtype).requires_grad_() for w in x["weight"].chunk(case.ranks)]
    out = vocab_parallel_linear_logprob(
        hidden,
        shards,
        targets,
        group=SimulatedGroup(case.ranks),
        temperature=case.temperature,
        return_entropy=case.entropy,
    )
    lp, ent = out if case.entropy else (out, None)
    (c[0] * lp + (0.0 if ent is None else c[1] * ent)).sum().backward()
    grads = {f"grad_weight_shard_{r}": grad_or_zeros(w) for r, w in enumerate(shards)}
    return {"logprob": lp.detach(), "entropy": ent, "grad_hidden": grad_or_zeros(hidden)} | grads


def check_ignored_rows(backend: str, case: IgnoredRowsCase) -> None:
    """NaN / +-inf in the hidden states of the ignored rows (the student's and the teacher's) versus 0 there:
    bitwise equal outputs and gradients, every weight gradient included."""
    g = generator(case.seed)
    x = {
        "hidden": torch.randn(case.n, case.h, generator=g),
        "weight": torch.randn(case.v, case.h, generator=g) * (3 / math.sqrt(case.h)),
        "teacher_hidden": torch.randn(case.n, case.ht, generator=g),
        "teacher_weight": torch.randn(case.v, case.ht, generator=g) * (3 / math.sqrt(case.ht)),
        "targets": torch.randint(0, case.v, (case.n,), generator=g),
    }
    ignored = (torch.rand(case.n, generator=g) < case.ignored) | (torch.arange(case.n) == case.seed % case.n)
    x["targets"][ignored] = IGNORE
    g = generator(case.seed + 1)
    names = ("hidden", "teacher_hidden")
    rows = ignored[:, None]
    bad = {n: (poisoned(v, rows, g) if n in names else v) for n, v in x.items()}
    clean = {n: (zeroed(v, rows) if n in names else v) for n, v in x.items()}
    with on_backend(backend):
        _outputs_equal(ignored_rows_call(case, bad), ignored_rows_call(case, clean))


#: The vocab-parallel op runs on the backends with tree-aligned shard kernels (rlk.distributed._kernels).
SHARD_BACKENDS = ("reference", "triton")
IGNORED_PAIRS = [(backend, "fused_linear_kl") for backend in backend_names("fused_linear_kl")] + [
    (backend, "vocab_parallel_linear_logprob")
    for backend in backend_names("linear_logprob")
    if backend in SHARD_BACKENDS
]


@pytest.mark.parametrize(("backend", "op"), _params(IGNORED_PAIRS))
def test_ignored_rows_never_matter(backend, op):
    fuzz_run(check_ignored_rows, backend, ignored_rows_cases(backend, op), ci=1)


# =============================================================================================
# masked positions of rollout_correction
# =============================================================================================


@dataclass(frozen=True)
class RolloutCase:
    b: int
    t: int
    seed: int
    mask: str = "holes"
    level: str = "token"
    mode: str = "truncate"
    lower: float | None = None


@st.composite
def rollout_cases(draw, backend: str) -> RolloutCase:
    return RolloutCase(
        b=draw(sizes(1, limit(backend, 3, 64))),
        t=draw(sizes(1, limit(backend, 17, 300))),
        seed=draw(seeds),
        mask=draw(st.sampled_from(MASK_KINDS)),
        level=draw(st.sampled_from(["token", "sequence"])),
        mode=draw(st.sampled_from(["truncate", "mask"])),
        lower=draw(st.sampled_from([None, 0.5])),
    )


def check_rollout_correction_masked_positions(backend: str, case: RolloutCase) -> None:
    """NaN / +-inf in both log-probs at the masked positions versus 0 there: bitwise equal weights and metrics."""
    g = generator(case.seed)
    lp = -torch.rand(case.b, case.t, generator=g) * 4
    x = {"old": lp, "rollout": lp - 0.3 * torch.randn(case.b, case.t, generator=g)}
    mask = make_mask(case.b, case.t, case.mask, g)
    g = generator(case.seed + 1)
    results = []
    for values in ({n: poisoned(v, ~mask, g) for n, v in x.items()}, {n: zeroed(v, ~mask) for n, v in x.items()}):
        with on_backend(backend):
            w, metrics = rlk.rollout_correction(
                values["old"].to(DEVICE),
                values["rollout"].to(DEVICE),
                mask.to(DEVICE),
                level=case.level,
                mode=case.mode,
                lower=case.lower,
            )
        results.append({"weights": w} | metrics)
    _outputs_equal(*results)


@pytest.mark.parametrize(
    "backend", [pytest.param(b, marks=_marks(b), id=b) for b in backend_names("rollout_correction")]
)
def test_rollout_correction_masked_positions_never_matter(backend):
    fuzz_run(check_rollout_correction_masked_positions, backend, rollout_cases(backend), ci=1)
