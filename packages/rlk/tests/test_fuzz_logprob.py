"""Property-based fuzzing of the log-prob ops ``selected_logprob`` and ``linear_logprob`` (profiles, backends and
repro lines: ``fuzz_support.py``; what is fuzzed and how to run it: ``docs/fuzzing.md``).

The calls, the fp64 ground truth and the comparison are the parity suite's (``parity.run.forward_backward``,
``ground_truth``, ``compare``: the loss ``sum(c1 * logprob + c2 * entropy)``, per-row contract scales
``1 + |lse| + |z_target|``, gradients by relative L2); this module draws the inputs.

Properties (each a test; every backend that implements the op, batch invariance on those declaring it):

* agreement with the fp64 ground truth under the contract, forward and gradient; finite log-prob, entropy
  and gradients (``-inf`` logits, never a whole row nor a target, included); ``logprob <= 0`` and
  ``entropy >= 0``; ignored rows give exactly 0 and a zero gradient row;
* ignored rows never influence a result: NaN / +-inf in their logits (hidden states) versus 0 give bitwise
  equal outputs and gradients, ``grad_weight`` included;
* batch invariance: a row alone versus at a random position among other rows (own scale, per-row
  temperature, some ignored): its log-prob, entropy and gradient row are bitwise equal.

No exclusions: logits reach +-1e4 and temperatures 0.05 (scaled logits 2e5), all representable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from fuzz_support import (
    DEVICE,
    DTYPES,
    FILTERS,
    backend_op_pairs,
    check_equal,
    check_finite,
    dtype_names,
    fuzz_run,
    generator,
    limit,
    on_backend,
    seeds,
    sizes,
)
from hypothesis import strategies as st

from parity import cases as parity_cases
from parity import run as parity_run
from rlk.core import contract

pytestmark = FILTERS

IGNORE = parity_cases.IGNORE_INDEX


@dataclass(frozen=True)
class LogprobCase:
    """One call of ``op`` on ``n`` rows over ``v`` classes (``h``: the hidden size of ``linear_logprob``)."""

    op: str
    n: int
    v: int
    h: int
    seed: int
    dtype: str = "float32"
    temperature: float | str = 1.0  # a number, or "row": a per-row tensor in [0.05, 2]
    ignored: float = 0.2  # share of ignored rows (1.0: all of them)
    logits: str = "normal"  # "normal" (std 3, target lifted), "large" (+-1e4), "shifted" (1e4 + normal), "neg_inf"
    entropy: bool = True


@st.composite
def logprob_cases(draw, backend: str, op: str, one_row: bool = False) -> LogprobCase:
    kinds = ["normal", "large", "shifted"] + (["neg_inf"] if op == "selected_logprob" else [])
    return LogprobCase(
        op=op,
        n=1 if one_row else draw(sizes(0, limit(backend, 17, 512))),
        v=draw(sizes(1, limit(backend, 300, 40000))),
        h=draw(sizes(1, limit(backend, 33, 512))) if op == "linear_logprob" else 0,
        seed=draw(seeds),
        dtype=draw(st.sampled_from(dtype_names(backend, op))),
        temperature=draw(st.sampled_from([1.0, "row", 0.05, 0.7, 2.0])),
        ignored=0.0 if one_row else draw(st.sampled_from([0.2, 0.0, 1.0])),
        logits=draw(st.sampled_from(kinds)),
        entropy=draw(st.booleans()),
    )


def logprob_inputs(case: LogprobCase) -> parity_cases.Inputs:
    """fp32 CPU inputs (``parity.cases.Inputs``; cast them with ``.cast``)."""
    g = generator(case.seed)
    n, v = case.n, case.v
    targets = torch.randint(0, v, (n,), generator=g)
    weight = None
    if case.op == "selected_logprob":
        x = torch.randn(n, v, generator=g) * 3
        x[torch.arange(n), targets] += torch.rand(n, generator=g) * 8  # sampled tokens are usually likely ones
        if case.logits == "large":
            x = (torch.rand(n, v, generator=g) * 2 - 1) * 1e4
        elif case.logits == "shifted":
            x = x + 1e4
        elif case.logits == "neg_inf":
            hole = torch.rand(n, v, generator=g) < 0.3
            hole[torch.arange(n), targets] = False  # never the target, so never the whole row
            x = x.masked_fill(hole, -math.inf)
    else:
        x = torch.randn(n, case.h, generator=g)
        weight = torch.randn(v, case.h, generator=g) * (3 / math.sqrt(case.h))
        if case.logits == "large":
            x = x * (1e4 / (4 * 3))  # logits of std ~2500, max ~1e4
        elif case.logits == "shifted":
            weight[:, 0] += 1e4  # every logit of a row shifted by about 1e4 * hidden[:, 0]
            x[:, 0] = 1.0
    targets[torch.rand(n, generator=g) < case.ignored] = IGNORE
    if case.temperature == "row":
        temperature = 0.05 + 1.95 * torch.rand(n, generator=g)
    else:
        temperature = float(case.temperature)
    return parity_cases.Inputs(
        x, weight, targets, temperature, torch.randn(n, generator=g), torch.randn(n, generator=g)
    )


def check_logprob_matches_reference(backend: str, case: LogprobCase) -> None:
    """Log-prob, entropy and gradients against the fp64 ground truth (of the inputs as cast to the dtype) under
    the contract; finite; ``logprob <= 0``, ``entropy >= 0``; ignored rows exactly 0 with zero gradient rows."""
    low = logprob_inputs(case).cast(DTYPES[case.dtype], DEVICE)
    with on_backend(backend):
        got = parity_run.forward_backward(case.op, low, case.entropy)
    truth = parity_run.ground_truth(case.op, low, case.entropy) if case.n else None
    if truth is not None:
        for dev in parity_run.compare(case.op, DTYPES[case.dtype], got, truth):
            assert dev.ok, f"{case.op} {dev.name}: {dev} (worst deviation / allowed = {dev.ratio:.3g})"
    check_finite("logprob", got.logprob)
    assert bool((got.logprob <= 0).all()), f"logprob > 0: max {got.logprob.max().item()!r}"
    if got.entropy is not None:
        check_finite("entropy", got.entropy)
        assert bool((got.entropy >= 0).all()), f"entropy < 0: min {got.entropy.min().item()!r}"
    ignored = low.targets == IGNORE
    check_equal("logprob of ignored rows", got.logprob[ignored], torch.zeros_like(got.logprob[ignored]))
    if got.entropy is not None:
        check_equal("entropy of ignored rows", got.entropy[ignored], torch.zeros_like(got.entropy[ignored]))
    grad_rel_l2 = contract.entry(case.op, DTYPES[case.dtype]).grad_rel_l2
    for name, grad in got.grads.items():
        # finite wherever the exact gradient is representable with the contract's relative error to spare: beyond
        # the dtype's largest value a correctly rounded inf is the right answer (float16 weight gradients at
        # temperature 0.05, say), and so is inf for a true 65504.15 computed within the contract as 65520
        fits = None
        if truth is not None:
            true_grad = truth.outputs.grads[name].double().abs()
            fits = true_grad * (1.0 + grad_rel_l2) <= torch.finfo(grad.dtype).max
        check_finite(name, grad, fits)
        if name != "grad_weight":
            check_equal(f"{name} of ignored rows", grad[ignored], torch.zeros_like(grad[ignored]))


def check_logprob_ignored_rows(backend: str, case: LogprobCase) -> None:
    """NaN / +-inf in the logits (hidden states) of ignored rows versus 0 there: bitwise equal log-prob,
    entropy and gradients (``grad_weight`` included)."""
    low = logprob_inputs(case).cast(DTYPES[case.dtype], DEVICE)
    ignored = (low.targets == IGNORE)[:, None].expand_as(low.x)
    pick = torch.randint(0, 3, low.x.shape, generator=generator(case.seed + 1)).to(DEVICE)
    bad_values = torch.tensor([math.nan, math.inf, -math.inf], dtype=low.x.dtype, device=DEVICE)[pick]
    bad = parity_cases.Inputs(
        torch.where(ignored, bad_values, low.x), low.weight, low.targets, low.temperature, low.c1, low.c2
    )
    clean = parity_cases.Inputs(
        low.x.masked_fill(ignored, 0.0), low.weight, low.targets, low.temperature, low.c1, low.c2
    )
    with on_backend(backend):
        a = parity_run.forward_backward(case.op, bad, case.entropy)
        b = parity_run.forward_backward(case.op, clean, case.entropy)
    check_equal("logprob", a.logprob, b.logprob)
    check_equal("entropy", a.entropy, b.entropy)
    for name in a.grads:
        check_equal(name, a.grads[name], b.grads[name])


@dataclass(frozen=True)
class LogprobRowInBatch:
    """A probe row inside ``others`` other rows (own values from ``seed``) at ``position``."""

    probe: LogprobCase
    others: int
    position: int
    seed: int


@st.composite
def logprob_rows_in_batch(draw, backend: str, op: str) -> LogprobRowInBatch:
    probe = draw(logprob_cases(backend, op, one_row=True))
    others = draw(sizes(1, limit(backend, 17, 512)))
    return LogprobRowInBatch(probe, others, draw(st.integers(0, others)), draw(seeds))


def check_logprob_batch_invariance(backend: str, case: LogprobRowInBatch) -> None:
    """The probe row alone versus inside the batch: bitwise equal log-prob, entropy and gradient row (the
    batch's rows have their own scale and per-row temperature, about a quarter ignored)."""
    probe = logprob_inputs(case.probe)
    if not isinstance(probe.temperature, torch.Tensor):
        probe = parity_cases.Inputs(
            probe.x, probe.weight, probe.targets, torch.full((1,), probe.temperature), probe.c1, probe.c2
        )
    g = generator(case.seed)
    others = logprob_inputs(replace(case.probe, n=case.others, seed=case.seed, temperature="row", ignored=0.25))
    scale = 0.5 + 3.5 * torch.rand(case.others, 1, generator=g)
    others = parity_cases.Inputs(
        others.x * scale, probe.weight, others.targets, others.temperature, others.c1, others.c2
    )
    batch = parity_cases.embed_probe(probe, others, case.others + 1, case.position)
    dtype = DTYPES[case.probe.dtype]
    with on_backend(backend):
        alone = parity_run.forward_backward(case.probe.op, probe.cast(dtype, DEVICE), case.probe.entropy)
        inside = parity_run.forward_backward(case.probe.op, batch.cast(dtype, DEVICE), case.probe.entropy)
    row = slice(case.position, case.position + 1)
    check_equal("logprob of the row", inside.logprob[row], alone.logprob)
    check_equal("entropy of the row", inside.entropy if inside.entropy is None else inside.entropy[row], alone.entropy)
    for name, grad in alone.grads.items():
        if name != "grad_weight":  # a sum over rows
            check_equal(f"{name} of the row", inside.grads[name][row], grad)


OPS = ("selected_logprob", "linear_logprob")


@pytest.mark.parametrize("backend, op", backend_op_pairs(OPS))
def test_logprob_matches_reference(backend, op):
    fuzz_run(check_logprob_matches_reference, backend, logprob_cases(backend, op), ci=6)


@pytest.mark.parametrize("backend, op", backend_op_pairs(OPS))
def test_logprob_ignored_rows_never_matter(backend, op):
    fuzz_run(check_logprob_ignored_rows, backend, logprob_cases(backend, op), ci=4)


@pytest.mark.parametrize("backend, op", backend_op_pairs(OPS, invariant_only=True))
def test_logprob_batch_invariance(backend, op):
    fuzz_run(check_logprob_batch_invariance, backend, logprob_rows_in_batch(backend, op), ci=4)
