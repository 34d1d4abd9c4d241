"""Property-based fuzzing of the options and inputs every public op must check the same way (profiles, backends and
repro lines: ``fuzz_support.py``; what is fuzzed and how to run it: ``docs/fuzzing.md``; the ops' calls:
``public_calls.py``).

Properties:

* every boolean option of the public API (found from the signatures, ``public_calls.bool_options``) refuses anything
  but a bool (strings, ints, floats, None, NumPy bools, lists), with a TypeError naming the option
  (``rlk.core.checks.flag``);
* ``torch.compile(fullgraph=True)`` of an op given ``loss_spans`` (random tables: empty, overlapping, empty and
  whole-row spans, int32 / int64, with or without tags, ``span_tags`` or not) gives the eager loss and gradient bit
  for bit, value checks on or off (``RLK_CHECK_VALUES``);
* the dtype rule (``rlk.core.checks.same_dtype``): each floating data input of an op drawn in its own dtype, the call
  is refused, naming the first input that breaks the rule, exactly when the rule says so (float64 all or none; the
  GEMM operands in one dtype), and runs otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import public_calls
import pytest
import torch
from fuzz_support import FILTERS, LONG, ON_GPU, backends, fuzz_run, interpreted, on_backend, seeds
from hypothesis import strategies as st

pytestmark = FILTERS

# =============================================================================================
# boolean options
# =============================================================================================

#: Every public boolean option (found from the signatures).
BOOL_OPTIONS = public_calls.bool_options()

not_bools = st.one_of(
    st.text(max_size=6),
    st.integers(-(2**40), 2**40),
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([np.bool_(True), np.bool_(False), np.int64(1), [True], (False,), torch.tensor(True), b"False"]),
)


@dataclass(frozen=True)
class BoolCase:
    """One boolean option given a non-bool ``value``."""

    op: str
    option: str
    value: object


@st.composite
def bool_cases(draw) -> BoolCase:
    op, option = draw(st.sampled_from(BOOL_OPTIONS))
    return BoolCase(op, option, draw(not_bools))


def check_bool_option_refuses(backend: str, case: BoolCase) -> None:
    with on_backend(backend), pytest.raises((TypeError, ValueError)) as info:
        public_calls.call_option(case.op, case.option, case.value)
    assert str(info.value).startswith(f"{case.option}: expected a bool, got"), info.value


def test_boolean_options_refuse_non_bools():
    """The checks are in the op layer, before any backend is chosen: the reference backend stands for all."""
    fuzz_run(check_bool_option_refuses, "reference", bool_cases(), ci=20)


# =============================================================================================
# torch.compile with loss_spans
# =============================================================================================


@dataclass(frozen=True)
class SpanCase:
    """An op of ``public_calls.SPAN_OPS`` on ``[b, t]`` inputs from ``seed`` with the span table ``rows`` (``(seq,
    start, end, tag)``; the tag column dropped when not ``tagged``), ``span_tags`` ``tags`` and value checks on or
    off."""

    op: str
    b: int
    t: int
    rows: tuple[tuple[int, int, int, int], ...]
    tagged: bool
    tags: tuple[int, ...] | None
    int64: bool
    check_values: bool
    seed: int

    def table(self) -> torch.Tensor:
        width = 4 if self.tagged else 3
        table = torch.tensor([row[:width] for row in self.rows], dtype=torch.int64).reshape(len(self.rows), width)
        return table if self.int64 else table.to(torch.int32)


def _span_ops(backend: str) -> list[str]:
    """The ops of the property; under the interpreter not ``fused_linear_policy_loss`` but in the long profile
    (its Triton kernels take about 10 s there)."""
    ops = sorted(public_calls.SPAN_OPS)
    return ops if LONG or not interpreted(backend) else [op for op in ops if op != "fused_linear_policy_loss"]


@st.composite
def span_cases(draw, backend: str) -> SpanCase:
    small = interpreted(backend) and not LONG
    b = draw(st.integers(1, 2 if small else 4))
    t = draw(st.integers(1, 5 if small else 12))

    def row(draw_) -> tuple[int, int, int, int]:
        start = draw_(st.integers(0, t))
        end = draw_(st.integers(start, t))
        return draw_(st.integers(0, b - 1)), start, end, draw_(st.integers(0, 2))

    rows = tuple(draw(st.lists(st.builds(lambda _: row(draw), st.none()), max_size=5)))
    tagged = draw(st.booleans())
    tags = (
        draw(st.one_of(st.none(), st.lists(st.integers(0, 2), min_size=1, max_size=2).map(tuple))) if tagged else None
    )
    return SpanCase(
        draw(st.sampled_from(_span_ops(backend))),
        b,
        t,
        rows,
        tagged,
        tags,
        draw(st.booleans()),
        draw(st.booleans()),
        draw(seeds),
    )


def check_compiled_spans_equal_eager(backend: str, case: SpanCase) -> None:
    with pytest.MonkeyPatch.context() as env, on_backend(backend):
        env.setenv("RLK_CHECK_VALUES", "1" if case.check_values else "0")
        (eager, eager_grad), (compiled, compiled_grad) = public_calls.eager_and_compiled(
            case.op, case.table(), case.seed, case.b, case.t, case.tags
        )
    assert torch.equal(compiled, eager), f"loss: {compiled} compiled, {eager} eager"
    assert torch.equal(compiled_grad, eager_grad), "the gradients differ"


# public_calls.SPAN_OPS builds its inputs on the CPU: on a GPU machine the backends that serve only the GPU (Triton
# there) are left out; the CPU run checks them under the interpreter
SPAN_COMPILE_BACKENDS = [
    param
    for param in backends("selected_logprob", "policy_loss", "kl_penalty", "value_loss")
    if not ON_GPU or param.values == ("reference",)
]


@pytest.mark.parametrize("backend", SPAN_COMPILE_BACKENDS)
def test_compile_fullgraph_with_loss_spans_equals_eager(backend):
    fuzz_run(check_compiled_spans_equal_eager, backend, span_cases(backend), ci=2)


# =============================================================================================
# the dtype rule
# =============================================================================================

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class DtypeCase:
    """An op of ``public_calls.DTYPE_CASES`` with each floating data input in its own dtype (by name)."""

    op: str
    dtypes: tuple[tuple[str, str], ...]


@st.composite
def dtype_cases(draw) -> DtypeCase:
    op = draw(st.sampled_from(sorted(public_calls.DTYPE_CASES)))
    names = list(public_calls.DTYPE_CASES[op].inputs())
    return DtypeCase(op, tuple((name, draw(st.sampled_from(sorted(DTYPES)))) for name in names))


def refused_name(case: DtypeCase) -> str | None:
    """The argument the rule refuses (the first input that breaks it against the main one), or None."""
    exact = set(public_calls.DTYPE_CASES[case.op].exact)
    (_, main), *rest = case.dtypes
    for name, dtype in rest:
        if dtype != main and (name in exact or "float64" in (dtype, main)):
            return name
    return None


def check_dtype_rule(backend: str, case: DtypeCase) -> None:
    spec = public_calls.DTYPE_CASES[case.op]
    inputs = {name: x.to(DTYPES[dtype]) for (name, dtype), x in zip(case.dtypes, spec.inputs().values())}
    refused = refused_name(case)
    with on_backend(backend):
        if refused is not None:
            with pytest.raises(TypeError, match=rf"^{refused}: expected (float64|the dtype)"):
                spec.call(inputs)
        elif backend == "reference":  # accepted: runs (other backends may decline float64 or 16-bit GEMMs)
            spec.call(inputs)


@pytest.mark.parametrize("backend", backends("policy_loss", "value_loss", "dpo_loss", "linear_logprob"))
def test_mixed_dtypes_follow_one_rule(backend):
    fuzz_run(check_dtype_rule, backend, dtype_cases(), ci=10)
