"""Shared pieces of the property-based fuzz suite (``test_fuzz_*.py``): profiles, backends, dtypes, sizes,
contract checks, poisoning of masked positions and the repro line printed with every failure.

Profiles (environment variable ``RLK_FUZZ``):

* ``ci`` (the default): a few examples per property and small shapes, from a seed fixed per property
  and backend (every run draws the same examples); the CPU suite runs the Triton kernels through the
  interpreter (``TRITON_INTERPRET=1``), where every program is slow, so they get the fewest.
* ``long``: many examples (200 per property, ``RLK_FUZZ_EXAMPLES=N`` for another number) and larger
  shapes, drawn at random on every run; on a GPU machine the ops run on CUDA tensors with every backend
  installed there (triton, cuda, reference).

Neither profile writes a hypothesis database (``database=None``). A failure prints hypothesis's
falsifying example (the drawn case, a frozen dataclass whose ``repr`` is Python; shrunk to a minimal one
in the long profile or with ``RLK_FUZZ_SHRINK=1``) and a ``repro:`` line with a command that runs the same
check on the same case outside pytest.

Inputs are built from each case's ``seed`` with a CPU ``torch.Generator`` (the same values on every
device), then moved to :data:`DEVICE`.
"""

from __future__ import annotations

import math
import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the Triton backend on the CPU

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import strategies as st

import rlk
from rlk.core import abi, contract, dispatch

PROFILE = os.environ.get("RLK_FUZZ", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"RLK_FUZZ: expected 'ci' or 'long', got {PROFILE!r}")
LONG = PROFILE == "long"
#: Examples per property in the long profile.
LONG_EXAMPLES = int(os.environ.get("RLK_FUZZ_EXAMPLES", "200"))
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"

#: Shrinking a failing case reruns the op many times (minutes under the interpreter): on in the long profile,
#: off in the CI profile unless ``RLK_FUZZ_SHRINK=1`` (the CI examples are the same, so a CI failure can be
#: shrunk locally that way). Hypothesis's "explain" phase (it traces every line) is off.
SHRINK = os.environ.get("RLK_FUZZ_SHRINK", "1" if LONG else "0") == "1"
PHASES = tuple(p for p in Phase if p is not Phase.explain and (SHRINK or p is not Phase.shrink))

FP32_MAX = torch.finfo(torch.float32).max
#: ``exp(x)`` overflows float32 above this (``log(FP32_MAX)``).
EXP_LIMIT = math.log(FP32_MAX)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
POISONS = (math.nan, math.inf, -math.inf)

# The interpreter evaluates both branches of tl.where on masked lanes, and the poisoned inputs overflow
# on purpose: numpy's warnings are expected.
FILTERS = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:underflow encountered:RuntimeWarning"),
]


def fuzz_run(check, backend: str, cases: st.SearchStrategy, ci: int) -> None:
    """Run ``check(backend, case)`` on examples of ``cases`` (a strategy of frozen dataclasses).

    The ``ci`` profile draws ``ci`` examples on a backend running in the Triton interpreter and three times as
    many elsewhere, from a seed fixed per check and backend (the same examples every run); the ``long`` profile
    draws :data:`LONG_EXAMPLES` at random. A failure prints hypothesis's falsifying case (shrunk, see :data:`PHASES`)
    and a repro line.
    """
    examples = LONG_EXAMPLES if LONG else (ci if interpreted(backend) else 3 * ci)

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        print_blob=False,
        phases=PHASES,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=cases)
    def run(case):
        env = "TRITON_INTERPRET=1 " if interpreted(backend) else ""
        note(
            f'repro: cd packages/rlk/tests && {env}python -c "from {check.__module__} import *; '
            f'{check.__name__}({backend!r}, {case!r})"'
        )
        check(backend, case)

    if not LONG:
        run = seed(zlib.crc32(f"{check.__name__} {backend}".encode()))(run)
    run()


# ---------------------------------------------------------------------------
# backends and dtypes
# ---------------------------------------------------------------------------


def _marks(name: str) -> list:
    if name == "reference":
        return []
    if name == "triton" and not ON_GPU:
        return [pytest.mark.triton_interpreter]
    return [pytest.mark.gpu]


def backend_names(*ops: str, invariant_only: bool = False) -> list[str]:
    """Every loaded backend that implements all of ``ops`` (``invariant_only``: those declaring
    ``batch_invariant``)."""
    names = []
    for name, status in dispatch.discover().items():
        backend = status.backend
        if backend is None or not all(p in backend.primitives for op in ops for p in abi.OPS[op].primitives):
            continue
        if ON_GPU and not (status.available and DEVICE.type in backend.device_types()):
            continue  # on a GPU machine the params are not deselected: only a backend that serves the GPU
        if invariant_only and not backend.batch_invariant:
            continue
        names.append(name)
    return names


def backends(*ops: str, invariant_only: bool = False) -> list:
    """pytest params of :func:`backend_names`. Off the reference, a backend needs a GPU (mark ``gpu``), or on the
    CPU the Triton interpreter (mark ``triton_interpreter``); conftest deselects what this machine cannot run."""
    names = backend_names(*ops, invariant_only=invariant_only)
    return [pytest.param(name, marks=_marks(name), id=name) for name in names]


def backend_op_pairs(ops: tuple[str, ...], invariant_only: bool = False) -> list:
    """pytest params ``(backend, op)``: each op with every backend that implements it."""
    return [
        pytest.param(name, op, marks=_marks(name), id=f"{name}-{op}")
        for op in ops
        for name in backend_names(op, invariant_only=invariant_only)
    ]


def dtype_names(backend: str, op: str, candidates: tuple[str, ...] = tuple(DTYPES)) -> list[str]:
    """The candidate dtypes ``backend`` serves for ``op`` on :data:`DEVICE` (the Triton interpreter
    declines bfloat16 for several ops)."""
    ok = [name for name in candidates if dispatch.why_not(backend, abi.OPS[op], DEVICE, DTYPES[name]) is None]
    assert ok, f"{backend} serves none of {candidates} for {op} on {DEVICE}"
    return ok


def interpreted(backend: str) -> bool:
    """Whether ``backend`` runs its kernels in the Triton interpreter here (slow: small shapes)."""
    return backend == "triton" and not ON_GPU


def limit(backend: str, ci: int, long: int) -> int:
    """A size bound: ``long`` on a GPU and for the reference backend under the long profile, else ``ci``
    (the CI profile, and the Triton interpreter, where every program is slow)."""
    return long if ON_GPU or (LONG and not interpreted(backend)) else ci


# ---------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------

#: Sizes that are not tile multiples, and the edges 0 and 1.
AWKWARD = (0, 1, 2, 3, 5, 7, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 255, 257, 1000, 1025, 4097)
#: The seed of a case's tensors.
seeds = st.integers(0, 2**31 - 1)


def sizes(lo: int, hi: int) -> st.SearchStrategy[int]:
    """An int in ``[lo, hi]``, often one of :data:`AWKWARD`; 0 (when ``lo`` is 0) about one draw in ten, so that
    a few examples are not spent on empty shapes (shrinks towards the smallest non-empty size)."""
    if hi < 1:
        return st.just(0)
    first = max(lo, 1)
    picks = [v for v in AWKWARD if first <= v <= hi]
    ints = st.integers(first, hi)
    core = st.one_of(st.sampled_from(picks), ints) if picks else ints
    if lo > 0:
        return core
    return st.tuples(st.integers(0, 9), core).map(lambda pair: 0 if pair[0] == 5 else pair[1])


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


MASK_KINDS = ("holes", "ragged", "scattered", "full", "empty")


def make_mask(b: int, t: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """A ``[B, T]`` bool mask: ``holes`` (ragged with holes, as multi-turn observation tokens); ``ragged``
    (right-padded rows of random lengths, row 0 full, row 2 empty); ``scattered``; ``full``; ``empty``."""
    if kind == "full":
        return torch.ones(b, t, dtype=torch.bool)
    if kind == "empty":
        return torch.zeros(b, t, dtype=torch.bool)
    if kind == "scattered":
        return torch.rand(b, t, generator=gen) < 0.5
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    if b:
        lengths[0] = t
    if b > 2:
        lengths[2] = 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if kind == "holes":
        mask &= torch.rand(b, t, generator=gen) > 0.3
    return mask


def cast(x: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """The floating tensors (masks aside) in ``dtype``, everything on the device."""
    out = {}
    for name, value in x.items():
        if value.is_floating_point() and name != "mask":
            value = value.to(DTYPES[dtype])
        out[name] = value.to(DEVICE)
    return out


def grad_or_zeros(leaf: torch.Tensor | None) -> torch.Tensor | None:
    if leaf is None:
        return None
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def sprinkle(x: torch.Tensor, magnitude: float, gen: torch.Generator) -> torch.Tensor:
    """``x`` with ~15% of its entries replaced by ``+-magnitude`` (none when 0)."""
    if magnitude == 0:
        return x
    hit = torch.rand(x.shape, generator=gen) < 0.15
    sign = torch.where(torch.rand(x.shape, generator=gen) < 0.5, 1.0, -1.0)
    return torch.where(hit, sign * magnitude, x)


@dataclass(frozen=True)
class RowInBatch:
    """A probe case of one row inside a batch: ``others`` more rows (their own values from ``seed``), the probe
    at ``position``, every row ``pad`` positions longer than the probe's (masked, zero)."""

    probe: object
    others: int
    position: int
    pad: int
    seed: int


@st.composite
def rows_in_batch(draw, probe: st.SearchStrategy, max_others: int, max_pad: int) -> RowInBatch:
    case = draw(probe)
    others = draw(sizes(1, max_others))
    return RowInBatch(case, others, draw(st.integers(0, others)), draw(sizes(0, max_pad)), draw(seeds))


def padded_row(x: dict[str, torch.Tensor], pad: int, per_token: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The ``[1, T]`` tensors ``per_token`` of ``x`` extended by ``pad`` zero positions (False for a bool mask)."""
    out = dict(x)
    for name in per_token:
        if name in x:
            value = x[name]
            out[name] = torch.cat([value, torch.zeros(1, pad, dtype=value.dtype, device=value.device)], dim=1)
    return out


def insert_row(probe: dict[str, torch.Tensor], others: dict[str, torch.Tensor], position: int) -> dict:
    return {name: torch.cat([others[name][:position], probe[name], others[name][position:]]) for name in probe}


def to_device(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.to(DEVICE) for name, value in x.items()}


def as64(x: dict) -> dict:
    """fp64 copies of the floating tensors (the ground truth's inputs); the rest as is."""
    return {name: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for name, v in x.items()}


def as32(x: dict) -> dict:
    """fp32 copies of the floating tensors (what the op layer upcasts 16-bit inputs to)."""
    return {name: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for name, v in x.items()}


def poisoned(x: torch.Tensor, where: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``x`` with the positions ``where`` replaced by NaN, +inf or -inf (drawn per position)."""
    where = where.expand(x.shape)
    pick = torch.randint(0, len(POISONS), x.shape, generator=gen)
    bad = torch.tensor(POISONS, dtype=x.dtype)[pick].to(x.device)
    return torch.where(where.to(x.device), bad, x)


def zeroed(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``x`` with the positions ``where`` replaced by 0."""
    return torch.where(where.expand(x.shape).to(x.device), torch.zeros((), dtype=x.dtype, device=x.device), x)


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------


def check_value(entry: contract.Entry, name: str, got: torch.Tensor, truth: torch.Tensor, scale) -> None:
    """``got`` against the fp64 ground truth under the contract (``rlk.core.contract.compare_outputs``)."""
    truth = truth.detach().double().reshape(-1)
    scale = torch.as_tensor(scale, dtype=torch.float64, device=truth.device).reshape(-1).expand(truth.shape)
    dev = contract.compare_outputs(entry, name, got.detach().reshape(-1), truth, scale)
    assert dev.ok, f"{entry.op} {name}: {dev} (worst |got - truth| / allowed = {dev.ratio:.3g})"


def check_grad(
    entry: contract.Entry,
    name: str,
    got: torch.Tensor,
    truth: torch.Tensor,
    max_scale: float,
    magnitude: torch.Tensor | None = None,
) -> None:
    """A gradient against the fp64 ground truth under the contract (``rlk.core.contract.compare_grad``; ``magnitude``:
    its terms by absolute value, where they may cancel)."""
    assert got is not None, f"{entry.op} {name}: no gradient"
    assert got.shape == truth.shape, f"{entry.op} {name}: shape {tuple(got.shape)}, expected {tuple(truth.shape)}"
    dev = contract.compare_grad(entry, name, got, truth, max_scale, magnitude)
    assert dev.ok, f"{entry.op} {name}: {dev} (relative L2 error / allowed = {dev.ratio:.3g})"


def check_finite(what: str, x: torch.Tensor | None, where: torch.Tensor | None = None) -> None:
    """Every entry of ``x`` (where ``where``) is finite."""
    if x is None:
        return
    bad = ~torch.isfinite(x)
    if where is not None:
        bad &= where.expand(x.shape).to(x.device)
    if bool(bad.any()):
        i = bad.reshape(-1).nonzero()[0, 0].item()
        raise AssertionError(
            f"{what}: not finite ({x.reshape(-1)[i].item()}) at flat position {i} "
            f"({int(bad.sum())} of {bad.numel()} entries)"
        )


def check_equal(what: str, got, want) -> None:
    """Bit-for-bit equality (``torch.equal``), with where the first difference is. A NaN matches a NaN at the same
    position (whether an output may be NaN at all is the agreement properties' business)."""
    if got is None or want is None:
        assert got is None and want is None, f"{what}: one side is None"
        return
    if torch.equal(got, want):
        return
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}")
    differs = ~((got == want) | (torch.isnan(got) & torch.isnan(want)))
    if not bool(differs.any()):
        return
    i = differs.reshape(-1).nonzero()[0, 0].item()
    raise AssertionError(
        f"{what}: not bitwise equal; first difference at flat position {i}: "
        f"{got.reshape(-1)[i].item()!r} vs {want.reshape(-1)[i].item()!r} "
        f"({int(differs.sum())} of {differs.numel()} entries differ)"
    )


def bits(x: torch.Tensor) -> torch.Tensor:
    """The bits of ``x`` as integers of its width (a NaN's payload and a zero's sign count)."""
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def check_bits(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit equality, NaN payloads and signed zeros included (:func:`check_equal` on the bits)."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} vs {want.dtype}"
    check_equal(f"{what} (bits)", bits(got), bits(want))


def on_backend(backend: str):
    """Pin ``backend`` for the calls of a block (``rlk.use_backend``)."""
    return rlk.use_backend(backend)


def on_reference():
    return rlk.use_backend("reference")
