"""Span-masked log-probs and losses: ``loss_spans=`` / ``span_tags=`` of ``selected_logprob``, ``linear_logprob``,
``kl_penalty``, ``policy_loss``, ``policy_loss_and_grad``, ``fused_linear_policy_loss`` and ``value_loss`` (issue 21
item 4).

Each is checked against the same op given the dense form of the spans (``ignore_index`` targets, a mask, or the
output multiplied by the mask), bitwise, on the reference and Triton backends: the spans only select positions. Also:
off-span positions holding NaN change nothing and get no gradient, the tags select rows, the spans of a real fixture
(visual tokens never scored), ``shift_spans``, a pinned backend without ``pack`` (``linear_logprob``'s host-table path
masks in place), and errors that name the argument.
"""

from __future__ import annotations

import public_calls
import pytest
import torch
from fake_backend import recording_backend

import rlk
from rlk.core import dispatch
from rlk.multimodal import MODALITIES, shift_spans, spans_to_mask, synthetic_batch

BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.triton_interpreter)]
B, T, V, H = 3, 10, 33, 16


@pytest.fixture(params=BACKENDS)
def backend(request):
    with rlk.use_backend(request.param):
        yield request.param


def _spans() -> torch.Tensor:
    """Two turns in row 0 (tags 0, 1), one in row 2 (tag 1), none in row 1; int32 ``[S, 4]``."""
    return torch.tensor([[0, 1, 4, 0], [0, 6, 9, 1], [2, 3, 10, 1]], dtype=torch.int32)


def _dense(spans: torch.Tensor, tags=None) -> torch.Tensor:
    """The mask written out with Python loops (independent of rlk's difference array)."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    for seq, start, end, tag in spans.tolist():
        if tags is None or tag in tags:
            mask[seq, start:end] = True
    return mask


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grads(out: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out.sum(), inputs)


@pytest.mark.parametrize("tags", [None, (1,)])
def test_selected_logprob_equals_ignore_index_targets(backend, tags):
    g = _gen(0)
    logits = (torch.randn(B, T, V, generator=g) * 2).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = _dense(_spans(), tags)
    lp, ent = rlk.selected_logprob(logits, targets, loss_spans=_spans(), span_tags=tags, return_entropy=True)
    want_lp, want_ent = rlk.selected_logprob(logits, torch.where(mask, targets, -100), return_entropy=True)
    assert torch.equal(lp, want_lp) and torch.equal(ent, want_ent)
    assert torch.equal(_grads(lp + ent, logits)[0], _grads(want_lp + want_ent, logits)[0])
    assert (lp[~mask] == 0).all() and (lp[mask] < 0).all()


@pytest.mark.parametrize("tags", [None, (0,)])
def test_linear_logprob_equals_ignore_index_targets(backend, tags):
    g = _gen(1)
    hidden = torch.randn(B, T, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = _dense(_spans(), tags)
    lp = rlk.linear_logprob(hidden, weight, targets, loss_spans=_spans(), span_tags=tags)
    want = rlk.linear_logprob(hidden, weight, torch.where(mask, targets, -100))
    (grad_hidden, grad_weight), (want_hidden, want_weight) = _grads(lp, hidden, weight), _grads(want, hidden, weight)
    # a host table: only the scored rows are computed (packed). Batch-invariant backends give each row's log-prob and
    # hidden gradient bit for bit; the reference (CPU matmul over fewer rows) within rounding. The weight's gradient
    # sums fewer (zero) rows: the same up to rounding.
    if backend == "triton":
        assert torch.equal(lp, want) and torch.equal(grad_hidden, want_hidden)
    torch.testing.assert_close(lp, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_hidden, want_hidden, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_weight, want_weight, rtol=1e-5, atol=1e-6)
    assert (lp[~mask] == 0).all() and (lp[mask] < 0).all() and (grad_hidden[~mask] == 0).all()


def test_a_pinned_backend_without_pack_masks_in_place(monkeypatch):
    """rlk-cuda and rlk-rocm do not serve ``pack``: pinned, ``linear_logprob`` with a host table must not need it (it
    masks in place, as with a device table): the dense form's bits, the packed path's values."""
    calls = []
    nopack = recording_backend("nopack", calls, without=("pack_fwd", "pack_bwd"))
    found = {**dispatch.discover(), "nopack": dispatch._status_of("nopack", lambda: nopack, "test")}
    monkeypatch.setattr(dispatch, "discover", lambda: found)
    g = _gen(12)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = _dense(_spans())
    with rlk.use_backend("reference"):
        dense = rlk.linear_logprob(hidden, weight, targets.masked_fill(~mask, -100))
        packed = rlk.linear_logprob(hidden, weight, targets, loss_spans=_spans())
    with rlk.use_backend("nopack"):
        got = rlk.linear_logprob(hidden, weight, targets, loss_spans=_spans())
        grad = _grads(got, hidden)[0]
    assert ("nopack", "linear_logprob_fwd") in calls and ("nopack", "linear_logprob_bwd") in calls
    assert torch.equal(got, dense) and torch.equal(grad, _grads(dense, hidden)[0])
    assert (got[~mask] == 0).all() and (got[mask] < 0).all()
    torch.testing.assert_close(got, packed, rtol=1e-12, atol=1e-12)


def test_off_span_nan_is_never_read(backend):
    """NaN hidden states / logits outside the spans (padding, visual tokens): outputs and gradients finite."""
    g = _gen(2)
    mask = _dense(_spans())
    hidden = torch.randn(B, T, H, generator=g).masked_fill(~mask[..., None], float("nan")).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    logits = torch.randn(B, T, V, generator=g).masked_fill(~mask[..., None], float("nan")).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    lp = rlk.linear_logprob(hidden, weight, targets, loss_spans=_spans())
    lp2 = rlk.selected_logprob(logits, targets, loss_spans=_spans())
    grads = (*_grads(lp, hidden, weight), *_grads(lp2, logits))
    assert torch.isfinite(lp).all() and torch.isfinite(lp2).all()
    assert torch.isfinite(grads[1]).all() and (grads[1] != 0).any()  # the weight's gradient: scored rows only
    assert (grads[0][~mask] == 0).all() and (grads[2][~mask] == 0).all()
    assert torch.isfinite(grads[0][mask]).all() and torch.isfinite(grads[2][mask]).all()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_kl_penalty_is_the_masked_estimate(backend, estimator):
    g = _gen(3)
    logprob = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    ref = logprob.detach() + 0.3 * torch.randn(B, T, generator=g)
    old = logprob.detach() + 0.1 * torch.randn(B, T, generator=g)
    mask = _dense(_spans())
    kl = rlk.kl_penalty(logprob, ref, estimator, old_logprob=old, loss_spans=_spans())
    full = rlk.kl_penalty(logprob, ref, estimator, old_logprob=old)
    assert torch.equal(kl, torch.where(mask, full, 0.0))
    grad = _grads(kl, logprob)[0]
    assert torch.equal(grad, _grads(full * mask, logprob)[0])
    # NaN off the spans is replaced before the estimator: value 0, gradient 0
    nan_lp = logprob.detach().masked_fill(~mask, float("nan")).requires_grad_()
    kl_nan = rlk.kl_penalty(nan_lp, ref, estimator, old_logprob=old, loss_spans=_spans())
    assert torch.equal(kl_nan, kl)
    assert torch.equal(_grads(kl_nan, nan_lp)[0], grad)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_equals_the_dense_mask(backend, agg, fused):
    g = _gen(4)
    old = -torch.rand(B, T, generator=g) * 3
    logprob = (old + 0.2 * torch.randn(B, T, generator=g)).requires_grad_()
    adv = torch.randn(B, 1, generator=g)
    ref = old + 0.3 * torch.randn(B, T, generator=g)
    mask = _dense(_spans(), (1,))
    kw = {"agg": agg, "ref_logprob": ref, "kl_coef": 0.1}
    if fused:
        got = rlk.policy_loss_and_grad(logprob, old, adv, loss_spans=_spans(), span_tags=1, **kw)
        want = rlk.policy_loss_and_grad(logprob, old, adv, mask, **kw)
        assert torch.equal(got.loss, want.loss) and torch.equal(got.grad_logprob, want.grad_logprob)
        got_metrics, want_metrics = got.metrics, want.metrics
    else:
        loss, got_metrics = rlk.policy_loss(logprob, old, adv, loss_spans=_spans(), span_tags=1, **kw)
        want_loss, want_metrics = rlk.policy_loss(logprob, old, adv, mask, **kw)
        assert torch.equal(loss, want_loss)
        assert torch.equal(_grads(loss, logprob)[0], _grads(want_loss, logprob)[0])
    assert got_metrics.keys() == want_metrics.keys()
    assert all(torch.equal(got_metrics[k], want_metrics[k]) for k in got_metrics)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_value_loss_equals_the_dense_mask(backend, agg):
    g = _gen(11)
    mask = _dense(_spans(), (1,))
    old = torch.randn(B, T, generator=g)
    values = (old + 0.5 * torch.randn(B, T, generator=g)).masked_fill(~mask, float("nan")).requires_grad_()
    returns = torch.randn(B, T, generator=g)
    loss, metrics = rlk.value_loss(values, old, returns, loss_spans=_spans(), span_tags=1, agg=agg)
    want, want_metrics = rlk.value_loss(values, old, returns, mask, agg=agg)
    assert torch.isfinite(loss) and torch.equal(loss, want)
    assert metrics.keys() == want_metrics.keys() and all(torch.equal(metrics[k], want_metrics[k]) for k in metrics)
    grad = _grads(loss, values)[0]
    assert torch.equal(grad, _grads(want, values)[0]) and (grad[~mask] == 0).all() and (grad[mask] != 0).any()


def test_fused_linear_policy_loss_equals_the_dense_mask(backend):
    g = _gen(10)
    hidden = torch.randn(B, T, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g) * 3
    adv = torch.randn(B, generator=g)
    mask = _dense(_spans(), (0,))
    loss, metrics = rlk.fused_linear_policy_loss(hidden, weight, targets, old, adv, loss_spans=_spans(), span_tags=0)
    want, want_metrics = rlk.fused_linear_policy_loss(hidden, weight, targets, old, adv, mask)
    assert torch.equal(loss, want) and all(torch.equal(metrics[k], want_metrics[k]) for k in metrics)
    for got, expected in zip(_grads(loss, hidden, weight), _grads(want, hidden, weight)):
        assert torch.equal(got, expected)


def test_mask_spans_match_a_python_loop():
    """The device mask the ops build (``spans_to_mask``) against the loop: every tag subset."""
    for tags in (None, (0,), (1,), (0, 1), (5,)):
        assert torch.equal(spans_to_mask(_spans(), (B, T), tags=tags), _dense(_spans(), tags))


def test_a_fixture_scores_only_its_response_tokens():
    """An image-text batch: with its shifted ``loss_spans`` no position predicting a visual token or a prompt token is
    scored, and every position predicting a loss token is."""
    batch = synthetic_batch("image-text", batch_size=3, seed=5)
    b, t = batch.input_ids.shape
    g = _gen(6)
    logits = torch.randn(b, t - 1, 40, generator=g)
    targets = batch.input_ids[:, 1:] % 40
    spans = shift_spans(batch.loss_spans, -1)
    lp = rlk.selected_logprob(logits, targets, loss_spans=spans)
    predicts_loss = batch.loss_mask()[:, 1:]
    predicts_visual = batch.modality_mask()[:, 1:]
    assert (lp[predicts_loss] != 0).all()
    assert (lp[~predicts_loss] == 0).all()
    assert predicts_visual.any() and not (predicts_loss & predicts_visual).any()


def test_shift_spans():
    spans = torch.tensor([[0, 0, 3, 7], [1, 4, 9, 2]], dtype=torch.int32)
    assert shift_spans(spans, -1).tolist() == [[0, 0, 2, 7], [1, 3, 8, 2]]
    assert shift_spans(spans, 2).tolist() == [[0, 2, 5, 7], [1, 6, 11, 2]]
    assert shift_spans(spans, -1).dtype == torch.int32


def test_modality_spans_select_by_tag():
    """``span_tags`` with ``modality_spans``: image tokens only (the modality codes are the tags)."""
    batch = synthetic_batch("multi-image", batch_size=2, seed=7)
    b, t = batch.input_ids.shape
    logits = torch.randn(b, t, 11, generator=_gen(8))
    targets = torch.zeros(b, t, dtype=torch.long)
    lp = rlk.selected_logprob(logits, targets, loss_spans=batch.modality_spans, span_tags=MODALITIES["image"])
    assert torch.equal(lp != 0, batch.modality_mask("image"))


def test_errors_name_the_argument(monkeypatch):
    logits, targets = torch.randn(B, T, V), torch.zeros(B, T, dtype=torch.long)
    lp, adv = -torch.rand(B, T), torch.randn(B)
    cases = [
        (lambda: rlk.policy_loss(lp, None, adv), TypeError, "mask: required"),
        (lambda: rlk.policy_loss(lp, None, adv, _dense(_spans()), loss_spans=_spans()), ValueError, "mask, loss_spans"),
        (lambda: rlk.value_loss(lp, lp, lp), TypeError, "mask: required"),
        (lambda: rlk.value_loss(lp, lp, lp, _dense(_spans()), loss_spans=_spans()), ValueError, "mask, loss_spans"),
        (lambda: rlk.value_loss(lp, lp, lp, _dense(_spans()), span_tags=1), ValueError, "span_tags: given without"),
        (lambda: rlk.selected_logprob(logits, targets, span_tags=1), ValueError, "span_tags: given without"),
        (lambda: rlk.kl_penalty(lp, lp, "k1", span_tags=(1,)), ValueError, "span_tags: given without"),
        (lambda: rlk.selected_logprob(logits, targets, loss_spans=_spans().float()), TypeError, "loss_spans: .*dtype"),
        (
            lambda: rlk.selected_logprob(logits, targets, loss_spans=_spans()[:, :2]),
            ValueError,
            r"loss_spans: .*\[S, 4\]",
        ),
        (lambda: rlk.selected_logprob(logits, targets, loss_spans=[[0, 1, 2, 0]]), TypeError, "loss_spans: expected a"),
        (
            lambda: rlk.selected_logprob(logits, targets, loss_spans=_spans()[:, :3], span_tags=1),
            ValueError,
            r"loss_spans: expected shape \[S, 4\]",
        ),
        (
            lambda: rlk.selected_logprob(logits[0], targets[0], loss_spans=_spans()),
            ValueError,
            r"loss_spans: needs targets .* of shape \[B, T\]",
        ),
        (lambda: rlk.selected_logprob(logits, targets, loss_spans=_spans(), span_tags=1.5), TypeError, "span_tags"),
        (
            lambda: rlk.selected_logprob(logits, targets, loss_spans=torch.tensor([[3, 0, 2, 0]])),
            ValueError,
            r"loss_spans: row 0 is \(seq, start, end\) = \(3, 0, 2\); need 0 <= seq < B = 3",
        ),
        (
            lambda: rlk.policy_loss(lp, None, adv, loss_spans=torch.tensor([[0, 5, 4, 0]])),
            ValueError,
            r"loss_spans: row 0 .* 0 <= start <= end <= T = 10",
        ),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def _compile_params() -> list:
    """Each op on the reference, value checks on and off (``RLK_CHECK_VALUES`` is read by the op layer, the same for
    every backend), and on Triton with them on; Triton's ``fused_linear_policy_loss`` (about 10 s in the interpreter)
    in the nightly tier."""
    params = []
    for op in sorted(public_calls.SPAN_OPS):
        for check, name in (("1", "checked"), ("0", "RLK_CHECK_VALUES=0")):
            params.append(pytest.param("reference", op, check, id=f"reference-{op}-{name}"))
        slow = [pytest.mark.slow] if op == "fused_linear_policy_loss" else []
        params.append(pytest.param("triton", op, "1", marks=[pytest.mark.triton_interpreter, *slow], id=f"triton-{op}"))
    return params


@pytest.mark.parametrize("backend_name, op, check_values", _compile_params())
def test_compile_fullgraph_with_loss_spans_equals_eager(backend_name, op, check_values, monkeypatch):
    """``torch.compile(fullgraph=True)`` of an op given ``loss_spans`` used to fail (``Unsupported: ContextVar.get``:
    the spans' value check read ``rlk.core.checks``' context variable in the traced code; with RLK_CHECK_VALUES=0
    too). The spans' mask is one custom op now (``rlk::span_mask``), whose value check runs inside it, as every op's:
    the compiled loss and gradient are the eager ones bit for bit."""
    monkeypatch.setenv("RLK_CHECK_VALUES", check_values)
    spans = torch.tensor([[0, 0, 1, 0], [0, 2, 4, 1]], dtype=torch.int32)  # one row: the interpreter is slow
    with rlk.use_backend(backend_name):
        (eager, eager_grad), (compiled, compiled_grad) = public_calls.eager_and_compiled(op, spans, 0, 1, 5)
    assert torch.equal(compiled, eager) and torch.equal(compiled_grad, eager_grad)


def test_compiled_spans_are_checked_when_the_graph_runs(monkeypatch):
    """The value check of the spans runs inside the compiled graph, under the switch of the moment."""
    bad = torch.tensor([[0, 5, 4, 0]], dtype=torch.int32)
    loss = public_calls.SPAN_OPS["kl_penalty"].loss(0, B, T)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    x = public_calls.SPAN_OPS["kl_penalty"].leaf(0, B, T)
    assert torch.equal(compiled(x, _spans()), loss(x, _spans()))
    with pytest.raises(ValueError, match=r"loss_spans: row 0 is \(seq, start, end\) = \(0, 5, 4\)"):
        compiled(x, bad)
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")
    compiled(x, bad)  # not checked (an empty span here)


def test_span_mask_custom_op_passes_opcheck():
    """``rlk::span_mask`` (schema, fake, no aliasing), with and without tags."""
    table = _spans().to(torch.int64)
    for tags in (None, [1]):
        torch.library.opcheck(torch.ops.rlk.span_mask.default, (table, B, T, tags, torch.device("cpu")))


@pytest.mark.gpu
def test_host_and_device_span_tables_agree_gpu():
    """``linear_logprob`` with the span table on the GPU (masked in place) and on the CPU (scored rows packed): the
    same log-probs and hidden gradients bit for bit on the GPU backends (each row's result does not depend on the
    other rows), bf16."""
    g = torch.Generator("cuda").manual_seed(9)
    b, t, h, v = 4, 512, 256, 4096
    hidden = (torch.randn(b, t, h, generator=g, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, generator=g, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, v, (b, t), generator=g, device="cuda")
    rows = torch.arange(b)
    spans = torch.stack([rows, 100 + 7 * rows, 300 + 11 * rows, rows % 2], 1).to(torch.int32)
    on_device = rlk.linear_logprob(hidden, weight, targets, loss_spans=spans.cuda(), return_entropy=True)
    on_host = rlk.linear_logprob(hidden, weight, targets, loss_spans=spans, return_entropy=True)
    for a, c in zip(on_device, on_host):
        assert torch.equal(a, c)
    grads_device = _grads(on_device[0] + on_device[1], hidden, weight)
    grads_host = _grads(on_host[0] + on_host[1], hidden, weight)
    assert torch.equal(grads_device[0], grads_host[0])
    torch.testing.assert_close(grads_device[1], grads_host[1], rtol=2e-2, atol=1e-3)
