"""The public op ``rlk.ema_`` on the reference and Triton backends against ``torch._foreach_lerp_(target, source,
1 - decay)`` and the fp64 reference under the contract, determinism, independence from the other tensors of the
list, autograd bookkeeping and bad input (errors name the argument)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import rlk
from rlk.core import contract, dispatch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
#: Odd sizes: empty, one element, one block of the Triton kernel +- 1, several blocks.
SIZES = [0, 1, 3, 7, 4095, 4096, 4097, 100, 9000, 1, 0, 33]


def _backends(dtype):
    names = ["reference"]
    if dispatch.why_not("triton", rlk.core.abi.OPS["ema"], DEVICE, dtype) is None:
        names.append("triton")
    return names


def _lists(dtype, sizes=SIZES, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    targets = [(torch.randn(n, generator=g) * scale).to(dtype).to(DEVICE) for n in sizes]
    sources = [(torch.randn(n, generator=g) * scale).to(dtype).to(DEVICE) for n in sizes]
    return targets, sources


def _run(backend, targets, sources, decay):
    out = [t.clone() for t in targets]
    with rlk.use_backend(backend):
        assert rlk.ema_(out, sources, decay) is None
    return out


def _within_one_ulp(got, want, t, s):
    """|got - want| <= 1 ulp of the dtype at max(|t|, |s|) (the size of the lerp's inputs), elementwise."""
    eps = torch.finfo(got.dtype).eps
    tiny = torch.finfo(got.dtype).smallest_normal * eps
    bound = eps * torch.maximum(t.double().abs(), s.double().abs()) + tiny
    return bool(((got.double() - want.double()).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("decay", [0.999, 0.9, 0.5, 0.3, 0.0, 1.0])
def test_matches_foreach_lerp(dtype, decay):
    targets, sources = _lists(dtype)
    want = [t.clone() for t in targets]
    torch._foreach_lerp_(want, sources, 1 - decay)
    for backend in _backends(dtype):
        got = _run(backend, targets, sources, decay)
        for i, (g, w, t, s) in enumerate(zip(got, want, targets, sources)):
            assert g.dtype == dtype and g.shape == w.shape
            assert _within_one_ulp(g, w, t, s), (backend, i)
        if decay in (0.0, 1.0):  # a copy of source / target: exact
            assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_against_fp64_reference_under_the_contract(dtype):
    targets, sources = _lists(dtype, seed=1, scale=3.0)
    truth = _run("reference", [t.double() for t in targets], [s.double() for s in sources], 0.99)
    e = contract.entry("ema", dtype)
    for backend in _backends(dtype):
        got = _run(backend, targets, sources, 0.99)
        for g, r, t, s in zip(got, truth, targets, sources):
            scale = t.double().abs() + s.double().abs()
            assert bool(((g.double() - r).abs() <= e.atol + e.rtol * scale).all()), backend


#: Whether the Triton kernel's ``tl.fma`` rounds once: on a GPU and in interpreters after Triton 3.6 (3.6's evaluates
#: a multiply and an add, each rounded, as the reference does).
def _kernel_fma_fused() -> bool:
    import triton

    return DEVICE.type != "cpu" or tuple(int(p) for p in triton.__version__.split(".")[:2]) > (3, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_against_the_reference_bitwise_where_both_unfused(dtype):
    """Where the kernel's fma is evaluated unfused (the Triton 3.6 interpreter), like the reference: the same bits;
    where it is fused, within one ulp of the dtype measured against the inputs."""
    if "triton" not in _backends(dtype):
        pytest.skip("the Triton backend is not installed (CI and the GPU runs require it: RLK_REQUIRE_BACKENDS)")
    targets, sources = _lists(dtype, seed=2)
    eps = torch.finfo(dtype).eps
    for decay in (0.99, 0.2):
        ref = _run("reference", targets, sources, decay)
        tri = _run("triton", targets, sources, decay)
        if not _kernel_fma_fused():
            assert all(torch.equal(a, b) for a, b in zip(ref, tri))
            continue
        for a, b, t, s in zip(ref, tri, targets, sources):
            bound = eps * torch.maximum(t.double().abs(), s.double().abs()) + 1e-30
            assert bool(((a.double() - b.double()).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_and_independent_of_the_other_tensors(dtype):
    targets, sources = _lists(dtype, seed=3)
    probe_t, probe_s = targets[7], sources[7]  # 100 elements
    for backend in _backends(dtype):
        a = _run(backend, targets, sources, 0.95)
        b = _run(backend, targets, sources, 0.95)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        alone = _run(backend, [probe_t], [probe_s], 0.95)[0]
        first = _run(backend, [probe_t] + targets[:3], [probe_s] + sources[:3], 0.95)[0]
        last = _run(backend, targets[8:] + [probe_t], sources[8:] + [probe_s], 0.95)[-1]
        assert torch.equal(alone, a[7]) and torch.equal(alone, first) and torch.equal(alone, last)
        negative = _run(backend, [probe_t], [probe_s], 0.9)[0]  # the check can fail
        assert not torch.equal(alone, negative)


def test_mixed_dtypes_tuples_and_2d_shapes():
    g = torch.Generator().manual_seed(4)
    targets = (torch.randn(5, 7, generator=g), torch.randn(3, generator=g).half(), torch.randn(2, 2, generator=g))
    sources = (torch.randn(5, 7, generator=g), torch.randn(3, generator=g).half(), torch.randn(2, 2, generator=g))
    targets = tuple(t.to(DEVICE) for t in targets)
    sources = tuple(s.to(DEVICE) for s in sources)
    want = [t.clone() for t in targets]
    torch._foreach_lerp_(want, list(sources), 0.25)
    got = [t.clone() for t in targets]
    rlk.ema_(tuple(got), sources, 0.75)
    assert all(_within_one_ulp(a, b, t, s) for a, b, t, s in zip(got, want, targets, sources))
    rlk.ema_([], [], 0.5)  # nothing to do


def test_parameters_that_require_grad():
    w = torch.nn.Parameter(torch.randn(10, device=DEVICE))
    src = torch.randn(10, device=DEVICE)
    before, version = w.detach().clone(), w._version
    rlk.ema_([w], [src], 0.9)
    assert w.requires_grad and w.grad_fn is None and w._version > version
    want = before.clone()
    torch._foreach_lerp_([want], [src], 0.1)
    assert _within_one_ulp(w.detach(), want, before, src)


def test_bad_input_names_the_argument():
    t = [torch.zeros(4), torch.zeros(3)]
    s = [torch.zeros(4), torch.zeros(3)]
    with pytest.raises(TypeError, match="target"):
        rlk.ema_(torch.zeros(4), s, 0.5)
    with pytest.raises(TypeError, match=r"source\[1\]"):
        rlk.ema_(t, [torch.zeros(4), 3.0], 0.5)
    with pytest.raises(ValueError, match="source: expected 2"):
        rlk.ema_(t, s[:1], 0.5)
    with pytest.raises(ValueError, match=r"source\[1\]: expected shape"):
        rlk.ema_(t, [torch.zeros(4), torch.zeros(4)], 0.5)
    with pytest.raises(TypeError, match=r"source\[0\]: expected dtype"):
        rlk.ema_(t, [torch.zeros(4).half(), torch.zeros(3)], 0.5)
    with pytest.raises(TypeError, match=r"target\[0\]: expected dtype"):
        rlk.ema_([torch.zeros(4, dtype=torch.int64)], [torch.zeros(4, dtype=torch.int64)], 0.5)
    with pytest.raises(ValueError, match=r"target\[1\]: expected a contiguous"):
        rlk.ema_([torch.zeros(4), torch.zeros(3, 2).t()], [torch.zeros(4), torch.zeros(2, 3)], 0.5)
    with pytest.raises(ValueError, match=r"source\[1\]: expected a contiguous"):
        rlk.ema_([torch.zeros(4), torch.zeros(2, 3)], [torch.zeros(4), torch.zeros(3, 2).t()], 0.5)
    with pytest.raises(ValueError, match=r"target\[1\]: overlaps target\[0\]"):
        rlk.ema_([t[0], t[0]], [s[0], s[0]], 0.5)
    for bad in (-0.1, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="decay"):
            rlk.ema_(t, s, bad)
    for bad in (True, "0.9", None):
        with pytest.raises(TypeError, match="decay"):
            rlk.ema_(t, s, bad)
    if torch.device("meta") != DEVICE:
        with pytest.raises(ValueError, match=r"target\[1\]: expected device"):
            rlk.ema_([torch.zeros(4), torch.zeros(3, device="meta")], s, 0.5)


def _bits(x):
    """The bits of ``x`` as integers (``torch.equal`` on them compares NaNs too)."""
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


@pytest.mark.parametrize("dtype", DTYPES)
def test_endpoints_are_exact_whatever_the_values(dtype):
    """decay = 1 leaves every target bit as it is and decay = 0 copies every source bit, over NaN, +-inf, -0.0 and
    extreme values on either side (lerp's 0 * inf and inf - inf would make NaNs), on every backend."""
    special = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1.5, -2.0, torch.finfo(dtype).max]
    n = len(special)
    target = torch.tensor(special, dtype=torch.float64).repeat_interleave(n).to(dtype).to(DEVICE)
    source = torch.tensor(special, dtype=torch.float64).repeat(n).to(dtype).to(DEVICE)  # every pair of values
    for backend in _backends(dtype):
        kept = _run(backend, [target, target[:5]], [source, source[:5]], 1.0)
        copied = _run(backend, [target, target[:5]], [source, source[:5]], 0.0)
        for got, want in zip(kept + copied, [target, target[:5], source, source[:5]]):
            assert torch.equal(_bits(got), _bits(want)), backend


def test_overlapping_targets_are_refused():
    """Views sharing elements would be updated twice (and, on Triton, in any order): refused by their addresses;
    adjacent views and a source that is its own target are fine."""
    a = torch.arange(8.0, device=DEVICE)
    b = torch.arange(8.0, device=DEVICE) + 100
    cases = [
        ([a, a[1:3]], [b, b[1:3]], r"^target\[1\]: overlaps target\[0\]"),
        ([a[4:], b, a[2:5]], [b[4:], a.new_zeros(8), b[2:5]], r"^target\[2\]: overlaps target\[0\]"),
        ([a.view(2, 4), a.view(torch.float16)], [b.view(2, 4), b.view(torch.float16)], r"^target\[1\]: overlaps"),
        ([a[:4], b[:4]], [b[2:6], b[:4]], r"^source\[0\]: overlaps target\[1\]"),
        ([a[:4]], [a[1:5]], r"^source\[0\]: overlaps target\[0\]"),
    ]
    for targets, sources, message in cases:
        before = [t.clone() for t in targets]
        with pytest.raises(ValueError, match=message):
            rlk.ema_(targets, sources, 0.5)
        assert all(torch.equal(t, u) for t, u in zip(targets, before))  # refused before writing anything
    halves, other = [a[:4], a[4:]], [b[:4], b[4:]]
    rlk.ema_(halves, other, 0.5)  # adjacent views: fine
    assert torch.equal(a, (torch.arange(8.0, device=DEVICE) + 50).to(a.dtype))
    c = torch.randn(6, device=DEVICE)
    want = c.clone()
    rlk.ema_([c], [c], 0.9)  # a source that is its own target
    assert torch.equal(c, want)
