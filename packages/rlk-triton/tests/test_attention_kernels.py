"""Triton attention primitives (``attention``, ``prefix_attention``) against the reference (ground truth: the
reference run in fp64), and their batch invariance, bit for bit.

On a machine without CUDA the kernels run under the Triton CPU interpreter (``TRITON_INTERPRET=1``)
with tiny shapes, fp32 and fp16 only (bf16 ``tl.dot`` is wrong under the interpreter); with CUDA the
same tests run on the GPU, plus the ``gpu``-marked ones (bf16, real lengths, SDPA negative control).
The tile constants are the shipped ones: fp32 tiles are small (32 x 16), so tiny lengths already
span several query and key blocks; fp16 uses the real 128 x 64 tiles, so its cases use ~150 keys.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from rlk.core import contract
from rlk.reference import attention as ref
from rlk_triton import attention as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]
# Under the interpreter these run only with TRITON_INTERPRET=1 (the repository conftest deselects them
# otherwise); on a GPU they run as they are.
interp = pytest.mark.triton_interpreter if INTERPRETER else pytest.mark.gpu


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _cu(lengths) -> torch.Tensor:
    return torch.tensor(
        [0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )


class Packed:
    """Random packed varlen problem: q/k/v/grad_out/grad_lse for sequences of (Lq, Lk) lengths."""

    def __init__(self, lq, lk, hq=4, hkv=2, d=64, dtype=torch.float32, seed=0, scale=1.0):
        g = torch.Generator().manual_seed(seed)
        self.lq, self.lk, self.d = list(lq), list(lk), d
        self.cu_q, self.cu_k = _cu(lq), _cu(lk)
        tq, tk_ = sum(lq), sum(lk)

        def rnd(*shape):
            return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)

        self.q, self.k, self.v = rnd(tq, hq, d), rnd(tk_, hkv, d), rnd(tk_, hkv, d)
        self.grad_out = rnd(tq, hq, d)
        self.grad_lse = torch.randn(hq, tq, generator=g).to(DEVICE)
        self.scale = 1 / math.sqrt(d)

    def args(self):
        return self.cu_q, self.cu_k, max(self.lq, default=0), max(self.lk, default=0)


def fwd(impl, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=stat, device=q.device)
    impl.attention_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, out, lse)
    return out, lse


def bwd(impl, grad_out, q, k, v, out, lse, grad_lse, cu_q, cu_k, max_q, max_k, causal, scale):
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    impl.attention_bwd(grad_out, q, k, v, out, lse, grad_lse, cu_q, cu_k, max_q, max_k, causal, scale, *grads)
    return grads


def run_both(p: Packed, causal: bool, with_grad_lse: bool = True):
    """Triton outputs and gradients, and the fp64 reference's from the same (rounded) inputs."""
    results = []
    for impl, cast in ((tk, lambda t: t), (ref, lambda t: t.double())):
        q, k, v, go = (cast(t) for t in (p.q, p.k, p.v, p.grad_out))
        out, lse = fwd(impl, q, k, v, *p.args(), causal, p.scale)
        gl = p.grad_lse.to(lse.dtype) if with_grad_lse else None
        results.append((out, lse, *bwd(impl, go, q, k, v, out, lse, gl, *p.args(), causal, p.scale)))
    return results


def out_scale(p: Packed) -> torch.Tensor:
    """The contract's scale of ``out``: 1 + max |v| over the keys (and the kv head) of the query's sequence,
    per element ``[Tq, Hq, D]``."""
    group = p.q.shape[1] // p.k.shape[1]
    scale = torch.ones(p.q.shape[0], p.q.shape[1], dtype=torch.float64, device=DEVICE)
    for b in range(len(p.lq)):
        q0, q1, k0, k1 = int(p.cu_q[b]), int(p.cu_q[b + 1]), int(p.cu_k[b]), int(p.cu_k[b + 1])
        if k1 > k0:
            vmax = p.v[k0:k1].double().abs().amax(dim=(0, 2)).repeat_interleave(group)
            scale[q0:q1] += vmax
    return scale[:, :, None].expand(p.q.shape).reshape(-1)


def check_values(p: Packed, got, want, dtype, op: str = "attention", scale=None) -> dict[str, float]:
    """Contract checks of out, lse and the three gradients; returns the ratios (worst / allowed). ``scale``: of
    ``out`` (default :func:`out_scale`)."""
    e = contract.entry(op, dtype)
    out, lse, dq, dk, dv = got
    r_out, r_lse, r_dq, r_dk, r_dv = want
    devs = [
        contract.compare_outputs(
            e, "out", out.reshape(-1), r_out.reshape(-1), out_scale(p) if scale is None else scale
        ),
        contract.compare_outputs(e, "lse", lse.reshape(-1), r_lse.reshape(-1), 1 + r_lse.abs().reshape(-1)),
    ]
    devs += [
        contract.compare_grad(e, name, g, r, 0.0)
        for name, g, r in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv))
    ]
    for dev in devs:
        assert dev.ok, f"{dev.name}: worst {dev.worst:.3g} > allowed {dev.allowed:.3g} ({dtype})"
    return {dev.name: dev.ratio for dev in devs}


# ----------------------------------------------------------------------------------------------
# values against the fp64 reference
# ----------------------------------------------------------------------------------------------

# (Lq, Lk) per sequence: equal lengths, Lq < Lk (chunk against a KV prefix), Lq > Lk (top rows see
# nothing under causal), empty q, empty k, a single decode query.
LENGTHS_FP32 = ([37, 20, 0, 45, 3, 1], [37, 51, 6, 17, 0, 70])
LENGTHS_FP16 = ([150, 20, 1], [150, 140, 131])


@interp
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "dtype, lengths, d",
    [
        (torch.float32, LENGTHS_FP32, 64),
        (torch.float32, ([19, 40], [33, 40]), 40),  # head dim padded to 64
        (torch.float16, LENGTHS_FP16, 64),
    ],
)
def test_values_and_gradients_match_fp64_reference(dtype, lengths, d, causal):
    p = Packed(*lengths, d=d, dtype=dtype, seed=1)
    got, want = run_both(p, causal)
    check_values(p, got, want, dtype)
    out, lse = got[:2]
    no_key = torch.isinf(want[1])
    assert torch.equal(torch.isinf(lse), no_key) and bool((lse[no_key] < 0).all())
    rows = no_key.any(0)
    assert torch.all(out[rows] == 0) and torch.all(got[2][rows] == 0)
    assert all(bool(torch.isfinite(t).all()) for t in got[2:])


@interp
def test_extreme_scores_and_no_grad_lse():
    """Peaked softmax (scores of std ~16, |s| up to ~60) stays within the contract (the error grows with
    the score magnitude: eps * |s|); grad_lse=None is the plain output gradient."""
    p = Packed([33, 17], [40, 17], d=64, dtype=torch.float32, seed=2, scale=4.0)
    got, want = run_both(p, True, with_grad_lse=False)
    check_values(p, got, want, torch.float32)


# ----------------------------------------------------------------------------------------------
# batch invariance (bit for bit)
# ----------------------------------------------------------------------------------------------


def _needle_and_garbage(dtype, d, needle_lengths, seed):
    """A needle sequence and three garbage sequences (large random values, not zeros)."""
    needle = Packed(*needle_lengths, hq=4, hkv=2, d=d, dtype=dtype, seed=seed)
    others = [
        Packed([n], [m], hq=4, hkv=2, d=d, dtype=dtype, seed=seed + i + 1, scale=30.0)
        for i, (n, m) in enumerate([(21, 50), (5, 5), (40, 13)])
    ]
    return needle, others


def _pack(parts: list[Packed], d, dtype) -> Packed:
    packed = Packed([], [], hq=4, hkv=2, d=d, dtype=dtype)
    packed.lq = sum((x.lq for x in parts), [])
    packed.lk = sum((x.lk for x in parts), [])
    packed.cu_q, packed.cu_k = _cu(packed.lq), _cu(packed.lk)
    for name in ("q", "k", "v", "grad_out"):
        setattr(packed, name, torch.cat([getattr(x, name) for x in parts]))
    packed.grad_lse = torch.cat([x.grad_lse for x in parts], dim=1)
    packed.scale = parts[0].scale
    return packed


def _fwd_bwd(p: Packed, causal: bool):
    out, lse = fwd(tk, p.q, p.k, p.v, *p.args(), causal, p.scale)
    return (out, lse, *bwd(tk, p.grad_out, p.q, p.k, p.v, out, lse, p.grad_lse, *p.args(), causal, p.scale))


@interp
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "dtype, needle_lengths",
    [
        (torch.float32, ([45], [60])),
        (torch.float16, ([70], [140])),
    ],
)
def test_needle_alone_equals_needle_packed_first_middle_last(dtype, needle_lengths, causal):
    d = 64
    needle, others = _needle_and_garbage(dtype, d, needle_lengths, seed=10)
    alone = _fwd_bwd(needle, causal)
    n_q, n_k = needle.lq[0], needle.lk[0]
    for position in (0, 2, 3):
        parts = others[:position] + [needle] + others[position:]
        packed = _pack(parts, d, dtype)
        got = _fwd_bwd(packed, causal)
        q0 = sum(x.lq[0] for x in others[:position])
        k0 = sum(x.lk[0] for x in others[:position])
        out, lse, dq, dk, dv = got
        assert torch.equal(out[q0 : q0 + n_q], alone[0]), f"out differs with the needle at position {position}"
        assert torch.equal(lse[:, q0 : q0 + n_q], alone[1]), f"lse differs at position {position}"
        assert torch.equal(dq[q0 : q0 + n_q], alone[2]), f"dq differs at position {position}"
        assert torch.equal(dk[k0 : k0 + n_k], alone[3]), f"dk differs at position {position}"
        assert torch.equal(dv[k0 : k0 + n_k], alone[4]), f"dv differs at position {position}"


def _chunk(full: Packed, q_start: int, q_end: int) -> Packed:
    """Queries [q_start, q_end) of the single sequence of ``full`` against its KV prefix up to the chunk's
    end (chunked prefill / decode with a KV cache: keys 0 .. Lk - Lq + q_end)."""
    n_q, n_k = full.lq[0], full.lk[0]
    kv_end = n_k - n_q + q_end
    part = Packed([], [], hq=4, hkv=2, d=full.d, dtype=full.q.dtype)
    part.lq, part.lk = [q_end - q_start], [kv_end]
    part.cu_q, part.cu_k = _cu(part.lq), _cu(part.lk)
    part.q, part.grad_out = full.q[q_start:q_end].contiguous(), full.grad_out[q_start:q_end].contiguous()
    part.k, part.v = full.k[:kv_end].contiguous(), full.v[:kv_end].contiguous()
    part.grad_lse = full.grad_lse[:, q_start:q_end].contiguous()
    part.scale = full.scale
    return part


@interp
@pytest.mark.parametrize(
    "dtype, lengths, chunkings",
    [
        # fp32 tiles: BLOCK_M 32, BLOCK_N 16 (fwd, dq). Aligned chunks of 32, unaligned of 23 and 7.
        (torch.float32, ([70], [70]), [32, 23, 7]),
        (torch.float32, ([40], [75]), [32, 13]),  # queries against a longer KV (a cached prefix)
        # fp16 tiles: BLOCK_M 128, BLOCK_N 64. Aligned chunks of 128, unaligned of 50.
        (torch.float16, ([150], [150]), [128, 50]),
    ],
)
def test_full_prefill_equals_chunked_prefill_and_decode(dtype, lengths, chunkings):
    """out, lse and dq of every query: full prefill == each chunking == one-token decode steps."""
    full = Packed(*lengths, d=64, dtype=dtype, seed=20)
    want = _fwd_bwd(full, True)
    n_q = full.lq[0]
    decode_rows = range(max(0, n_q - 3), n_q)  # decode steps of the last tokens (interpreter time)
    splits = [list(range(0, n_q, size)) + [n_q] for size in chunkings]
    splits.append([decode_rows[0], *[r + 1 for r in decode_rows]])
    for bounds in splits:
        for a, b in zip(bounds[:-1], bounds[1:]):
            got = _fwd_bwd(_chunk(full, a, b), True)
            where = f"chunk [{a}, {b}) of {bounds[1] - bounds[0]}-row chunks"
            assert torch.equal(got[0], want[0][a:b]), f"out differs: {where}"
            assert torch.equal(got[1], want[1][:, a:b]), f"lse differs: {where}"
            assert torch.equal(got[2], want[2][a:b]), f"dq differs: {where}"


@interp
def test_backward_is_deterministic():
    p = Packed(*LENGTHS_FP32, d=64, dtype=torch.float32, seed=30)
    first, second = _fwd_bwd(p, True), _fwd_bwd(p, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_head_dim_over_256_is_refused():
    with pytest.raises(ValueError, match="head_dim <= 256"):
        tk._block_d(320)


# ----------------------------------------------------------------------------------------------
# GPU: bf16, real lengths, and the negative control
# ----------------------------------------------------------------------------------------------


def _gpu_problem(d: int, lengths_q, lengths_k, seed=0, hq=8, hkv=2):
    return Packed(lengths_q, lengths_k, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_bf16_invariance_with_real_lengths(d):
    """A 4096-token sequence: full prefill == chunks of 1000 == decode of the last 3 tokens == packed with
    7 other sequences (out, lse, dq; dk/dv alone == packed), bit for bit, and values under the contract."""
    full = _gpu_problem(d, [4096], [4096], seed=40)
    want = _fwd_bwd(full, True)
    for bounds in ([0, 1000, 2000, 3000, 4000, 4096], [4093, 4094, 4095, 4096]):
        for a, b in zip(bounds[:-1], bounds[1:]):
            got = _fwd_bwd(_chunk(full, a, b), True)
            assert torch.equal(got[0], want[0][a:b]), f"out differs in chunk [{a}, {b})"
            assert torch.equal(got[1], want[1][:, a:b]), f"lse differs in chunk [{a}, {b})"
            assert torch.equal(got[2], want[2][a:b]), f"dq differs in chunk [{a}, {b})"
    others = [
        _gpu_problem(d, [n], [m], seed=41 + i)
        for i, (n, m) in enumerate([(1, 900), (300, 300), (2048, 4000), (17, 17), (513, 1000), (4096, 4096), (64, 64)])
    ]
    for i in range(len(others)):
        others[i].q = others[i].q * 20  # garbage of another scale
    packed = _pack(others[:3] + [full] + others[3:], d, torch.bfloat16)
    got = _fwd_bwd(packed, True)
    q0 = sum(x.lq[0] for x in others[:3])
    k0 = sum(x.lk[0] for x in others[:3])
    assert torch.equal(got[0][q0 : q0 + 4096], want[0]) and torch.equal(got[1][:, q0 : q0 + 4096], want[1])
    assert torch.equal(got[2][q0 : q0 + 4096], want[2])
    assert torch.equal(got[3][k0 : k0 + 4096], want[3]) and torch.equal(got[4][k0 : k0 + 4096], want[4])
    # values: a smaller packed problem against the fp64 reference (the reference is slow at 4096^2)
    small = _gpu_problem(d, [700, 1, 300], [700, 900, 256], seed=50)
    got, ref_values = run_both(small, True)
    print(check_values(small, got, ref_values, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_fp16_fp32_values_at_real_lengths(causal):
    for dtype in (torch.float16, torch.float32):
        p = Packed([600, 5, 333], [600, 700, 200], hq=8, hkv=2, d=128, dtype=dtype, seed=60)
        got, want = run_both(p, causal)
        print(dtype, check_values(p, got, want, dtype))


@pytest.mark.gpu
def test_gpu_sdpa_flash_is_not_invariant_negative_control():
    """The property is not free: SDPA's flash backend gives a decode step different bits from the full
    prefill for at least one of these cases (else the invariance tests above would prove nothing)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    differs = []
    for d, n in ((128, 4096), (64, 4096), (128, 1000)):
        g = torch.Generator(device="cuda").manual_seed(70)
        q, k, v = (torch.randn(1, 8, n, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            full = sdpa(q, k, v, is_causal=True)
            last = sdpa(q[:, :, -1:], k, v, is_causal=False)  # the last query sees every key
        differs.append(not torch.equal(full[:, :, -1:], last))
    assert any(differs), (
        "SDPA flash gave the same bits for prefill and decode in every case: the negative "
        "control failed, so these shapes do not exercise the invariance property"
    )


# ----------------------------------------------------------------------------------------------
# prefix_attention: shared prefixes (GRPO groups)
# ----------------------------------------------------------------------------------------------


class Grouped(Packed):
    """A packed problem with ``prefix_index``: sequences given as (Lq, Lk own keys, prefix_index)."""

    def __init__(self, layout, **kwargs):
        lq, lk, prefix = (list(x) for x in zip(*layout)) if layout else ([], [], [])
        super().__init__(lq, lk, **kwargs)
        self.prefix = prefix
        self.prefix_index = torch.tensor(prefix, dtype=torch.int32, device=DEVICE)

    def pargs(self):
        return (*self.args(), self.prefix_index)

    def rows(self, b):
        """(q rows, k rows) of sequence ``b`` as slices."""
        return (slice(int(self.cu_q[b]), int(self.cu_q[b + 1])), slice(int(self.cu_k[b]), int(self.cu_k[b + 1])))


def pfwd(impl, q, k, v, cu_q, cu_k, max_q, max_k, prefix, causal, scale):
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=stat, device=q.device)
    impl.prefix_attention_fwd(q, k, v, cu_q, cu_k, max_q, max_k, prefix, causal, scale, out, lse)
    return out, lse


def pbwd(impl, grad_out, q, k, v, out, lse, grad_lse, cu_q, cu_k, max_q, max_k, prefix, causal, scale):
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    impl.prefix_attention_bwd(
        grad_out, q, k, v, out, lse, grad_lse, cu_q, cu_k, max_q, max_k, prefix, causal, scale, *grads
    )
    return grads


def _prefix_fwd_bwd(impl, p: Grouped, causal: bool, cast=lambda t: t, with_grad_lse=True):
    q, k, v, go = (cast(t) for t in (p.q, p.k, p.v, p.grad_out))
    out, lse = pfwd(impl, q, k, v, *p.pargs(), causal, p.scale)
    gl = p.grad_lse.to(lse.dtype) if with_grad_lse else None
    return (out, lse, *pbwd(impl, go, q, k, v, out, lse, gl, *p.pargs(), causal, p.scale))


def logical_out_scale(p: Grouped) -> torch.Tensor:
    """The contract's scale of ``out``: 1 + max |v| over the query's logical keys (prefix and own), per kv head."""
    group = p.q.shape[1] // p.k.shape[1]
    scale = torch.ones(p.q.shape[0], p.q.shape[1], dtype=torch.float64, device=DEVICE)
    for b in range(len(p.lq)):
        qs, ks = p.rows(b)
        parts = [p.v[ks]] + ([p.v[p.rows(p.prefix[b])[1]]] if p.prefix[b] >= 0 else [])
        keys = torch.cat(parts).double()
        if keys.shape[0]:
            scale[qs] += keys.abs().amax(dim=(0, 2)).repeat_interleave(group)
    return scale[:, :, None].expand(p.q.shape).reshape(-1)


# (Lq, Lk own keys, prefix_index). fp32 tiles: fwd / dq 32 x 16, dkdv 16 queries x 32 keys, so these lengths span
# several blocks and put the prefix / own boundary inside key blocks. Two groups with different prompt lengths,
# mixed with ordinary sequences; responses of equal lengths, Lq < Lk, Lq > Lk own keys (still within the logical
# length), no own keys (Lk = 0), empty (Lq = Lk = 0); a prompt of keys only (Lq = 0) whose response's first rows
# see no key (Lq > P + Lk); a response packed before its prompt.
LAYOUT_FP32 = [
    (20, 37, -1),
    (37, 37, -1),
    (23, 23, 1),
    (0, 0, 1),
    (40, 5, 1),
    (3, 0, 1),
    (9, 17, 1),
    (0, 21, -1),
    (18, 18, 7),
    (30, 30, 7),
    (11, 11, 11),
    (16, 16, -1),
    (0, 5, -1),
    (30, 4, 12),
    (45, 3, -1),
]
# fp16 tiles: fwd / dq 128 x 64, dkdv 64 queries x 128 keys (D <= 64): a 70-token prompt puts the boundary in
# the second key block.
LAYOUT_FP16 = [(70, 70, -1), (60, 60, 0), (9, 9, 0), (0, 0, 0), (5, 0, 0), (20, 131, -1), (13, 13, -1), (50, 50, 6)]


@interp
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "dtype, layout, d",
    [
        (torch.float32, LAYOUT_FP32, 16),
        (torch.float32, [(19, 19, -1), (33, 40, 0), (7, 7, 0)], 40),  # head dim padded to 64 (masked loads)
        (torch.float16, LAYOUT_FP16, 32),
    ],
)
def test_prefix_values_and_gradients_match_fp64_reference(dtype, layout, d, causal):
    p = Grouped(layout, d=d, dtype=dtype, seed=101)
    got = _prefix_fwd_bwd(tk, p, causal)
    want = _prefix_fwd_bwd(ref, p, causal, cast=lambda t: t.double())
    check_values(p, got, want, dtype, op="prefix_attention", scale=logical_out_scale(p))
    out, lse = got[:2]
    no_key = torch.isinf(want[1])
    assert torch.equal(torch.isinf(lse), no_key) and bool((lse[no_key] < 0).all())
    rows = no_key.any(0)
    assert torch.all(out[rows] == 0) and torch.all(got[2][rows] == 0)
    assert all(bool(torch.isfinite(t).all()) for t in got[2:])
    if causal and layout is LAYOUT_FP32:
        assert bool(no_key.any())  # the case of rows that see no key is exercised


@interp
def test_prefix_no_grad_lse_and_gqa_four_to_one():
    p = Grouped([(21, 21, -1), (17, 17, 0), (30, 30, 0)], hq=4, hkv=1, d=16, dtype=torch.float32, seed=102, scale=2.0)
    got = _prefix_fwd_bwd(tk, p, True, with_grad_lse=False)
    want = _prefix_fwd_bwd(ref, p, True, cast=lambda t: t.double(), with_grad_lse=False)
    check_values(p, got, want, torch.float32, op="prefix_attention", scale=logical_out_scale(p))


def _alone(p: Grouped, q_rows, k_parts, causal=True):
    """Plain ``attention`` (Triton) of one sequence: the queries ``q_rows`` of ``p`` against the physically
    concatenated key rows ``k_parts`` (a list of slices), forward and backward."""
    part = Packed([], [], hq=p.q.shape[1], hkv=p.k.shape[1], d=p.d, dtype=p.q.dtype)
    n_q, n_k = q_rows.stop - q_rows.start, sum(s.stop - s.start for s in k_parts)
    part.lq, part.lk = [n_q], [n_k]
    part.cu_q, part.cu_k = _cu(part.lq), _cu(part.lk)
    part.q, part.grad_out = p.q[q_rows].contiguous(), p.grad_out[q_rows].contiguous()
    part.k = torch.cat([p.k[s] for s in k_parts]).contiguous()
    part.v = torch.cat([p.v[s] for s in k_parts]).contiguous()
    part.grad_lse = p.grad_lse[:, q_rows].contiguous()
    part.scale = p.scale
    return _fwd_bwd(part, causal)


@interp
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "dtype, layout, d",
    [
        (torch.float32, LAYOUT_FP32, 16),
        (torch.float32, [(19, 19, -1), (33, 40, 0), (7, 7, 0)], 40),
        (torch.float16, LAYOUT_FP16, 32),
    ],
)
def test_prefix_rows_equal_attention_over_concatenated_keys_bitwise(dtype, layout, d, causal):
    """The promise: every query's out, lse and dq are bitwise those of plain attention on its sequence alone
    over [prefix keys; own keys] (Lq = R, Lk = P + R: a chunked prefill against the prompt's cache), and, for a
    response with Lq = Lk whose prompt has Lq = Lk, those of the full sequence [prompt; response] restricted to the
    response's rows (prompt rows: those of the prompt alone)."""
    p = Grouped(layout, d=d, dtype=dtype, seed=103)
    got = _prefix_fwd_bwd(tk, p, causal)
    checked_full = 0
    for b, a in enumerate(p.prefix):
        qs, ks = p.rows(b)
        if qs.stop == qs.start:
            continue
        parts = [ks] if a < 0 else [p.rows(a)[1], ks]
        want = _alone(p, qs, parts, causal)
        where = f"sequence {b} (prefix {a})"
        assert torch.equal(got[0][qs], want[0]), f"out differs: {where}"
        assert torch.equal(got[1][:, qs], want[1]), f"lse differs: {where}"
        assert torch.equal(got[2][qs], want[2]), f"dq differs: {where}"
        if a >= 0 and causal and p.lq[b] == p.lk[b] and p.lq[a] == p.lk[a] > 0:
            # the full sequence: queries and keys [prompt; response]; the response's rows are the last Lq
            aq = p.rows(a)[0]
            full = _alone_full(p, [aq, qs], parts)
            n = qs.stop - qs.start
            assert torch.equal(got[0][qs], full[0][-n:]), f"out differs from the full sequence: {where}"
            assert torch.equal(got[1][:, qs], full[1][:, -n:]), f"lse differs from the full sequence: {where}"
            assert torch.equal(got[2][qs], full[2][-n:]), f"dq differs from the full sequence: {where}"
            checked_full += 1
    assert checked_full >= 2 or not causal or d == 40


def _alone_full(p: Grouped, q_parts, k_parts):
    """Plain causal attention of one sequence whose queries are the rows ``q_parts`` and keys ``k_parts``
    (lists of slices) of ``p``, concatenated."""
    part = Packed([], [], hq=p.q.shape[1], hkv=p.k.shape[1], d=p.d, dtype=p.q.dtype)
    part.lq = [sum(s.stop - s.start for s in q_parts)]
    part.lk = [sum(s.stop - s.start for s in k_parts)]
    part.cu_q, part.cu_k = _cu(part.lq), _cu(part.lk)
    part.q = torch.cat([p.q[s] for s in q_parts]).contiguous()
    part.grad_out = torch.cat([p.grad_out[s] for s in q_parts]).contiguous()
    part.grad_lse = torch.cat([p.grad_lse[:, s] for s in q_parts], dim=1).contiguous()
    part.k = torch.cat([p.k[s] for s in k_parts]).contiguous()
    part.v = torch.cat([p.v[s] for s in k_parts]).contiguous()
    part.scale = p.scale
    return _fwd_bwd(part, True)


def _group_sum(p: Grouped, impl, causal, cast=lambda t: t):
    """dk, dv of every key row as the sum over each sequence that sees it of that sequence computed alone with
    plain attention over its concatenated keys (the prefix's own queries first, then its readers in order)."""
    dk, dv = torch.zeros_like(cast(p.k)), torch.zeros_like(cast(p.v))
    for b, a in enumerate(p.prefix):
        qs, ks = p.rows(b)
        parts = [ks] if a < 0 else [p.rows(a)[1], ks]
        sub = Packed([], [], hq=p.q.shape[1], hkv=p.k.shape[1], d=p.d, dtype=p.q.dtype)
        sub.lq, sub.lk = [qs.stop - qs.start], [sum(s.stop - s.start for s in parts)]
        sub.cu_q, sub.cu_k = _cu(sub.lq), _cu(sub.lk)
        q, go = cast(p.q[qs].contiguous()), cast(p.grad_out[qs].contiguous())
        k, v = cast(torch.cat([p.k[s] for s in parts])), cast(torch.cat([p.v[s] for s in parts]))
        out, lse = fwd(impl, q, k, v, *sub.args(), causal, p.scale)
        gl = p.grad_lse[:, qs].contiguous().to(lse.dtype)
        _, gk, gv = bwd(impl, go, q, k, v, out, lse, gl, *sub.args(), causal, p.scale)
        start = 0
        for s in parts:
            n = s.stop - s.start
            dk[s] += gk[start : start + n]
            dv[s] += gv[start : start + n]
            start += n
    return dk, dv


@interp
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "dtype, layout, d",
    [
        (torch.float32, LAYOUT_FP32, 16),
        (torch.float16, LAYOUT_FP16, 32),
    ],
)
def test_prefix_dk_dv_are_the_sum_over_the_group(dtype, layout, d, causal):
    """dk / dv of a prompt's keys: its own queries' contributions plus every response's, within the contract of
    the fp64 sum of the per-sequence computations, and close to the same sum of Triton's plain attention."""
    p = Grouped(layout, d=d, dtype=dtype, seed=104)
    got = _prefix_fwd_bwd(tk, p, causal)
    want64 = _group_sum(p, ref, causal, cast=lambda t: t.double())
    e = contract.entry("prefix_attention", dtype)
    for name, g, w in (("dk", got[3], want64[0]), ("dv", got[4], want64[1])):
        dev = contract.compare_grad(e, name, g, w, 0.0)
        assert dev.ok, f"{name}: worst {dev.worst:.3g} > allowed {dev.allowed:.3g}"
    want = _group_sum(p, tk, causal, cast=lambda t: t.float())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[3].float(), want[0], **tol)
    torch.testing.assert_close(got[4].float(), want[1], **tol)


@interp
def test_prefix_without_prefixes_is_attention_bitwise():
    """HAS_PREFIX with every prefix_index -1 runs the plain kernels' arithmetic: the same bits, gradients too."""
    p = Grouped([(x, y, -1) for x, y in zip(*LENGTHS_FP32)], d=16, dtype=torch.float32, seed=105)
    got = _prefix_fwd_bwd(tk, p, True)
    want = _fwd_bwd(p, True)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"{name} differs"


def _embed_group(group: list, others: list, position: int) -> list:
    """``others`` (a layout) with ``group`` (a layout whose prefix_index counts from the group's first sequence)
    inserted before sequence ``position`` of it, every prefix index renumbered."""

    def renumber(layout, at, by):  # indices >= at move by `by`
        return [(lq, lk, a + by if a >= at else a) for lq, lk, a in layout]

    moved = renumber(others, position, len(group))
    return moved[:position] + renumber(group, 0, position) + moved[position:]


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefix_group_alone_equals_group_packed_first_middle_last(dtype):
    """A group's out, lse and gradients (dq, and dk / dv of its keys) are bitwise the same alone and packed with
    other groups and sequences (garbage of another scale) before and after it."""
    d = 16
    group = (
        [(29, 29, -1), (17, 17, 0), (0, 0, 0), (40, 40, 0)]
        if dtype == torch.float32
        else [(70, 70, -1), (60, 60, 0), (9, 9, 0)]
    )
    others = [(21, 50, -1), (5, 5, -1), (13, 13, 1), (40, 13, -1), (8, 8, 3)]
    alone_p = Grouped(group, d=d, dtype=dtype, seed=106)
    alone = _prefix_fwd_bwd(tk, alone_p, True)
    garbage = Grouped(others, d=d, dtype=dtype, seed=107, scale=30.0)
    for position in (0, 2, 5):
        layout = _embed_group(group, others, position)
        packed = Grouped(layout, d=d, dtype=dtype)
        q0, k0 = sum(x[0] for x in others[:position]), sum(x[1] for x in others[:position])
        nq, nk = sum(x[0] for x in group), sum(x[1] for x in group)
        gq0, gk0 = int(garbage.cu_q[position]), int(garbage.cu_k[position])
        for name in ("q", "grad_out"):
            src, g = getattr(alone_p, name), getattr(garbage, name)
            setattr(packed, name, torch.cat([g[:gq0], src, g[gq0:]]))
        for name in ("k", "v"):
            src, g = getattr(alone_p, name), getattr(garbage, name)
            setattr(packed, name, torch.cat([g[:gk0], src, g[gk0:]]))
        packed.grad_lse = torch.cat([garbage.grad_lse[:, :gq0], alone_p.grad_lse, garbage.grad_lse[:, gq0:]], dim=1)
        packed.scale = alone_p.scale
        got = _prefix_fwd_bwd(tk, packed, True)
        qs, ks = slice(q0, q0 + nq), slice(k0, k0 + nk)
        pairs = (
            ("out", got[0][qs], alone[0]),
            ("lse", got[1][:, qs], alone[1]),
            ("dq", got[2][qs], alone[2]),
            ("dk", got[3][ks], alone[3]),
            ("dv", got[4][ks], alone[4]),
        )
        for name, a, b in pairs:
            assert torch.equal(a, b), f"{name} differs with the group at position {position}"


@interp
def test_prefix_backward_is_deterministic():
    p = Grouped(LAYOUT_FP32, d=16, dtype=torch.float32, seed=108)
    first, second = _prefix_fwd_bwd(tk, p, True), _prefix_fwd_bwd(tk, p, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_readers_csr():
    """The readers of sequence a are order[ends[a]:ends[a + 1]], ascending; built without a host sync."""
    prefix = torch.tensor([-1, 0, 0, -1, 3, 0, -1, -1, 6], dtype=torch.int32, device=DEVICE)
    order, ends = tk._readers(prefix)
    assert order.dtype == ends.dtype == torch.int32 and ends.shape == (10,)
    readers = [order[int(ends[a]) : int(ends[a + 1])].tolist() for a in range(9)]
    assert readers == [[1, 2, 5], [], [], [4], [], [], [8], [], []]
    order, ends = tk._readers(torch.zeros(0, dtype=torch.int32, device=DEVICE))
    assert order.shape == (0,) and ends.tolist() == [0]


@interp
def test_prefix_negative_control_unaligned_key_blocks_differ():
    """The bitwise promise is not free: the same response rows computed with key blocks NOT aligned to logical key
    0 (plain attention over the prompt's keys, unmasked, and over the response's own keys, causal, merged by their
    LSE) agree in value but not in bits, so the bitwise tests above do test the block alignment."""
    p = Grouped([(37, 37, -1), (23, 23, 0), (40, 40, 0)], d=16, dtype=torch.float32, seed=109)
    got = _prefix_fwd_bwd(tk, p, True)
    differs = []
    for b in (1, 2):
        qs, ks = p.rows(b)
        q = p.q[qs].contiguous()
        n = q.shape[0]
        kp, vp = p.k[p.rows(0)[1]].contiguous(), p.v[p.rows(0)[1]].contiguous()
        kr, vr = p.k[ks].contiguous(), p.v[ks].contiguous()
        o_p, l_p = fwd(tk, q, kp, vp, _cu([n]), _cu([37]), n, 37, False, p.scale)
        o_r, l_r = fwd(tk, q, kr, vr, _cu([n]), _cu([n]), n, n, True, p.scale)
        lse = torch.logaddexp(l_p, l_r)
        out = (torch.exp(l_p - lse).T[:, :, None] * o_p + torch.exp(l_r - lse).T[:, :, None] * o_r).to(q.dtype)
        torch.testing.assert_close(out, got[0][qs], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, got[1][:, qs], rtol=1e-5, atol=1e-5)
        differs.append(not torch.equal(out, got[0][qs]) or not torch.equal(lse, got[1][:, qs]))
    assert any(differs), "the LSE merge gave the same bits: the negative control failed"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_prefix_bf16_bitwise_and_values_at_real_lengths(d):
    """bf16, real lengths: a response's out, lse and dq equal plain attention over [prompt; response] keys (and
    the full sequence), bit for bit; values under the contract against the fp64 reference."""
    layout = [
        (1000, 1000, -1),
        (777, 777, 0),
        (1, 1, 0),
        (0, 0, 0),
        (2048, 2048, 0),
        (300, 900, -1),
        (517, 517, -1),
        (64, 64, 6),
        (1000, 1000, 6),
    ]
    p = Grouped(layout, hq=8, hkv=2, d=d, dtype=torch.bfloat16, seed=110)
    got = _prefix_fwd_bwd(tk, p, True)
    for b, a in enumerate(p.prefix):
        qs, ks = p.rows(b)
        if a < 0 or qs.stop == qs.start:
            continue
        for want in (_alone(p, qs, [p.rows(a)[1], ks]), _alone_full(p, [p.rows(a)[0], qs], [p.rows(a)[1], ks])):
            n = qs.stop - qs.start
            assert torch.equal(got[0][qs], want[0][-n:]), f"out differs: sequence {b}"
            assert torch.equal(got[1][:, qs], want[1][:, -n:]), f"lse differs: sequence {b}"
            assert torch.equal(got[2][qs], want[2][-n:]), f"dq differs: sequence {b}"
    want = _prefix_fwd_bwd(ref, p, True, cast=lambda t: t.double())
    print(check_values(p, got, want, torch.bfloat16, op="prefix_attention", scale=logical_out_scale(p)))
    again = _prefix_fwd_bwd(tk, p, True)
    assert all(torch.equal(x, y) for x, y in zip(got, again))
