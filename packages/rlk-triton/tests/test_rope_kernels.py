"""Triton rope primitives against the reference (ground truth: the reference run in fp64).

On a machine without CUDA the kernels run under the Triton CPU interpreter
(``TRITON_INTERPRET=1``, set below before triton is imported) with small shapes; bf16 is compared
on the GPU only (the interpreter truncates fp32 -> bf16 casts instead of rounding). With CUDA the
same tests run on the GPU, plus the ``gpu``-marked ones (bf16, realistic shapes). Tolerances come
from the numerical contract (``rlk.core.contract``); batch invariance is checked bit for bit.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import rlk
from rlk.core import contract
from rlk.ops.rope import apply_rope
from rlk.reference import rope as ref
from rlk_triton import rope as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CPU = DEVICE.type == "cpu"

pytestmark = [pytest.mark.triton_interpreter] if ON_CPU else []

DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tables(n_tokens: int, rotary_dim: int, interleaved: bool, dtype: torch.dtype, seed: int = 0):
    """Standard cos/sin ``[T, R]`` for random positions (each angle twice, in the pair layout)."""
    positions = torch.randint(0, 32768, (n_tokens,), generator=_gen(seed)).double()
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = positions[:, None] * inv_freq
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


def inputs(t, h, d, r, dtype, interleaved, table_dtype, seed=0):
    x = (torch.randn(t, h, d, generator=_gen(seed)) * 4).to(DEVICE, dtype)
    grad = torch.randn(t, h, d, generator=_gen(seed + 1)).to(DEVICE, dtype)
    cos, sin = tables(t, r, interleaved, dtype if table_dtype == "x.dtype" else torch.float32, seed + 2)
    return x, grad, cos, sin


def run(module, name, x, cos, sin, interleaved):
    out = torch.empty_like(x)
    getattr(module, name)(x, cos, sin, interleaved, out)
    return out


def term_scale(x, cos, sin, interleaved):
    """Contract scale (:func:`rlk.reference.rope.error_scale`)."""
    return ref.error_scale(x, cos, sin, interleaved)


def check(dtype, name, got, truth, scale):
    dev = contract.compare_outputs(
        contract.entry("rope", dtype), name, got.reshape(-1), truth.reshape(-1), scale.reshape(-1)
    )
    assert dev.ok, dev


SHAPES = [(1, 1, 2, 2), (7, 3, 64, 64), (5, 9, 96, 96), (4, 2, 80, 32), (3, 5, 12, 6)]


@pytest.mark.parametrize("table_dtype", ["float32", "x.dtype"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype, shape, interleaved, table_dtype):
    t, h, d, r = shape
    x, grad, cos, sin = inputs(t, h, d, r, dtype, interleaved, table_dtype)
    c64, s64 = cos.double(), sin.double()
    out = run(tk, "rope_fwd", x, cos, sin, interleaved)
    check(
        dtype, "out", out, run(ref, "rope_fwd", x.double(), c64, s64, interleaved), term_scale(x, cos, sin, interleaved)
    )
    assert torch.equal(out[..., r:], x[..., r:])  # partial rotary: the rest is copied
    gx = run(tk, "rope_bwd", grad, cos, sin, interleaved)
    assert gx.dtype == dtype
    check(
        dtype,
        "grad_x",
        gx,
        run(ref, "rope_bwd", grad.double(), c64, s64, interleaved),
        term_scale(grad, cos, sin, interleaved),
    )
    e = contract.entry("rope", dtype)
    dev = contract.compare_grad(e, "grad_x", gx, run(ref, "rope_bwd", grad.double(), c64, s64, interleaved), 0.0)
    assert dev.ok, dev


def test_general_tables_fp32():
    """Tables whose halves differ (not a rotation): the kernels still follow the spec's per-element formula."""
    g = _gen(5)
    x = torch.randn(6, 3, 20, generator=g).to(DEVICE)
    cos, sin = torch.randn(6, 16, generator=g).to(DEVICE), torch.randn(6, 16, generator=g).to(DEVICE)
    for interleaved in (False, True):
        for name in ("rope_fwd", "rope_bwd"):
            got = run(tk, name, x, cos, sin, interleaved)
            truth = run(ref, name, x.double(), cos.double(), sin.double(), interleaved)
            scale = (x.double().abs().amax(-1, keepdim=True) * 2 * max(cos.abs().max(), sin.abs().max())).expand_as(x)
            check(torch.float32, name, got, truth, scale)


BATCH_SIZES = [1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129]


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(torch.float16, marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, marks=pytest.mark.gpu),
    ],
)
def test_batch_invariance(dtype):
    """A token computed alone equals the same token at the first, a middle and the last position of
    batches of many sizes (H = 5: not a multiple of the head block)."""
    h, d = 5, 64
    probe, probe_grad, probe_cos, probe_sin = inputs(1, h, d, d, dtype, False, "float32", seed=20)
    alone = run(tk, "rope_fwd", probe, probe_cos, probe_sin, False)
    alone_grad = run(tk, "rope_bwd", probe_grad, probe_cos, probe_sin, False)
    for n in BATCH_SIZES:
        x, grad, cos, sin = inputs(n, h, d, d, dtype, False, "float32", seed=n)
        positions = sorted({0, n // 2, n - 1})
        for pos in positions:
            x[pos], grad[pos], cos[pos], sin[pos] = probe[0], probe_grad[0], probe_cos[0], probe_sin[0]
        out = run(tk, "rope_fwd", x, cos, sin, False)
        gx = run(tk, "rope_bwd", grad, cos, sin, False)
        for pos in positions:
            assert torch.equal(out[pos : pos + 1], alone), (n, pos)
            assert torch.equal(gx[pos : pos + 1], alone_grad), (n, pos)


def test_op_layer_on_the_triton_backend():
    """apply_rope pinned to Triton: forward and backward (run on the forward's backend) equal the primitives."""
    g = _gen(30)
    q = torch.randn(2, 4, 6, 16, generator=g).to(DEVICE).requires_grad_(True)
    k = torch.randn(2, 2, 6, 16, generator=g).to(DEVICE).requires_grad_(True)
    cos, sin = tables(12, 16, True, torch.float32, seed=31)
    with rlk.use_backend("triton"):
        assert rlk.explain("rope", q).backend == "triton"
        out_q, out_k = apply_rope(q, k, cos.view(2, 6, 16), sin.view(2, 6, 16), interleaved=True)
        (out_q.square().sum() + out_k.sum()).backward()
    packed_q = q.detach().transpose(1, 2).reshape(12, 4, 16).contiguous()
    want_q = run(tk, "rope_fwd", packed_q, cos, sin, True)
    assert torch.equal(out_q.transpose(1, 2).reshape(12, 4, 16), want_q)
    want_gq = run(tk, "rope_bwd", 2 * want_q, cos, sin, True)
    assert torch.equal(q.grad.transpose(1, 2).reshape(12, 4, 16), want_gq)


def test_tile_configs_are_consistent():
    assert set(tk.TILE_CONFIGS) == {"half", "interleaved"}
    for layout in tk.TILE_CONFIGS.values():
        assert set(layout) == {torch.float32, torch.float16, torch.bfloat16}
        for cfg in layout.values():
            assert cfg["BLOCK_H"] & (cfg["BLOCK_H"] - 1) == 0


# ----------------------------------------------------------------------------------------------
# GPU only: realistic shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("table_dtype", ["float32", "x.dtype"])
def test_llama_shape_bf16_gpu(table_dtype):
    """T = 16384 tokens, Hq = 32, Hk = 8, D = 128, bf16: contract vs fp64 and invariance (a token alone vs
    at the first, middle and last position), forward and backward, both pair layouts."""
    t, d = 16384, 128
    for interleaved in (False, True):
        for h in (32, 8):
            x, grad, cos, sin = inputs(t, h, d, d, torch.bfloat16, interleaved, table_dtype, seed=h)
            c64, s64 = cos.double(), sin.double()
            out = run(tk, "rope_fwd", x, cos, sin, interleaved)
            gx = run(tk, "rope_bwd", grad, cos, sin, interleaved)
            check(
                torch.bfloat16,
                "out",
                out,
                run(ref, "rope_fwd", x.double(), c64, s64, interleaved),
                term_scale(x, cos, sin, interleaved),
            )
            check(
                torch.bfloat16,
                "grad_x",
                gx,
                run(ref, "rope_bwd", grad.double(), c64, s64, interleaved),
                term_scale(grad, cos, sin, interleaved),
            )
            for pos in (0, t // 2, t - 1):
                one = slice(pos, pos + 1)
                assert torch.equal(run(tk, "rope_fwd", x[one], cos[one], sin[one], interleaved), out[one])
                assert torch.equal(run(tk, "rope_bwd", grad[one], cos[one], sin[one], interleaved), gx[one])
