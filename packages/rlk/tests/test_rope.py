"""The public rope op (``rlk.ops.rope.apply_rope``) on the reference backend: Hugging Face's formula
re-derived here, layouts, numerics under the contract, autograd, torch.library integration and
bad input. Ground truth is the formula below in fp64; tolerances come from the contract."""

from __future__ import annotations

import pytest
import torch

import rlk
from rlk.core import contract
from rlk.ops.rope import apply_rope

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---------------------------------------------------------------------------
# the formulas, written out independently of rlk
# ---------------------------------------------------------------------------


def rotate_half(x):
    """Hugging Face's ``rotate_half``: ``cat(-x2, x1)`` over the two halves of the last dim."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    """GPT-J's pairing: ``(x[2i], x[2i+1]) -> (-x[2i+1], x[2i])``."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def hf_rope(x, cos, sin, unsqueeze_dim=1, interleaved=False):
    """``x * cos + rotate(x) * sin`` on the first R = cos.shape[-1] features, the rest passed through
    (Hugging Face's ``apply_rotary_pos_emb`` for one tensor, and its partial-rotary variant)."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    rotate = rotate_every_two if interleaved else rotate_half
    return torch.cat((x_rot * cos + rotate(x_rot) * sin, x_pass), dim=-1)


def term_scale(x, cos, sin, unsqueeze_dim=1, interleaved=False):
    """Contract scale per element: ``|x * cos| + |rotate(x) * sin|`` on rotated features, ``|x|`` on the others."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.double().unsqueeze(unsqueeze_dim), sin.double().unsqueeze(unsqueeze_dim)
    x = x.double()
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    rotate = rotate_every_two if interleaved else rotate_half
    return torch.cat(((x_rot * cos).abs() + (rotate(x_rot) * sin).abs(), x_pass.abs()), dim=-1)


def tables(positions, rotary_dim, interleaved=False, base=10000.0, dtype=torch.float32):
    """cos/sin ``[..., R]`` for integer positions ``[...]``, in the layout ``interleaved`` expects."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = positions.double()[..., None] * inv_freq
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _qk_bhsd(b=2, hq=4, hk=2, s=9, d=16, dtype=torch.float32, seed=0):
    g = _gen(seed)
    return torch.randn(b, hq, s, d, generator=g).to(dtype), torch.randn(b, hk, s, d, generator=g).to(dtype)


def _positions(b, s, seed=1):
    return torch.randint(0, 4096, (b, s), generator=_gen(seed))


def _check_values(dtype, got, truth, scale, name):
    dev = contract.compare_outputs(
        contract.entry("rope", dtype), name, got.reshape(-1), truth.reshape(-1), scale.reshape(-1)
    )
    assert dev.ok, dev
    return dev


# ---------------------------------------------------------------------------
# formula and layouts (fp64: the reference computes in fp64, so it must match the formula closely)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_matches_hf_formula_all_layouts_fp64(interleaved, rotary_dim):
    q, k = _qk_bhsd(dtype=torch.float64)
    cos, sin = tables(_positions(2, 9), rotary_dim, interleaved, dtype=torch.float64)  # [B, S, R]
    want_q, want_k = (hf_rope(x, cos, sin, 1, interleaved) for x in (q, k))
    # [B, H, S, D] with cos [B, S, R]
    got_q, got_k = apply_rope(q, k, cos, sin, interleaved=interleaved)
    torch.testing.assert_close(got_q, want_q, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(got_k, want_k, rtol=1e-15, atol=1e-15)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    # [B, S, H, D] with unsqueeze_dim=2
    got_q2, got_k2 = apply_rope(
        q.transpose(1, 2), k.transpose(1, 2), cos, sin, interleaved=interleaved, unsqueeze_dim=2
    )
    assert torch.equal(got_q2, got_q.transpose(1, 2)) and torch.equal(got_k2, got_k.transpose(1, 2))
    # packed [T, H, D] with cos [T, R]
    packed = [x.transpose(1, 2).reshape(18, x.shape[1], 16) for x in (q, k)]
    got_qp, got_kp = apply_rope(
        *packed, cos.reshape(18, rotary_dim), sin.reshape(18, rotary_dim), interleaved=interleaved
    )
    assert torch.equal(got_qp, got_q2.reshape(18, 4, 16)) and torch.equal(got_kp, got_k2.reshape(18, 2, 16))


def test_shared_tables_broadcast_over_the_batch():
    q, k = _qk_bhsd(dtype=torch.float64)
    cos, sin = tables(torch.arange(9), 16, dtype=torch.float64)  # [S, R]
    want = apply_rope(q, k, cos[None].expand(2, 9, 16), sin[None].expand(2, 9, 16))
    for c, s in ((cos, sin), (cos[None], sin[None])):
        got = apply_rope(q, k, c, s)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_interleaved_equals_rotate_half_on_permuted_features():
    """GPT-J pairs (2i, 2i+1) are rotate-half pairs (i, i + D/2) after a feature permutation."""
    q, k = _qk_bhsd(dtype=torch.float64, d=12)
    cos, sin = tables(_positions(2, 9), 12, interleaved=True, dtype=torch.float64)
    perm = torch.cat((torch.arange(0, 12, 2), torch.arange(1, 12, 2)))  # interleaved -> half layout
    got = apply_rope(q, k, cos, sin, interleaved=True)
    half = apply_rope(q[..., perm], k[..., perm], cos[..., perm], sin[..., perm])
    assert torch.equal(got[0][..., perm], half[0]) and torch.equal(got[1][..., perm], half[1])


def test_rotation_preserves_pair_norms_and_position_zero_is_identity():
    q, k = _qk_bhsd(dtype=torch.float64)
    positions = _positions(2, 9)
    positions[:, 0] = 0
    cos, sin = tables(positions, 16, dtype=torch.float64)
    qe, _ = apply_rope(q, k, cos, sin)
    pair_norm = q[..., :8] ** 2 + q[..., 8:] ** 2
    torch.testing.assert_close(qe[..., :8] ** 2 + qe[..., 8:] ** 2, pair_norm, rtol=1e-12, atol=0)
    assert torch.equal(qe[:, :, 0], q[:, :, 0])


# ---------------------------------------------------------------------------
# numerics in the working dtypes
# ---------------------------------------------------------------------------


def _ulp(m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` numbers at magnitude ``m`` (fp64 in, fp64 out; subnormal spacing below)."""
    fi = torch.finfo(dtype)
    m = m.clamp(min=fi.smallest_normal)
    return torch.exp2(torch.floor(torch.log2(m))) * fi.eps


@pytest.mark.parametrize("table_dtype", ["float32", "x.dtype"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_within_contract_and_near_hf_in_working_dtype(dtype, interleaved, table_dtype):
    q, k = _qk_bhsd(b=2, hq=4, hk=2, s=33, d=64, dtype=dtype, seed=2)
    q = q * 8  # magnitudes beyond 1 so relative and absolute errors differ
    tdt = torch.float32 if table_dtype == "float32" else dtype
    cos, sin = tables(_positions(2, 33, seed=3), 48, interleaved, dtype=tdt)  # partial rotary: R = 48 < D
    got_q, got_k = apply_rope(q, k, cos, sin, interleaved=interleaved)
    assert got_q.dtype == got_k.dtype == dtype
    for name, x, got in (("q", q, got_q), ("k", k, got_k)):
        truth = hf_rope(x.double(), cos.double(), sin.double(), 1, interleaved)
        _check_values(dtype, got, truth, term_scale(x, cos, sin, 1, interleaved), name)
        # Hugging Face's own formula in the working dtype (tables cast to x's dtype, as HF does):
        # it rounds both products and the sum; rlk rounds once. They differ by a few ulp of the products.
        hf = hf_rope(x, cos.to(dtype), sin.to(dtype), 1, interleaved)
        ours_same_tables = apply_rope(x, x, cos.to(dtype), sin.to(dtype), interleaved=interleaved)[0]
        products = term_scale(x, cos.to(dtype), sin.to(dtype), 1, interleaved)
        gap = (ours_same_tables.double() - hf.double()).abs() / _ulp(products, dtype)
        assert float(gap.max()) <= 2.0, float(gap.max())


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_matches_autograd_of_the_formula(dtype, interleaved):
    q, k = _qk_bhsd(b=2, hq=3, hk=1, s=17, d=32, dtype=dtype, seed=4)
    cos, sin = tables(_positions(2, 17, seed=5), 32, interleaved)
    gq, gk = _qk_bhsd(b=2, hq=3, hk=1, s=17, d=32, dtype=dtype, seed=6)
    leaves = [t.clone().requires_grad_(True) for t in (q, k)]
    out_q, out_k = apply_rope(*leaves, cos, sin, interleaved=interleaved)
    torch.autograd.backward((out_q, out_k), (gq, gk))
    leaves64 = [t.double().requires_grad_(True) for t in (q, k)]
    ref = [hf_rope(t, cos.double(), sin.double(), 1, interleaved) for t in leaves64]
    torch.autograd.backward(ref, (gq.double(), gk.double()))
    e = contract.entry("rope", dtype)
    for name, got, want in (("grad_q", leaves[0].grad, leaves64[0].grad), ("grad_k", leaves[1].grad, leaves64[1].grad)):
        assert got.dtype == dtype
        dev = contract.compare_grad(e, name, got, want, 0.0)
        assert dev.ok, dev


def test_backward_is_the_inverse_rotation_for_standard_tables():
    """With each angle held twice (the usual tables), the transpose is the rotation by -angle."""
    x = torch.randn(7, 3, 16, generator=_gen(7), dtype=torch.float64)
    for interleaved in (False, True):
        cos, sin = tables(torch.arange(7) * 13, 16, interleaved, dtype=torch.float64)
        leaf = x.clone().requires_grad_(True)
        out, _ = apply_rope(leaf, leaf.detach(), cos, sin, interleaved=interleaved)
        g = torch.randn(7, 3, 16, generator=_gen(8), dtype=torch.float64)
        out.backward(g)
        inverse, _ = apply_rope(g, g, cos, -sin, interleaved=interleaved)
        torch.testing.assert_close(leaf.grad, inverse, rtol=1e-15, atol=1e-15)


def test_fp64_gradcheck_general_tables_and_partial_rotary():
    g = _gen(9)
    q = torch.randn(2, 3, 4, 10, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 4, 10, generator=g, dtype=torch.float64, requires_grad=True)
    # arbitrary tables (halves not equal): the backward must be the exact transpose
    cos = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)
    sin = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)
    for interleaved in (False, True):
        assert torch.autograd.gradcheck(lambda a, b, i=interleaved: apply_rope(a, b, cos, sin, interleaved=i), (q, k))
    qp = q.detach().transpose(1, 2).reshape(8, 3, 10).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a: apply_rope(a, a, cos.reshape(8, 6), sin.reshape(8, 6))[0], (qp,))


def test_cos_and_sin_get_no_gradient():
    q, k = _qk_bhsd(seed=10)
    cos, sin = tables(_positions(2, 9), 16)
    cos, sin = cos.requires_grad_(True), sin.requires_grad_(True)
    q = q.requires_grad_(True)
    out_q, out_k = apply_rope(q, k, cos, sin)
    (out_q.sum() + out_k.sum()).backward()
    assert q.grad is not None and cos.grad is None and sin.grad is None


# ---------------------------------------------------------------------------
# shapes, strides, torch.library, torch.compile
# ---------------------------------------------------------------------------


def test_non_contiguous_inputs():
    q, k = _qk_bhsd(b=2, hq=4, hk=2, s=9, d=32, seed=11)
    cos, sin = tables(_positions(2, 9), 16)
    q_strided, k_strided = q[..., ::2], k.transpose(2, 3).contiguous().transpose(2, 3)[..., :16]
    cos_strided = torch.cat((cos, cos), -1)[..., ::2]  # a view with stride 2 ...
    sin_strided = torch.cat((sin, sin), -1)[..., ::2]
    cos_dense = cos_strided.contiguous()
    sin_dense = sin_strided.contiguous()
    want = apply_rope(q_strided.contiguous(), k_strided.contiguous(), cos_dense, sin_dense)
    got = apply_rope(q_strided, k_strided, cos_strided, sin_strided)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_empty_inputs():
    q = torch.randn(2, 4, 0, 8, requires_grad=True)
    k = torch.randn(2, 2, 0, 8, requires_grad=True)
    cos = torch.randn(2, 0, 8)
    out_q, out_k = apply_rope(q, k, cos, cos)
    assert out_q.shape == q.shape and out_k.shape == k.shape
    (out_q.sum() + out_k.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    packed = torch.randn(5, 0, 8)
    out, _ = apply_rope(packed, packed, torch.randn(5, 8), torch.randn(5, 8))
    assert out.shape == (5, 0, 8)


def test_opcheck_custom_ops():
    g = _gen(12)
    x = torch.randn(6, 3, 16, generator=g, requires_grad=True)
    cos, sin = tables(torch.arange(6), 12)
    for interleaved in (False, True):
        torch.library.opcheck(torch.ops.rlk.rope_fwd.default, (x, cos, sin, interleaved))
        torch.library.opcheck(torch.ops.rlk.rope_bwd.default, (x.detach(), cos, sin, interleaved, "reference"))
    torch.library.opcheck(torch.ops.rlk.rope_fwd.default, (x.detach().half(), cos, sin, False))


def test_torch_compile_fullgraph_matches_eager():
    q, k = _qk_bhsd(b=2, hq=4, hk=2, s=9, d=16, seed=13)
    cos, sin = tables(_positions(2, 9), 16)

    def loss_fn(a, b):
        out_q, out_k = apply_rope(a, b, cos, sin)
        out_qi, _ = apply_rope(a, b, cos, sin, interleaved=True)
        return out_q, out_k, out_qi, (out_q * out_k.repeat_interleave(2, 1)).sum() + out_qi.square().sum()

    results = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_(True) for t in (q, k)]
        *outs, loss = fn(*leaves)
        loss.backward()
        results.append([o.detach() for o in outs] + [t.grad for t in leaves])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: apply_rope(torch.randn(2, 3, 4, 7), torch.randn(2, 3, 4, 7), torch.randn(4, 7), torch.randn(4, 7)),
            ValueError,
            r"cos: the last dim is the rotary dim R, which must be even.*got R = 7",
        ),
        (
            lambda: apply_rope(
                torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8), torch.randn(4, 10), torch.randn(4, 10)
            ),
            ValueError,
            r"<= the head dim D = 8; got R = 10",
        ),
        (
            lambda: apply_rope(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8), torch.randn(5, 8), torch.randn(5, 8)),
            ValueError,
            r"cos: expected shape \[S, R\] or \[B, S, R\] with B = 2, S = 4, got \(5, 8\)",
        ),
        (
            lambda: apply_rope(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8), torch.randn(4, 8), torch.randn(3, 8)),
            ValueError,
            r"sin: expected the shape of cos \(4, 8\)",
        ),
        (
            lambda: apply_rope(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 5, 8), torch.randn(4, 8), torch.randn(4, 8)),
            ValueError,
            r"k: expected batch 2 and sequence length 4",
        ),
        (
            lambda: apply_rope(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 6), torch.randn(4, 8), torch.randn(4, 8)),
            ValueError,
            r"k: expected 4 dims and head dim D = 8",
        ),
        (
            lambda: apply_rope(torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 8)),
            ValueError,
            r"q: expected shape \[B, H, S, D\]",
        ),
        (
            lambda: apply_rope(
                torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8), torch.randn(4, 8), torch.randn(4, 8), unsqueeze_dim=3
            ),
            ValueError,
            "unsqueeze_dim: expected 1 or 2",
        ),
        (
            lambda: apply_rope(
                torch.randn(5, 3, 8), torch.randn(5, 3, 8), torch.randn(5, 8), torch.randn(5, 8), unsqueeze_dim=2
            ),
            ValueError,
            "1 for packed",
        ),
        (
            lambda: apply_rope(torch.randn(5, 3, 8), torch.randn(4, 3, 8), torch.randn(5, 8), torch.randn(5, 8)),
            ValueError,
            "k: expected 5 tokens like q",
        ),
        (
            lambda: apply_rope(torch.randn(5, 3, 8), torch.randn(5, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)),
            ValueError,
            r"cos: expected shape \[T, R\] with T = 5 for packed q",
        ),
        (
            lambda: apply_rope(torch.randn(5, 3, 8).long(), torch.randn(5, 3, 8), torch.randn(5, 8), torch.randn(5, 8)),
            TypeError,
            "q: expected dtype",
        ),
        (
            lambda: apply_rope(torch.randn(5, 3, 8).half(), torch.randn(5, 3, 8), torch.randn(5, 8), torch.randn(5, 8)),
            TypeError,
            r"k: expected the dtype of q \(torch.float16\)",
        ),
        (
            lambda: apply_rope(
                torch.randn(5, 3, 8).half(),
                torch.randn(5, 3, 8).half(),
                torch.randn(5, 8).bfloat16(),
                torch.randn(5, 8).bfloat16(),
            ),
            TypeError,
            r"cos: expected dtype float32 or the dtype of q \(torch.float16\), got torch.bfloat16",
        ),
        (
            lambda: apply_rope(torch.randn(5, 3, 8), torch.randn(5, 3, 8), torch.randn(5, 8), torch.randn(5, 8).half()),
            TypeError,
            "sin: expected the dtype of cos",
        ),
        (
            lambda: apply_rope(
                torch.randn(5, 3, 8), torch.randn(5, 3, 8, device="meta"), torch.randn(5, 8), torch.randn(5, 8)
            ),
            ValueError,
            "k: expected device cpu",
        ),
        (
            lambda: apply_rope(
                torch.randn(5, 3, 8), torch.randn(5, 3, 8), torch.randn(5, 8, device="meta"), torch.randn(5, 8)
            ),
            ValueError,
            "cos: expected device cpu",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ---------------------------------------------------------------------------
# GPU: the backend rlk picks there
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_backend_values_opcheck_and_compile(dtype):
    """Llama-like shapes (Hq = 32, Hk = 8, D = 128) on the GPU backend: contract vs fp64, HF gap,
    gradients, opcheck and inductor fullgraph equal to eager bitwise."""
    b, s = 2, 1000
    g = _gen(14)
    q = torch.randn(b, 32, s, 128, generator=g).to("cuda", dtype)
    k = torch.randn(b, 8, s, 128, generator=g).to("cuda", dtype)
    cos, sin = tables(_positions(b, s, seed=15), 128)
    cos, sin = cos.cuda(), sin.cuda()
    assert rlk.explain("rope", q).backend != "reference"
    got_q, got_k = apply_rope(q, k, cos, sin)
    for name, x, got in (("q", q, got_q), ("k", k, got_k)):
        truth = hf_rope(x.double(), cos.double(), sin.double())
        _check_values(dtype, got, truth, term_scale(x, cos, sin), name)
    torch.library.opcheck(
        torch.ops.rlk.rope_fwd.default, (q[0].transpose(0, 1).contiguous().requires_grad_(), cos[0], sin[0], False)
    )

    def fn(a, c):
        out_q, out_k = apply_rope(a, c, cos, sin)
        return out_q, out_k, (out_q.float().square().sum() + out_k.float().sum())

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k)]
        *outs, loss = f(*leaves)
        loss.backward()
        results.append([o.detach() for o in outs] + [t.grad for t in leaves])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)
