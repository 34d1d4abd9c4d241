"""The public attention ops (``attention``, ``prefix_attention``) on the reference backend: math against an
independent dense fp64 derivation, autograd (including through the LSE), torch.library integration, and bad
input. Tolerances come from the contract. (The Triton kernels, and prefix_attention's bitwise promises: the
backend's ``test_attention_kernels.py``.)"""

from __future__ import annotations

import math

import pytest
import torch
from compile_check import assert_compiled_matches_eager

from rlk.core import checks, contract
from rlk.ops.attention import attention, prefix_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(lq, lk, hq=4, hkv=2, d=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64).to(dtype)
    return (
        q,
        k,
        v,
        dict(
            cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk), max_seqlen_q=max(lq, default=0), max_seqlen_k=max(lk, default=0)
        ),
    )


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
    return _masked_softmax(q, k, v, allowed, scale)


def _masked_softmax(q, k, v, allowed, scale):
    """out and lse of the dense softmax over all packed keys under the ``[Tq, Tk]`` bool mask ``allowed``."""
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
        q0, q1, k0, k1 = (
            int(lens["cu_seqlens_q"][b]),
            int(lens["cu_seqlens_q"][b + 1]),
            int(_cu(LK)[b]),
            int(_cu(LK)[b + 1]),
        )
        if k1 > k0:
            vmax[q0:q1] = v[k0:k1].double().abs().amax(dim=(0, 2)).repeat_interleave(2)[None, :, None]
    scale = (1 + vmax).expand(out.shape).reshape(-1)
    _check_against_truth(e, out, lse, want_out, want_lse, scale, (qs, ks, vs), (q64, k64, v64), seed=2)


def _check_against_truth(e, out, lse, want_out, want_lse, scale, leaves, truth_leaves, seed):
    """``out`` / ``lse`` and the gradients of ``leaves`` (q, k, v) through both, from a random cotangent, against
    the fp64 truth computed from ``truth_leaves``, under the contract entry ``e``."""
    assert contract.compare_outputs(e, "out", out.reshape(-1), want_out.detach().reshape(-1), scale).ok
    assert contract.compare_outputs(
        e, "lse", lse.reshape(-1), want_lse.detach().reshape(-1), 1 + want_lse.detach().abs().reshape(-1)
    ).ok
    g = torch.Generator().manual_seed(seed)
    c_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    c_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    finite = torch.isfinite(want_lse.detach())
    ((out.double() * c_out).sum() + (torch.where(finite, lse.double(), 0) * c_lse).sum()).backward()
    ((want_out * c_out).sum() + (torch.where(finite, want_lse, 0) * c_lse).sum()).backward()
    for name, got, want in zip(("dq", "dk", "dv"), leaves, truth_leaves):
        assert got.grad.dtype == out.dtype
        assert contract.compare_grad(e, name, got.grad, want.grad, 0.0).ok


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
    args = (
        q.requires_grad_(),
        k.requires_grad_(),
        v.requires_grad_(),
        lens["cu_seqlens_q"],
        lens["cu_seqlens_k"],
        lens["max_seqlen_q"],
        lens["max_seqlen_k"],
    )
    for causal in (True, False):
        torch.library.opcheck(torch.ops.rlk.attention_fwd.default, (*args, causal, 0.3))
    out, lse = torch.ops.rlk.attention_fwd(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args), True, 0.3)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    for gl in (grad_lse, None):
        torch.library.opcheck(
            torch.ops.rlk.attention_bwd.default,
            (grad_out, q.detach(), k.detach(), v.detach(), out, lse, gl, *args[3:], True, 0.3, "reference"),
        )


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
        (lambda: _call(k=torch.randn(7, 3, 16), v=torch.randn(7, 3, 16)), ValueError, "Hkv = 3 must divide q's Hq = 4"),
        (lambda: _call(v=torch.randn(7, 2, 16, device="meta")), ValueError, "v: expected device cpu"),
        (lambda: _call(cu_seqlens_q=torch.tensor([0, 3, 5])), TypeError, "cu_seqlens_q: expected dtype int32"),
        (
            lambda: _call(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)),
            ValueError,
            "cu_seqlens_k: expected the shape of cu_seqlens_q",
        ),
        (
            lambda: _call(cu_seqlens_q=torch.tensor([[0, 3, 5]], dtype=torch.int32)),
            ValueError,
            r"cu_seqlens_q: expected shape \[B \+ 1\]",
        ),
        (lambda: _call(max_seqlen_q=3.0), TypeError, "max_seqlen_q: expected an integer, got float 3.0"),
        (lambda: _call(causal=1), TypeError, "causal: expected a bool"),
        (lambda: _call(softmax_scale=0.0), ValueError, "softmax_scale: must be a finite number > 0"),
        (
            lambda: _call(cu_seqlens_q=torch.tensor([1, 3, 5], dtype=torch.int32)),
            ValueError,
            "cu_seqlens_q: must start at 0, starts at 1",
        ),
        (
            lambda: _call(cu_seqlens_k=torch.tensor([0, 3, 6], dtype=torch.int32)),
            ValueError,
            r"cu_seqlens_k: must end at the number of tokens of k and v \(7\), ends at 6",
        ),
        (
            lambda: _call(cu_seqlens_q=torch.tensor([0, 6, 5], dtype=torch.int32), max_seqlen_q=6),
            ValueError,
            "cu_seqlens_q: must be non-decreasing; sequence 1 has offsets 6 -> 5",
        ),
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


# ---------------------------------------------------------------------------
# prefix_attention
# ---------------------------------------------------------------------------


def _prefix_allowed(lq, lk, prefix, causal):
    """``[Tq, Tk]`` bool: packed key row u is visible to packed query row t (an independent derivation from the
    docstring's definition: the logical keys of sequence b are its prefix sequence's rows at logical positions
    0 .. P_b - 1, then its own rows at P_b + j; causal bottom-right over P_b + Lk_b)."""
    lq_t, lk_t, pre = torch.tensor(lq), torch.tensor(lk), torch.tensor(prefix)
    seq_q = torch.repeat_interleave(torch.arange(len(lq)), lq_t)
    seq_k = torch.repeat_interleave(torch.arange(len(lk)), lk_t)
    pos_q = torch.arange(int(lq_t.sum())) - _cu(lq)[seq_q]
    pos_k = torch.arange(int(lk_t.sum())) - _cu(lk)[seq_k]
    n_p = torch.where(pre >= 0, lk_t[pre.clamp(min=0)], 0)
    own = seq_q[:, None] == seq_k[None, :]
    borrowed = pre[seq_q][:, None] == seq_k[None, :]
    logical = torch.where(own, n_p[seq_q][:, None] + pos_k[None, :], pos_k[None, :])
    allowed = own | borrowed
    if causal:
        shift = (n_p + lk_t - lq_t)[seq_q]
        allowed &= logical <= pos_q[:, None] + shift[:, None]
    return allowed


def _prefix_truth(q, k, v, lq, lk, prefix, causal, scale=None):
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    return _masked_softmax(q.double(), k.double(), v.double(), _prefix_allowed(lq, lk, prefix, causal), scale)


def _prefix_inputs(lq, lk, prefix, **kwargs):
    q, k, v, lens = _inputs(lq, lk, **kwargs)
    lens["prefix_index"] = torch.tensor(prefix, dtype=torch.int32)
    return q, k, v, lens


# Two GRPO groups mixed with ordinary sequences (Lq, Lk own keys, prefix_index), GQA 4:2: group 0 (prompt 6;
# responses of 4 tokens, an empty one, Lq < Lk, Lq > Lk own keys, queries without own keys); an ordinary
# sequence with Lq < Lk; group 2 (a prompt of keys only, its response's first rows see no key: Lq > P + Lk);
# a response packed before its prompt; an ordinary sequence whose first rows see no key.
PLQ = [6, 4, 0, 3, 5, 2, 3, 0, 3, 5, 2, 4, 4]
PLK = [6, 4, 0, 5, 2, 0, 7, 2, 3, 1, 2, 4, 1]
PIDX = [-1, 0, 0, 0, 0, 0, -1, -1, 7, 7, 11, -1, -1]


@pytest.mark.parametrize("causal", [True, False])
def test_prefix_reference_matches_dense_masked_softmax_fp64(causal):
    q, k, v, lens = _prefix_inputs(PLQ, PLK, PIDX, seed=11)
    leaves = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = prefix_attention(*leaves, **lens, causal=causal, return_lse=True)
    truth_leaves = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
    want_out, want_lse = _prefix_truth(*truth_leaves, PLQ, PLK, PIDX, causal)
    assert out.dtype == torch.float64 and lse.shape == (4, sum(PLQ))
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-12, atol=1e-12)
    if causal:  # sequence 9: Lq 5 > P 2 + Lk 1, its first 2 queries see no key; sequence 12's first 3 see none
        row = sum(PLQ[:9])
        assert torch.all(lse[:, row : row + 2] == -torch.inf) and torch.all(torch.isfinite(lse[:, row + 2 : row + 5]))
        assert torch.all(lse[:, sum(PLQ[:12]) : sum(PLQ[:12]) + 3] == -torch.inf)
    g = torch.Generator().manual_seed(12)
    c_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    c_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    for o, lg in ((out, lse), (want_out, want_lse)):
        ((o * c_out).sum() + (torch.where(finite, lg, 0) * c_lse).sum()).backward()
    for got, want in zip(leaves, truth_leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


def test_prefix_attention_without_prefixes_is_attention():
    q, k, v, lens = _inputs(LQ, LK, seed=13)
    leaves = [tuple(t.clone().requires_grad_(True) for t in (q, k, v)) for _ in range(2)]
    out, lse = attention(*leaves[0], **lens, return_lse=True)
    pout, plse = prefix_attention(
        *leaves[1], **lens, prefix_index=torch.full((len(LQ),), -1, dtype=torch.int32), return_lse=True
    )
    assert torch.equal(out, pout) and torch.equal(lse, plse)
    for o, lg in ((out, lse), (pout, plse)):
        (o.sum() + torch.where(torch.isfinite(lg), lg, 0).sum()).backward()
    for a, b in zip(*leaves):
        assert torch.equal(a.grad, b.grad)


def _logical_vmax(v, hq, lq, lk, prefix):
    """The contract's scale of ``out``: 1 + max |v| over each query's logical keys, per kv head, ``[Tq, Hq, D]``."""
    vabs = v.double().abs().amax(-1).repeat_interleave(hq // v.shape[1], 1)  # [Tk, Hq]
    allowed = _prefix_allowed(lq, lk, prefix, causal=False)  # [Tq, Tk]
    vmax = torch.where(allowed[:, :, None], vabs[None], 0.0).amax(1) if vabs.shape[0] else allowed.new_zeros(0)
    return 1 + vmax[:, :, None]


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_low_precision_under_the_contract(dtype):
    q, k, v, lens = _prefix_inputs(PLQ, PLK, PIDX, dtype=dtype, seed=14)
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = prefix_attention(qs, ks, vs, **lens, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    want_out, want_lse = _prefix_truth(q64, k64, v64, PLQ, PLK, PIDX, True)
    e = contract.entry("prefix_attention", dtype)
    scale = _logical_vmax(v, 4, PLQ, PLK, PIDX).expand(out.shape).reshape(-1)
    _check_against_truth(e, out, lse, want_out, want_lse, scale, (qs, ks, vs), (q64, k64, v64), seed=15)


def test_prefix_fp64_gradcheck_through_out_and_lse():
    lq, lk, prefix = [3, 2, 0, 3, 2], [3, 2, 1, 2, 2], [-1, 0, 0, -1, 3]
    q, k, v, lens = _prefix_inputs(lq, lk, prefix, hq=4, hkv=2, d=8, seed=16)
    leaves = tuple(t.clone().requires_grad_(True) for t in (q, k, v))

    def fn(a, b, c):
        out, lse = prefix_attention(a, b, c, **lens, return_lse=True)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradcheck(lambda a, b, c: prefix_attention(a, b, c, **lens, causal=False), leaves)


def test_prefix_empty_inputs():
    q, k, v, lens = _prefix_inputs([0, 0], [3, 2], [-1, 0])
    q.requires_grad_(True)
    out, lse = prefix_attention(q, k, v, **lens, return_lse=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)
    q, k, v, lens = _prefix_inputs([3, 2], [0, 0], [-1, 0])
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    out, lse = prefix_attention(*leaves, **lens, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -torch.inf)
    out.sum().backward()
    assert torch.all(leaves[0].grad == 0)
    q, k, v, lens = _prefix_inputs([], [], [])  # no sequence at all
    assert prefix_attention(q, k, v, **lens).shape == (0, 4, 16)


def test_prefix_opcheck_both_custom_ops():
    q, k, v, lens = _prefix_inputs([5, 3, 0, 2], [5, 3, 0, 4], [-1, 0, 0, -1], dtype=torch.float32, seed=17)
    args = (
        q.requires_grad_(),
        k.requires_grad_(),
        v.requires_grad_(),
        lens["cu_seqlens_q"],
        lens["cu_seqlens_k"],
        lens["max_seqlen_q"],
        lens["max_seqlen_k"],
        lens["prefix_index"],
    )
    for causal in (True, False):
        torch.library.opcheck(torch.ops.rlk.prefix_attention_fwd.default, (*args, causal, 0.3))
    plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    out, lse = torch.ops.rlk.prefix_attention_fwd(*plain, True, 0.3)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    for gl in (grad_lse, None):
        torch.library.opcheck(
            torch.ops.rlk.prefix_attention_bwd.default,
            (grad_out, *plain[:3], out, lse, gl, *plain[3:], True, 0.3, "reference"),
        )


def test_prefix_torch_compile_fullgraph_matches_eager():
    q, k, v, lens = _prefix_inputs([5, 3, 6, 2], [5, 3, 6, 4], [-1, 0, 0, -1], dtype=torch.float32, seed=18)

    def loss_fn(a, b, c):
        out, lse = prefix_attention(a, b, c, **lens, return_lse=True)
        return (out * out).sum() + lse.sum()

    assert_compiled_matches_eager(loss_fn, (q, k, v), backend="aot_eager")


def _pcall(q=None, **overrides):
    base_q, base_k, base_v, lens = _prefix_inputs([3, 2], [3, 4], [-1, 0], dtype=torch.float32)
    lens.update(overrides)
    return prefix_attention(base_q if q is None else q, base_k, base_v, **lens)


def _pindex(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: _pcall(prefix_index=[-1, 0]), TypeError, "prefix_index: expected a torch.Tensor, got list"),
        (lambda: _pcall(prefix_index=torch.tensor([-1, 0])), TypeError, "prefix_index: expected dtype int32"),
        (
            lambda: _pcall(prefix_index=_pindex(-1, 0, 0)),
            ValueError,
            r"prefix_index: expected shape \[B\] = \(2,\) \(one entry per sequence of cu_seqlens_q\), got \(3,\)",
        ),
        (lambda: _pcall(prefix_index=_pindex(-1, 0)[None]), ValueError, r"prefix_index: expected shape \[B\]"),
        (lambda: _pcall(prefix_index=_pindex(-1, 0).to("meta")), ValueError, "prefix_index: expected device cpu"),
        (
            lambda: _pcall(prefix_index=_pindex(-1, 2)),
            ValueError,
            r"prefix_index: values must be -1 or a sequence index in \[0, 2\); sequence 1 has 2",
        ),
        (
            lambda: _pcall(prefix_index=_pindex(-2, -1)),
            ValueError,
            r"prefix_index: values must be -1 or a sequence index in \[0, 2\); sequence 0 has -2",
        ),
        (
            lambda: _pcall(prefix_index=_pindex(0, -1)),
            ValueError,
            "prefix_index: sequence 0 has the prefix sequence 0, whose own prefix_index is 0",
        ),
        (
            lambda: _pcall(prefix_index=_pindex(1, 0)),
            ValueError,
            "prefix_index: sequence 0 has the prefix sequence 1, whose own prefix_index is 0 .* one level deep",
        ),
        # the checks shared with attention
        (lambda: _pcall(q=torch.randn(5, 4, 16).long()), TypeError, "q: expected dtype"),
        (
            lambda: _pcall(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)),
            ValueError,
            "cu_seqlens_k: expected the shape of cu_seqlens_q",
        ),
        (lambda: _pcall(max_seqlen_k=3), ValueError, "max_seqlen_k: sequence 1 has 4 tokens, more than max_seqlen_k=3"),
        (lambda: _pcall(causal=1), TypeError, "causal: expected a bool"),
    ],
)
def test_prefix_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_prefix_depth_check_names_the_nested_sequence():
    q, k, v, lens = _prefix_inputs([2, 2, 2], [2, 2, 2], [-1, 0, 1])
    with pytest.raises(ValueError, match="sequence 2 has the prefix sequence 1, whose own prefix_index is 0"):
        prefix_attention(q, k, v, **lens)


def test_prefix_value_checks_can_be_switched_off(monkeypatch):
    """Like the cu_seqlens checks: RLK_CHECK_VALUES=0 and checks.trusted_values() skip the prefix_index check (the
    reference then follows the chain of a too-deep prefix one level, without an error)."""
    checked = _pcall()
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")
    assert torch.equal(_pcall(), checked)
    q, k, v, lens = _prefix_inputs([2, 2, 2], [2, 2, 2], [-1, 0, 1])
    prefix_attention(q, k, v, **lens)
    monkeypatch.setenv("RLK_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match="prefix_index"):
        prefix_attention(q, k, v, **lens)
    with checks.trusted_values():
        prefix_attention(q, k, v, **lens)
