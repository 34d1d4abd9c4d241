"""The public varlen packing ops (``rlk.pack`` / ``rlk.unpack``) on the reference and Triton backends: exact
round trips for left / right padding and holes, ``cu_seqlens`` and position ids against a Python loop, the
gradients (fp64 gradcheck; each op's backward is the other op, bit for bit), batch invariance, the ``total``
argument, torch.library integration and bad input."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import rlk
from rlk.core import abi, dispatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _available(name: str) -> bool:
    return dispatch.why_not(name, abi.OPS["pack"], DEVICE, torch.float32) is None


BACKENDS = [
    "reference",
    pytest.param("triton", marks=pytest.mark.skipif(not _available("triton"), reason="triton backend unavailable")),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    with rlk.use_backend(request.param):
        yield request.param


def _gen(seed):
    return torch.Generator().manual_seed(seed)


#: [B, T] masks: right padding, left padding, holes, a fully padded row, all valid.
MASKS = {
    "right": [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]],
    "left": [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]],
    "holes": [[1, 0, 1, 1, 0], [0, 1, 0, 0, 1], [0, 0, 0, 0, 0]],
    "full": [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]],
}


def _data(shape, dtype, seed=0):
    g = _gen(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    return torch.randint(-1000, 50000, shape, generator=g).to(dtype).to(DEVICE)


def _mask(name, dtype=torch.int64):
    return torch.tensor(MASKS[name], device=DEVICE).to(dtype)


def loop_pack(x, mask):
    """The spec as the plainest loop: packed rows, cu_seqlens, position ids."""
    rows, cu, pos = [], [0], []
    for b in range(mask.shape[0]):
        k = 0
        for t in range(mask.shape[1]):
            if int(mask[b, t]):
                rows.append(x[b, t])
                pos.append(k)
                k += 1
        cu.append(cu[-1] + k)
    packed = torch.stack(rows) if rows else x.new_empty((0, *x.shape[2:]))
    return packed, torch.tensor(cu, dtype=torch.int32), torch.tensor(pos, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("trailing", [(), (3,), (2, 5)], ids=["scalar", "3", "2x5"])
@pytest.mark.parametrize("layout", list(MASKS))
def test_round_trip_is_exact(backend, layout, trailing, dtype):
    mask = _mask(layout)
    x = _data((3, 5, *trailing), dtype, seed=len(trailing))
    packed, cu, pos = rlk.pack(x, mask)
    want, want_cu, want_pos = loop_pack(x, mask)
    assert packed.dtype == x.dtype and packed.shape == want.shape
    assert torch.equal(packed, want)
    assert cu.dtype == torch.int32 and torch.equal(cu.cpu(), want_cu)
    assert pos.dtype == torch.int64 and torch.equal(pos.cpu(), want_pos)
    back = rlk.unpack(packed, mask)
    keep = mask.bool().view(3, 5, *([1] * len(trailing)))
    assert torch.equal(back, torch.where(keep, x, torch.zeros_like(x)))
    fill = -7 if not dtype.is_floating_point else -7.5
    back = rlk.unpack(packed, mask, padding_value=fill)
    assert torch.equal(back, torch.where(keep, x, torch.full_like(x, fill)))


#: Fill values at each dtype's edge: (dtype, value, whether the dtype holds it exactly).
EDGE_FILLS = [
    (torch.int64, 2**53, True),
    (torch.int64, 2**53 + 1, False),  # a float64 on its way to the kernels: would be stored as 2**53
    (torch.int64, 2**53 + 2, True),
    (torch.int64, -(2**63), True),
    (torch.int64, 2**63 - 1, False),  # rounds to 2**63 as a float64
    (torch.int32, 2**31 - 1, True),
    (torch.int32, 2**31, False),
    (torch.int32, -(2**31), True),
    (torch.float16, 65504, True),
    (torch.float16, 65520, False),  # rounds to inf
    (torch.float16, 1e10, False),
    (torch.float16, 2.0**-24, True),  # the smallest subnormal
    (torch.float16, 2.0**-25, False),  # rounds to 0
    (torch.bfloat16, 1e10, False),  # rounds to 9999220736
    (torch.bfloat16, 2.0**127 * 1.5, True),
    (torch.float32, 0.1, False),
    (torch.float32, 16777217, False),  # 2**24 + 1
    (torch.float32, -16777216, True),
    (torch.float64, 0.1, True),
    (torch.float64, 2**53 + 1, False),  # an int beyond float64's integers
    (torch.float16, float("inf"), True),
    (torch.bfloat16, float("-inf"), True),
    (torch.float32, float("nan"), True),
]


@pytest.mark.parametrize("dtype, fill, exact", EDGE_FILLS, ids=[f"{d}-{v!r}" for d, v, _ in EDGE_FILLS])
def test_padding_value_is_exact_or_refused(backend, dtype, fill, exact):
    """A fill the dtype holds is stored exactly (inf, -inf and NaN too); any other is an error naming it. (float64
    runs on the reference backend whichever backend the fixture pins: Triton does not serve it.)"""
    if dtype == torch.float64 and backend != "reference":
        with rlk.use_backend("reference"):
            return test_padding_value_is_exact_or_refused("reference", dtype, fill, exact)
    mask = _mask("holes")
    packed, _, _ = rlk.pack(_data((3, 5), dtype, seed=3), mask)
    if not exact:
        with pytest.raises(ValueError, match="^padding_value: "):
            rlk.unpack(packed, mask, padding_value=fill)
        return
    out = rlk.unpack(packed, mask, padding_value=fill)
    padding = out[~mask.bool()]
    if fill != fill:
        assert bool(torch.isnan(padding).all())
    else:
        assert all(v == fill for v in padding.tolist()), padding.tolist()


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.uint8])
def test_mask_dtypes_and_int32_ids(backend, mask_dtype):
    mask = _mask("holes", mask_dtype)
    ids = _data((3, 5), torch.int32, seed=3)
    packed, cu, pos = rlk.pack(ids, mask)
    want, want_cu, want_pos = loop_pack(ids, mask)
    assert torch.equal(packed, want) and torch.equal(cu.cpu(), want_cu) and torch.equal(pos.cpu(), want_pos)
    assert torch.equal(rlk.unpack(packed, mask, padding_value=-100), ids.masked_fill(~mask.bool(), -100))


def test_wider_rows_and_non_contiguous_input(backend):
    g = _gen(4)
    mask = (torch.rand(4, 9, generator=g) < 0.6).to(DEVICE)
    base = _data((9, 4, 1100), torch.float32, seed=5)  # rows wider than one Triton block
    x = base.transpose(0, 1)  # [4, 9, 1100], not contiguous
    packed, cu, pos = rlk.pack(x, mask)
    assert torch.equal(packed, x[mask])
    assert torch.equal(rlk.unpack(packed, mask), x * mask[..., None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_backward_is_the_other_op(backend, dtype):
    mask = _mask("holes")
    x = _data((3, 5, 2, 3), dtype, seed=6).requires_grad_(True)
    packed, _, _ = rlk.pack(x, mask)
    grad_packed = _data(tuple(packed.shape), dtype, seed=7)
    packed.backward(grad_packed)
    assert x.grad.dtype == dtype
    assert torch.equal(x.grad, rlk.unpack(grad_packed, mask))

    p = packed.detach().clone().requires_grad_(True)
    out = rlk.unpack(p, mask, padding_value=3.0)
    grad_out = _data(tuple(out.shape), dtype, seed=8)
    out.backward(grad_out)
    assert torch.equal(p.grad, rlk.pack(grad_out, mask)[0])


def test_fp64_gradcheck():
    mask = _mask("holes")
    with rlk.use_backend("reference"):
        x = torch.randn(3, 5, 2, dtype=torch.float64, requires_grad=True, generator=_gen(9)).to(DEVICE)
        assert torch.autograd.gradcheck(lambda x: rlk.pack(x, mask)[0], (x,))
        p = torch.randn(5, 2, dtype=torch.float64, generator=_gen(10)).to(DEVICE).requires_grad_(True)
        assert torch.autograd.gradcheck(lambda p: rlk.unpack(p, mask, padding_value=1.5), (p,))


def test_a_rows_packed_values_do_not_depend_on_the_other_rows(backend):
    mask = _mask("holes")
    x = _data((3, 5, 4), torch.float32, seed=11)
    packed, cu, _ = rlk.pack(x, mask)
    for b in range(3):
        alone, alone_cu, _ = rlk.pack(x[b : b + 1], mask[b : b + 1])
        assert torch.equal(packed[cu[b] : cu[b + 1]], alone)
    other = x.clone()
    other[0] += 1.0  # changes row 0 only
    packed_other, _, _ = rlk.pack(other, mask)
    assert torch.equal(packed_other[cu[1] :], packed[cu[1] :])
    assert not torch.equal(packed_other[: cu[1]], packed[: cu[1]])  # negative control: the check can fail


def test_total_argument_and_value_checks(backend, monkeypatch):
    mask = _mask("left")
    x = _data((3, 5, 2), torch.float32, seed=12)
    packed, cu, pos = rlk.pack(x, mask)
    with pytest.raises(ValueError, match="total: expected the number of valid tokens of attention_mask, 9; got 8"):
        rlk.pack(x, mask, total=8)
    with pytest.raises(TypeError, match="total: expected an integer"):
        rlk.pack(x, mask, total=9.0)
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")  # no host synchronization at all
    given = rlk.pack(x, mask, total=9)
    assert all(torch.equal(a, b) for a, b in zip(given, (packed, cu, pos)))
    assert torch.equal(rlk.unpack(packed, mask), x * mask[..., None])


def test_empty_inputs(backend):
    for b, t in ((0, 4), (3, 0), (2, 3)):
        mask = torch.zeros(b, t, dtype=torch.bool, device=DEVICE)
        x = _data((b, t, 2), torch.float32).requires_grad_(True)
        packed, cu, pos = rlk.pack(x, mask)
        assert packed.shape == (0, 2) and cu.tolist() == [0] * (b + 1) and pos.shape == (0,)
        packed.sum().backward()
        assert torch.equal(x.grad, torch.zeros_like(x))
        assert torch.equal(rlk.unpack(packed.detach(), mask, padding_value=2.0), torch.full_like(x, 2.0))
    mask = _mask("right")
    x = _data((3, 5, 0), torch.float32)
    assert rlk.pack(x, mask)[0].shape == (9, 0)


def test_opcheck_custom_ops():
    mask = _mask("holes").reshape(-1)
    slot = torch.where(mask != 0, torch.cumsum(mask, 0) - 1, -1)
    x = torch.randn(15, 4, generator=_gen(13)).to(DEVICE).requires_grad_(True)
    packed = torch.randn(5, 4, generator=_gen(14)).to(DEVICE).requires_grad_(True)
    with rlk.use_backend("reference"):
        torch.library.opcheck(torch.ops.rlk.pack_fwd.default, (x, slot, 5))
        torch.library.opcheck(torch.ops.rlk.pack_bwd.default, (packed.detach(), slot, "reference"))
        torch.library.opcheck(torch.ops.rlk.unpack_fwd.default, (packed, slot, -1.0))
        torch.library.opcheck(torch.ops.rlk.unpack_bwd.default, (x.detach(), slot, 5, "reference"))


def test_torch_compile_fullgraph_matches_eager(backend):
    """With ``total`` given, pack and unpack trace into one graph (the value checks are skipped while tracing)."""
    mask = _mask("holes")

    def fn(x):
        packed, cu, pos = rlk.pack(x, mask, total=5)
        out = rlk.unpack(packed * 2, mask, padding_value=1.0)
        return packed, cu, pos, out, (out * out).sum()

    x = _data((3, 5, 3), torch.float32, seed=17)
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        leaf = x.clone().requires_grad_(True)
        *outs, loss = f(leaf)
        loss.backward()
        results.append([o.detach() for o in outs] + [leaf.grad])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: rlk.pack(torch.randn(2, 3), torch.ones(2, 3, 1, dtype=torch.int64)),
            ValueError,
            r"attention_mask: expected shape \[B, T\], got \(2, 3, 1\)",
        ),
        (
            lambda: rlk.pack(torch.randn(2, 3), torch.ones(2, 3)),
            TypeError,
            "attention_mask: expected dtype bool or an integer dtype",
        ),
        (
            lambda: rlk.pack(torch.randn(2, 3), [[1, 1, 1], [1, 1, 1]]),
            TypeError,
            "attention_mask: expected a torch.Tensor",
        ),
        (
            lambda: rlk.pack(torch.randn(2, 3), torch.tensor([[1, 2, 0], [1, 1, 1]])),
            ValueError,
            r"attention_mask: values must be 0 or 1 \(or bool\); found 2 at \[0, 1\]",
        ),
        (
            lambda: rlk.pack(torch.randn(3, 3, 4), torch.ones(2, 3, dtype=torch.bool)),
            ValueError,
            r"x: expected shape \[B, T, \*trailing\] with \[B, T\] = \[2, 3\]",
        ),
        (lambda: rlk.pack(torch.randn(6), torch.ones(2, 3, dtype=torch.bool)), ValueError, "x: expected shape"),
        (
            lambda: rlk.pack(torch.ones(2, 3, dtype=torch.int8), torch.ones(2, 3, dtype=torch.bool)),
            TypeError,
            "x: expected dtype float32, float16, bfloat16, float64, int32 or int64, got torch.int8",
        ),
        (
            lambda: rlk.pack(torch.randn(2, 3, device="meta"), torch.ones(2, 3, dtype=torch.bool)),
            ValueError,
            "x: expected device cpu",
        ),
        (
            lambda: rlk.pack(torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool), total=-1),
            ValueError,
            "total: expected an int >= 0",
        ),
        (
            lambda: rlk.unpack(torch.randn(5, 2), torch.ones(2, 3, dtype=torch.bool)),
            ValueError,
            r"packed: expected 6 rows \(the valid tokens of attention_mask\), got 5",
        ),
        (
            lambda: rlk.unpack(torch.tensor(1.0), torch.ones(1, 1, dtype=torch.bool)),
            ValueError,
            r"packed: expected shape \[total, \*trailing\]",
        ),
        (
            lambda: rlk.unpack(torch.ones(6, dtype=torch.int64), torch.ones(2, 3, dtype=torch.bool), padding_value=0.5),
            ValueError,
            "padding_value: expected an integer",
        ),
        (
            lambda: rlk.unpack(torch.ones(6), torch.ones(2, 3, dtype=torch.bool), padding_value=None),
            TypeError,
            "padding_value: expected an int or a float",
        ),
        (
            lambda: rlk.unpack(
                torch.ones(6, dtype=torch.int32), torch.ones(2, 3, dtype=torch.bool), padding_value=2**40
            ),
            ValueError,
            "padding_value: 1099511627776 does not fit",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_gpu_backend_matches_the_reference(dtype):
    g = _gen(15)
    mask = (torch.rand(16, 300, generator=g) < 0.7).cuda()
    x = _data((16, 300, 8, 64), dtype, seed=16).cuda()
    assert rlk.explain("pack", x).backend != "reference"
    packed, cu, pos = rlk.pack(x, mask)
    assert torch.equal(packed, x[mask])
    assert torch.equal(rlk.unpack(packed, mask), x * mask[..., None, None])
