"""The public attention op on the reference backend: math against an independent dense fp64 derivation,
autograd (including through the LSE), torch.library integration, and bad input. Tolerances come from
the contract."""

from __future__ import annotations

import math

import pytest
import torch
from compile_check import assert_compiled_matches_eager

from rlk.core import checks, contract
from rlk.ops.attention import attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(lq, lk, hq=4, hkv=2, d=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, dict(cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk), max_seqlen_q=max(lq, default=0),
                         max_seqlen_k=max(lk, default=0))


def _dense_truth(q, k, v, lq, lk, causal, scale=None):
    """fp64 out and lse from one dense masked softmax over ALL packed keys (block-diagonal mask over
    sequences, bottom-right causal inside each), not from rlk's per-sequence reference."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    seq_q = torch.repeat_interleave(torch.arange(len(lq)), torch.tensor(lq))
    seq_k = torch.repeat_interleave(torch.arange(len(lk)), torch.tensor(lk))
    pos_q = torch.arange(q.shape[0]) - _cu(lq)[seq_q]
    pos_k = torch.arange(k.shape[0]) - _cu(lk)[seq_k]
    allowed = seq_q[:, None] == seq_k[None, :]
    if causal:
        shift = (torch.tensor(lk) - torch.tensor(lq))[seq_q]
        allowed &= pos_k[None, :] <= pos_q[:, None] + shift[:, None]
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("ihd,jhd->hij", q, kk) * scale
    any_key = allowed.any(1)[None, :, None]
    s = torch.where(allowed[None] & any_key, s, torch.where(any_key, -torch.inf, 0.0))  # no-key rows: all 0
    p = torch.softmax(s, -1) * any_key
    out = torch.einsum("hij,jhd->ihd", p, vv)
    lse = torch.where(any_key[..., 0], torch.logsumexp(s, -1), -torch.inf)
    return out, lse


# (Lq, Lk) per sequence: GQA 4:2; equal, Lq < Lk (chunk against a cache), Lq > Lk (rows that see nothing
# under causal), an empty query sequence, an empty key sequence, a single decode query.
LQ, LK = [7, 3, 9, 0, 4, 1], [7, 8, 4, 5, 0, 6]


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_dense_masked_softmax_fp64(causal):
    q, k, v, lens = _inputs(LQ, LK)
    out, lse = attention(q, k, v, **lens, causal=causal, return_lse=True)
    want_out, want_lse = _dense_truth(q, k, v, LQ, LK, causal)
    assert out.dtype == torch.float64 and lse.shape == (4, sum(LQ))
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    torch.testing.assert_close(lse[torch.isfinite(lse)], want_lse[torch.isfinite(want_lse)], rtol=1e-12, atol=1e-12)
    if causal:  # sequence 2 has Lq=9 > Lk=4: its first 5 queries see no key
        assert torch.all(lse[:, 10:15] == -torch.inf) and torch.all(out[10:15] == 0)
        assert torch.all(torch.isfinite(lse[:, 15:19]))
    assert torch.all(out[19:23] == 0) and torch.all(lse[:, 19:23] == -torch.inf)  # Lk = 0


def test_default_scale_and_explicit_scale():
    q, k, v, lens = _inputs([5], [5], hq=2, hkv=2)
    # D = 16: the default 1 / sqrt(D) is exactly 0.25, so the two calls run the same arithmetic
    assert q.shape[-1] == 16 and torch.equal(attention(q, k, v, **lens), attention(q, k, v, **lens, softmax_scale=0.25))
    out = attention(q, k, v, **lens, softmax_scale=0.7, causal=False)
    torch.testing.assert_close(out, _dense_truth(q, k, v, [5], [5], False, scale=0.7)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_low_precision_under_the_contract(dtype):
    q, k, v, lens = _inputs(LQ, LK, dtype=dtype, seed=1)
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = attention(qs, ks, vs, **lens, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    want_out, want_lse = _dense_truth(q64, k64, v64, LQ, LK, True)
    e = contract.entry("attention", dtype)
    vmax = torch.zeros(sum(LQ), 4, 1, dtype=torch.float64)
    for b in range(len(LQ)):
        q0, q1, k0, k1 = int(lens["cu_seqlens_q"][b]), int(lens["cu_seqlens_q"][b + 1]), int(_cu(LK)[b]), \
            int(_cu(LK)[b + 1])
        if k1 > k0:
            vmax[q0:q1] = v[k0:k1].double().abs().amax(dim=(0, 2)).repeat_interleave(2)[None, :, None]
    scale = (1 + vmax).expand(out.shape).reshape(-1)
    assert contract.compare_outputs(e, "out", out.reshape(-1), want_out.detach().reshape(-1), scale).ok
    assert contract.compare_outputs(e, "lse", lse.reshape(-1), want_lse.detach().reshape(-1),
                                    1 + want_lse.detach().abs().reshape(-1)).ok
    g = torch.Generator().manual_seed(2)
    c_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    c_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    finite = torch.isfinite(want_lse.detach())
    ((out.double() * c_out).sum() + (torch.where(finite, lse.double(), 0) * c_lse).sum()).backward()
    ((want_out * c_out).sum() + (torch.where(finite, want_lse, 0) * c_lse).sum()).backward()
    for name, got, want in (("dq", qs.grad, q64.grad), ("dk", ks.grad, k64.grad), ("dv", vs.grad, v64.grad)):
        assert got.dtype == dtype
        assert contract.compare_grad(e, name, got, want, 0.0).ok


def test_fp64_gradcheck_through_out_and_lse():
    q, k, v, lens = _inputs([4, 2, 5], [4, 5, 3], hq=4, hkv=2, d=8, seed=3)
    leaves = tuple(t.clone().requires_grad_(True) for t in (q, k, v))

    def fn(a, b, c):
        out, lse = attention(a, b, c, **lens, return_lse=True)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)  # rows that see no key: lse = -inf, constant

    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradcheck(lambda a, b, c: attention(a, b, c, **lens, causal=False), leaves)


def test_rows_without_keys_pass_no_gradient():
    q, k, v, lens = _inputs([6], [2], seed=4)
    qs = q.clone().requires_grad_(True)
    out, lse = attention(qs, k, v, **lens, return_lse=True)
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    assert torch.all(qs.grad[:4] == 0) and torch.any(qs.grad[4:] != 0)


def test_empty_inputs():
    q, k, v, lens = _inputs([0, 0], [3, 2])
    q.requires_grad_(True)
    out, lse = attention(q, k, v, **lens, return_lse=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)
    q, k, v, lens = _inputs([3, 2], [0, 0])
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    out, lse = attention(*leaves, **lens, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -torch.inf)
    out.sum().backward()
    assert torch.all(leaves[0].grad == 0)


def test_opcheck_both_custom_ops():
    q, k, v, lens = _inputs([5, 3], [6, 3], dtype=torch.float32, seed=5)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), lens["cu_seqlens_q"], lens["cu_seqlens_k"],
            lens["max_seqlen_q"], lens["max_seqlen_k"])
    for causal in (True, False):
        torch.library.opcheck(torch.ops.rlk.attention_fwd.default, (*args, causal, 0.3))
    out, lse = torch.ops.rlk.attention_fwd(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                                           True, 0.3)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    for gl in (grad_lse, None):
        torch.library.opcheck(torch.ops.rlk.attention_bwd.default,
                              (grad_out, q.detach(), k.detach(), v.detach(), out, lse, gl, *args[3:], True, 0.3,
                               "reference"))


def test_torch_compile_fullgraph_matches_eager():
    q, k, v, lens = _inputs([5, 3, 6], [6, 3, 9], dtype=torch.float32, seed=6)

    def loss_fn(a, b, c):
        out, lse = attention(a, b, c, **lens, return_lse=True)
        return (out * out).sum() + lse.sum()

    assert_compiled_matches_eager(loss_fn, (q, k, v), backend="aot_eager")


def _call(q=None, k=None, v=None, **overrides):
    base_q, base_k, base_v, lens = _inputs([3, 2], [3, 4], dtype=torch.float32)
    lens.update(overrides)
    return attention(base_q if q is None else q, base_k if k is None else k, base_v if v is None else v, **lens)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: _call(q=torch.randn(5, 4, 16).long()), TypeError, "q: expected dtype"),
        (lambda: _call(q=torch.randn(5, 64)), ValueError, r"q: expected shape \[tokens, heads, head_dim\]"),
        (lambda: _call(k=torch.randn(7, 2, 16).half()), TypeError, "k: expected the dtype of q"),
        (lambda: _call(k=torch.randn(7, 2, 8)), ValueError, "k: expected head_dim D = 16"),
        (lambda: _call(v=torch.randn(6, 2, 16)), ValueError, r"v: expected the shape of k \(7, 2, 16\)"),
        (lambda: _call(k=torch.randn(7, 3, 16), v=torch.randn(7, 3, 16)), ValueError,
         "Hkv = 3 must divide q's Hq = 4"),
        (lambda: _call(v=torch.randn(7, 2, 16, device="meta")), ValueError, "v: expected device cpu"),
        (lambda: _call(cu_seqlens_q=torch.tensor([0, 3, 5])), TypeError, "cu_seqlens_q: expected dtype int32"),
        (lambda: _call(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)), ValueError,
         "cu_seqlens_k: expected the shape of cu_seqlens_q"),
        (lambda: _call(cu_seqlens_q=torch.tensor([[0, 3, 5]], dtype=torch.int32)), ValueError,
         r"cu_seqlens_q: expected shape \[B \+ 1\]"),
        (lambda: _call(max_seqlen_q=3.0), TypeError, "max_seqlen_q: expected an integer, got float 3.0"),
        (lambda: _call(causal=1), TypeError, "causal: expected a bool"),
        (lambda: _call(softmax_scale=0.0), ValueError, "softmax_scale: must be a finite number > 0"),
        (lambda: _call(cu_seqlens_q=torch.tensor([1, 3, 5], dtype=torch.int32)), ValueError,
         "cu_seqlens_q: must start at 0, starts at 1"),
        (lambda: _call(cu_seqlens_k=torch.tensor([0, 3, 6], dtype=torch.int32)), ValueError,
         r"cu_seqlens_k: must end at the number of tokens of k and v \(7\), ends at 6"),
        (lambda: _call(cu_seqlens_q=torch.tensor([0, 6, 5], dtype=torch.int32), max_seqlen_q=6), ValueError,
         "cu_seqlens_q: must be non-decreasing; sequence 1 has offsets 6 -> 5"),
        (lambda: _call(max_seqlen_k=3), ValueError, "max_seqlen_k: sequence 1 has 4 tokens, more than max_seqlen_k=3"),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_value_checks_can_be_switched_off(monkeypatch):
    checked = _call()
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")
    assert torch.equal(_call(), checked)
    _call(max_seqlen_k=3)  # not checked: no error (the reference reads the lengths from cu_seqlens)
    monkeypatch.setenv("RLK_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match="max_seqlen_k"):
        _call(max_seqlen_k=3)


def test_value_checks_run_on_every_call_unless_rlk_built_the_offsets(monkeypatch):
    """cu_seqlens are checked (one host sync) on every call: a tensor edited in place is caught
    (``test_arguments.py``); inside ``checks.trusted_values()`` (``patch_model``'s attention, which builds the
    offsets from the padding mask itself) they are not."""
    calls = []
    real = checks.values_checked
    monkeypatch.setattr(checks, "values_checked", lambda: calls.append(real()) or calls[-1])
    q, k, v = (torch.randn(5, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    kwargs = {"max_seqlen_q": 3, "max_seqlen_k": 3}
    for _ in range(3):
        attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, **kwargs)
    assert calls == [True] * 3
    cu[1] = 4
    with pytest.raises(ValueError, match="max_seqlen_q"):
        attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, **kwargs)
    with checks.trusted_values():
        attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)
    assert calls == [True] * 4 + [False]
