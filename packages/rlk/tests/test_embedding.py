"""The public embedding op (``rlk.ops.embedding.embedding``) on the reference backend: the gather against
``torch.nn.functional.embedding``, the position-ordered weight gradient against a plain loop and
the fp64 truth under the contract, autograd, torch.library integration and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rlk
from rlk.core import contract
from rlk.ops.embedding import embedding

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _case(v=50, h=24, shape=(3, 11), dtype=torch.float32, seed=0):
    g = _gen(seed)
    weight = torch.randn(v, h, generator=g).to(dtype)
    ids = torch.randint(0, v, shape, generator=g)
    ids.view(-1)[::4] = 7  # duplicates
    return weight, ids


def loop_grad_weight(grad_out, ids, vocab, padding_idx=None):
    """The spec written as the plainest loop: fp32 accumulators, positions in order, one rounding."""
    grad_out = grad_out.reshape(-1, grad_out.shape[-1])
    acc = torch.zeros(vocab, grad_out.shape[1], dtype=torch.float32)
    for n, v in enumerate(ids.reshape(-1).tolist()):
        acc[v] = acc[v] + grad_out[n].float()
    if padding_idx is not None:
        acc[padding_idx] = 0
    return acc.to(grad_out.dtype)


def truth_grad_weight(grad_out, ids, vocab, padding_idx=None):
    """fp64 ground truth and the contract scale (per element: sum of |grad_out| over the id's rows)."""
    g = grad_out.reshape(-1, grad_out.shape[-1]).double()
    flat = ids.reshape(-1)
    truth = torch.zeros(vocab, g.shape[1], dtype=torch.float64).index_add_(0, flat, g)
    scale = torch.zeros(vocab, g.shape[1], dtype=torch.float64).index_add_(0, flat, g.abs())
    if padding_idx is not None:
        truth[padding_idx] = 0
        scale[padding_idx] = 0
    return truth, scale


def _grad(weight, ids, grad_out, padding_idx=None):
    w = weight.clone().requires_grad_(True)
    out = embedding(ids, w, padding_idx=padding_idx)
    out.backward(grad_out)
    return out, w.grad


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_is_a_bitwise_gather(dtype, id_dtype):
    weight, ids = _case(dtype=dtype)
    for shape_ids in (ids, ids[0, 0], ids.reshape(3, 11, 1), ids.reshape(-1)):
        got = embedding(shape_ids.to(id_dtype), weight)
        assert got.shape == (*shape_ids.shape, 24) and got.dtype == dtype
        assert torch.equal(got, F.embedding(shape_ids, weight))


@pytest.mark.parametrize("padding_idx", [None, 7, -3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_is_the_position_ordered_sum(dtype, padding_idx):
    weight, ids = _case(dtype=dtype, seed=1)
    ids[1, 2] = 47  # = V - 3: the padding row for padding_idx = -3
    grad_out = torch.randn(3, 11, 24, generator=_gen(2)).to(dtype)
    out, grad = _grad(weight, ids, grad_out, padding_idx)
    pad = None if padding_idx is None else padding_idx % 50
    assert torch.equal(out, F.embedding(ids, weight))  # the forward returns the padding row too, like torch
    assert grad.dtype == dtype
    assert torch.equal(grad, loop_grad_weight(grad_out, ids, 50, pad))
    truth, scale = truth_grad_weight(grad_out, ids, 50, pad)
    e = contract.entry("embedding", dtype)
    dev = contract.compare_outputs(e, "grad_weight", grad.reshape(-1), truth.reshape(-1), scale.reshape(-1))
    assert dev.ok, dev
    assert contract.compare_grad(e, "grad_weight", grad, truth, 0.0).ok
    unused = torch.ones(50, dtype=torch.bool)
    unused[ids.reshape(-1)] = False
    assert torch.all(grad[unused] == 0)
    if pad is not None:
        assert torch.all(grad[pad] == 0) and bool((ids == pad).any())


def test_duplicates_heavy_ids():
    """One id 1000 times among a few others: the sum runs in position order (bitwise = the loop)."""
    g = _gen(3)
    weight = torch.randn(20, 16, generator=g)
    ids = torch.randint(0, 20, (1100,), generator=g)
    ids[torch.randperm(1100, generator=g)[:1000]] = 5
    grad_out = torch.randn(1100, 16, generator=g)
    _, grad = _grad(weight, ids, grad_out)
    assert torch.equal(grad, loop_grad_weight(grad_out, ids, 20))
    truth, scale = truth_grad_weight(grad_out, ids, 20)
    dev = contract.compare_outputs(
        contract.entry("embedding", torch.float32),
        "grad_weight",
        grad.reshape(-1),
        truth.reshape(-1),
        scale.reshape(-1),
    )
    assert dev.ok, dev


def test_gradient_is_deterministic_and_independent_of_other_ids():
    """Row v's gradient depends only on the rows with id v and their order."""
    weight, ids = _case(seed=4)
    grad_out = torch.randn(3, 11, 24, generator=_gen(5))
    _, first = _grad(weight, ids, grad_out)
    _, second = _grad(weight, ids, grad_out)
    assert torch.equal(first, second)
    only_7 = ids.reshape(-1) == 7
    _, alone = _grad(weight, ids.reshape(-1)[only_7], grad_out.reshape(-1, 24)[only_7])
    assert torch.equal(alone[7], first[7])


def test_fp64_gradcheck():
    weight, ids = _case(v=9, h=5, shape=(4, 6), dtype=torch.float64, seed=6)
    w = weight.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: embedding(ids, t), (w,))
    assert torch.autograd.gradcheck(lambda t: embedding(ids.to(torch.int32), t) * 2, (w,))


def test_non_contiguous_inputs():
    weight, ids = _case(v=50, h=48, seed=7)
    weight_view = weight[:, ::2]
    ids_view = ids.T
    grad_out = torch.randn(11, 3, 24, generator=_gen(8))
    out, grad = _grad(weight_view, ids_view, grad_out)
    want_out, want_grad = _grad(weight_view.contiguous(), ids_view.contiguous(), grad_out)
    assert torch.equal(out, want_out) and torch.equal(grad, want_grad)
    assert torch.equal(out, F.embedding(ids_view, weight_view))


def test_empty_inputs():
    weight = torch.randn(5, 4, requires_grad=True)
    out = embedding(torch.zeros(2, 0, dtype=torch.long), weight)
    assert out.shape == (2, 0, 4)
    out.sum().backward()
    assert weight.grad.shape == (5, 4) and torch.all(weight.grad == 0)
    empty_h = torch.randn(5, 0, requires_grad=True)
    out = embedding(torch.tensor([1, 2]), empty_h)
    assert out.shape == (2, 0)
    out.sum().backward()
    assert empty_h.grad.shape == (5, 0)


def test_opcheck_custom_ops():
    weight, ids = _case(seed=9)
    flat = ids.reshape(-1)
    w = weight.requires_grad_(True)
    for padding in (-1, 7):
        torch.library.opcheck(torch.ops.rlk.embedding_fwd.default, (w, flat, padding))
    grad_out = torch.randn(flat.shape[0], 24, generator=_gen(10))
    for padding in (-1, 7):
        torch.library.opcheck(torch.ops.rlk.embedding_bwd.default, (grad_out, flat, padding, 50, "reference"))


def test_torch_compile_fullgraph_matches_eager():
    weight, ids = _case(seed=11)

    def fn(w):
        out = embedding(ids, w, padding_idx=3)
        return out, (out * out).sum()

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        w = weight.clone().requires_grad_(True)
        out, loss = f(w)
        loss.backward()
        results.append((out.detach(), w.grad))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_value_checks_can_be_switched_off(monkeypatch):
    weight, ids = _case(seed=12)
    checked = embedding(ids, weight)
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")
    assert torch.equal(embedding(ids, weight), checked)
    monkeypatch.setenv("RLK_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match="ids: values must lie"):
        embedding(torch.tensor([0, 50]), weight)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: embedding(torch.tensor([0, 5, 1]), torch.randn(5, 3)),
            ValueError,
            r"ids: values must lie in \[0, 5\); found 5 at flat position 1",
        ),
        (
            lambda: embedding(torch.tensor([[0, 1], [-1, 2]]), torch.randn(5, 3)),
            ValueError,
            "found -1 at flat position 2",
        ),
        (
            lambda: embedding(torch.tensor([0.0, 1.0]), torch.randn(5, 3)),
            TypeError,
            "ids: expected dtype int32 or int64, got torch.float32",
        ),
        (lambda: embedding([0, 1], torch.randn(5, 3)), TypeError, "ids: expected a torch.Tensor"),
        (lambda: embedding(torch.tensor([0, 1]), torch.randn(5, 3).long()), TypeError, "weight: expected dtype"),
        (
            lambda: embedding(torch.tensor([0, 1]), torch.randn(5, 3, 2)),
            ValueError,
            r"weight: expected shape \[V, H\], got \(5, 3, 2\)",
        ),
        (
            lambda: embedding(torch.tensor([0, 1]), torch.randn(5, 3), padding_idx=5),
            ValueError,
            r"padding_idx: expected None or an int in \[-5, 5\)",
        ),
        (lambda: embedding(torch.tensor([0, 1]), torch.randn(5, 3), padding_idx=-6), ValueError, "padding_idx"),
        (
            lambda: embedding(torch.tensor([0, 1], device="meta"), torch.randn(5, 3)),
            ValueError,
            "ids: expected device cpu",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_backend_values_opcheck_and_compile(dtype):
    """The GPU backend: bitwise gather, the gradient equals the reference bitwise, opcheck, and
    inductor fullgraph equal to eager bitwise."""
    g = _gen(13)
    weight = torch.randn(1000, 256, generator=g).to("cuda", dtype)
    ids = torch.randint(0, 1000, (4, 300), generator=g)
    ids[:, ::3] = 11
    ids = ids.cuda()
    assert rlk.explain("embedding", weight).backend != "reference"
    grad_out = torch.randn(4, 300, 256, generator=g).to("cuda", dtype)
    out, grad = _grad(weight, ids, grad_out, padding_idx=2)
    assert torch.equal(out, F.embedding(ids, weight))
    with rlk.use_backend("reference"):
        _, want = _grad(weight, ids, grad_out, padding_idx=2)
    assert torch.equal(grad, want)
    torch.library.opcheck(torch.ops.rlk.embedding_fwd.default, (weight.requires_grad_(), ids.reshape(-1), 2))

    def fn(w):
        out = embedding(ids, w, padding_idx=2)
        return out, (out.float() * grad_out.float()).sum()

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        w = weight.detach().clone().requires_grad_(True)
        out, loss = f(w)
        loss.backward()
        results.append((out.detach(), w.grad))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)
