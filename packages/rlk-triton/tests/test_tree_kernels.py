"""The Triton kernels' fixed reduction trees: vocab leaves of linear_logprob and K segments of matmul.

A vocab shard (``linear_logprob_shard_fwd`` / ``_bwd``) or a K shard (``matmul_shard_fwd``) of ``P`` ranks,
merged by the combine entry points, must give the bits of the single-device primitive on the full operands:
that is what makes ``rlk.distributed`` invariant to the parallel degree. Checked here at the kernel level, for
leaves shorter and longer than a vocab split / backward chunk and K segments that are and are not multiples of
``BLOCK_K``, on the CPU interpreter (small tiles) and, ``gpu``-marked, at Qwen3-8B shapes in bf16. The
``K``-segment tree also keeps matmul's rows batch-invariant (``torch.equal``).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import rlk
from rlk_triton import logprob as tk
from rlk_triton import matmul as tm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IGNORE = -100
NOT_HERE = -(2**62)  # a shard-local target in no shard (rlk.distributed's convention)
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

SMALL = {
    "linear_fwd": {
        "BLOCK_N": 16,
        "BLOCK_V": 16,
        "BLOCK_K": 16,
        "VOCAB_SPLIT": 32,
        "GROUP_N": 2,
        "num_warps": 4,
        "num_stages": 1,
    },
    "linear_bwd": {
        "BLOCK_N": 16,
        "BLOCK_V": 16,
        "BLOCK_K": 16,
        "VOCAB_CHUNK": 24,
        "GROUP_N": 2,
        "num_warps": 4,
        "num_stages": 1,
    },
}
SMALL_GEMM = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


@pytest.fixture
def small_tiles(monkeypatch):
    for family, cfg in SMALL.items():
        for dtype in list(tk.TILE_CONFIGS[family]):
            monkeypatch.setitem(tk.TILE_CONFIGS[family], dtype, dict(cfg))
    for dtype in list(tm.TILE_CONFIGS):
        monkeypatch.setitem(tm.TILE_CONFIGS, dtype, dict(SMALL_GEMM))
    for dtype in list(tm.BACKWARD_TILE_CONFIGS):
        monkeypatch.setitem(tm.BACKWARD_TILE_CONFIGS, dtype, dict(SMALL_GEMM))
    monkeypatch.setattr(tm, "MIN_LEAF", 8)


@pytest.fixture(autouse=True)
def _tensor_parallel_order():
    """The matmul's K tree is rlk.core.tensor_parallel's (off by default); these tests are about the tree."""
    with rlk.tensor_parallel_invariant():
        yield


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _to(*tensors, dtype=None):
    return tuple(t.to(DEVICE) if dtype is None else t.to(dtype).to(DEVICE) for t in tensors)


# ----------------------------------------------------------------------------------------------
# linear_logprob: vocab leaves
# ----------------------------------------------------------------------------------------------


def _logprob_inputs(n, v, h, dtype, seed=0):
    g = _gen(seed)
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / h**0.5
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = IGNORE
    inv_t = torch.rand(n, generator=g) + 0.5
    grads = torch.randn(2, n, generator=g)
    hidden, weight = _to(hidden, weight, dtype=dtype)
    return (hidden, weight, *_to(targets, inv_t, grads[0], grads[1]))


def _single(hidden, weight, targets, inv_t, g_lp, g_ent):
    n = hidden.shape[0]
    out = [torch.empty(n, device=DEVICE) for _ in range(3)]
    tk.linear_logprob_fwd(hidden, weight, targets, inv_t, IGNORE, *out)
    gh, gw = torch.empty_like(hidden), torch.empty_like(weight)
    tk.linear_logprob_bwd(hidden, weight, targets, inv_t, out[2], out[1], g_lp, g_ent, IGNORE, gh, gw)
    return out, gh, gw


def _sharded(p, hidden, weight, targets, inv_t, g_lp, g_ent):
    """P shards through the shard kernels and the combines, as rlk.distributed runs them."""
    n, vocab = hidden.shape[0], weight.shape[0]
    v_s = vocab // p
    leaves = tm.tree_leaves(vocab, tk.MAX_TREE_LEAVES) // p
    valid = targets != IGNORE

    def local(r):
        return torch.where(valid, targets - r * v_s, NOT_HERE)

    states = torch.empty((p, 4, n), device=DEVICE)
    for r in range(p):
        tk.linear_logprob_shard_fwd(
            hidden, weight[r * v_s : (r + 1) * v_s], local(r), inv_t, leaves, states[r, :3], states[r, 3]
        )
    z = states[:, 3].gather(0, torch.where(valid, targets // v_s, 0)[None]).squeeze(0).contiguous()
    out = [torch.empty(n, device=DEVICE) for _ in range(3)]
    tk.linear_logprob_combine_fwd(states[:, :3].contiguous(), z, targets, IGNORE, *out)
    parts = torch.empty((p, *hidden.shape), device=DEVICE)
    gw = torch.empty_like(weight)
    for r in range(p):
        tk.linear_logprob_shard_bwd(
            hidden,
            weight[r * v_s : (r + 1) * v_s],
            local(r),
            inv_t,
            out[2],
            out[1],
            g_lp,
            g_ent,
            NOT_HERE,
            leaves,
            parts[r],
            gw[r * v_s : (r + 1) * v_s],
        )
    gh = torch.empty_like(hidden)
    tk.linear_logprob_combine_bwd(parts, gh)
    return out, gh, gw


@pytest.mark.parametrize("vocab", [8 * 13, pytest.param(8 * 37, marks=pytest.mark.slow), 12])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_logprob_shards_give_the_single_device_bits(small_tiles, dtype, vocab):
    """Leaves of 13 (< one 32-column split, < one 24-column chunk), 37 (a split and a partial one; a chunk and a
    partial one) and 3 columns (V = 12: 4 leaves, so P = 1, 2, 4)."""
    inputs = _logprob_inputs(37, vocab, 24, dtype)
    out, gh, gw = _single(*inputs)
    for p in (1, 2, 4, 8):
        if tm.tree_leaves(vocab, tk.MAX_TREE_LEAVES) % p:
            continue
        out2, gh2, gw2 = _sharded(p, *inputs)
        for a, b in zip(out, out2):
            assert torch.equal(a, b), p
        assert torch.equal(gh, gh2) and torch.equal(gw, gw2), p


def test_one_leaf_when_the_tree_is_off(small_tiles, monkeypatch):
    """MAX_TREE_LEAVES = 1: one leaf, the kernels' previous split order, and other bits than the tree (so the
    benchmark's 'today' column measures what it says). V = 104: leaves of 13 columns, and one leaf of 3 splits of
    32 and a partial one (the slow-marked 8 * 37 of the shard test adds nothing here at 3x the cost)."""
    inputs = _logprob_inputs(37, 8 * 13, 24, torch.float32, seed=3)
    tree, _, _ = _single(*inputs)
    monkeypatch.setattr(tk, "MAX_TREE_LEAVES", 1)
    plain, _, _ = _single(*inputs)
    one_shard, _, _ = _sharded(1, *inputs)
    assert all(torch.equal(a, b) for a, b in zip(plain, one_shard))
    assert not torch.equal(plain[2], tree[2])


# ----------------------------------------------------------------------------------------------
# matmul: K segments
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "k", [pytest.param(256, marks=pytest.mark.slow), pytest.param(8 * 20, marks=pytest.mark.slow), 96]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_k_shards_give_the_single_device_bits(small_tiles, dtype, k):
    """Row-parallel forward (K segments of 32, 20 and 12: multiples of BLOCK_K = 16 or not, one step or several)
    and the column-parallel backward's grad_a (its K is the sharded N)."""
    g = _gen(1)
    m, n = 37, 64
    a, w, bias, grad = _to(
        torch.randn(m, k, generator=g),
        torch.randn(n, k, generator=g) / k**0.5,
        torch.randn(n, generator=g),
        torch.randn(m, n, generator=g),
        dtype=dtype,
    )
    out = torch.empty(m, n, dtype=dtype, device=DEVICE)
    tm.matmul_fwd(a, w.t(), bias, out)
    grad_a = torch.empty_like(a)
    tm.matmul_bwd(grad, a, w.t(), grad_a, None, None)
    leaves = tm.tree_leaves(k, tm.MAX_TREE_LEAVES, tm.MIN_LEAF)
    assert leaves == 8
    n_leaves = tm.tree_leaves(n, tm.MAX_TREE_LEAVES, tm.MIN_LEAF)
    for p in (1, 2, 4, 8):
        k_s, n_s = k // p, n // p
        parts = torch.empty(p, m, n, device=DEVICE)
        for r in range(p):
            tm.matmul_shard_fwd(
                a[:, r * k_s : (r + 1) * k_s].contiguous(),
                w[:, r * k_s : (r + 1) * k_s].contiguous().t(),
                leaves // p,
                parts[r],
            )
        out2 = torch.empty_like(out)
        tm.matmul_combine(parts, bias, out2)
        assert torch.equal(out2, out), p
        parts = torch.empty(p, m, k, device=DEVICE)
        for r in range(p):
            tm.matmul_shard_fwd(
                grad[:, r * n_s : (r + 1) * n_s].contiguous(), w[r * n_s : (r + 1) * n_s], n_leaves // p, parts[r]
            )
        grad_a2 = torch.empty_like(grad_a)
        tm.matmul_combine(parts, None, grad_a2)
        assert torch.equal(grad_a2, grad_a), p


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_is_one_segment_with_the_tensor_parallel_order_off(small_tiles, monkeypatch, dtype):
    """The default (rlk.core.tensor_parallel off): the bits of MAX_TREE_LEAVES = 1 (the plain K loop), forward and
    grad_a; with it on, 8 segments, and in fp32 other bits (a 16-bit output's rounding may hide the difference)."""
    g = _gen(3)
    m, k, n = 37, 8 * 20, 40
    a, w, grad = _to(
        torch.randn(m, k, generator=g),
        torch.randn(n, k, generator=g) / k**0.5,
        torch.randn(m, n, generator=g),
        dtype=dtype,
    )

    def run():
        out, grad_a = torch.empty(m, n, dtype=dtype, device=DEVICE), torch.empty_like(a)
        tm.matmul_fwd(a, w.t(), None, out)
        tm.matmul_bwd(grad, a, w.t(), grad_a, None, None)
        return out, grad_a

    tree = run()
    with rlk.tensor_parallel_invariant(False):
        off = run()
    with monkeypatch.context() as mp:
        mp.setattr(tm, "MAX_TREE_LEAVES", 1)
        one = run()
    assert torch.equal(off[0], one[0]) and torch.equal(off[1], one[1])
    assert tm._leaves(k) == 8
    with rlk.tensor_parallel_invariant(False):
        assert tm._leaves(k) == 1
    if dtype == torch.float32:
        assert not torch.equal(off[0], tree[0]) and not torch.equal(off[1], tree[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_tree_rows_are_batch_invariant(small_tiles, dtype):
    """With 8 K segments a row's output is still bitwise the same alone or anywhere in a batch."""
    g = _gen(2)
    k, n = 8 * 20, 40
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    probe = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
    alone = torch.empty(1, n, dtype=dtype, device=DEVICE)
    tm.matmul_fwd(probe, w.t(), None, alone)
    for m in (2, 17, 37):
        a = (torch.randn(m, k, generator=_gen(m)) * 100).to(dtype).to(DEVICE)
        for pos in sorted({0, m // 2, m - 1}):
            a[pos] = probe[0]
            out = torch.empty(m, n, dtype=dtype, device=DEVICE)
            tm.matmul_fwd(a, w.t(), None, out)
            assert torch.equal(out[pos : pos + 1], alone), (m, pos)


# ----------------------------------------------------------------------------------------------
# GPU: Qwen3-8B shapes, bf16
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_linear_logprob_shards_qwen3_vocab_gpu():
    """V = 151936 = 8 x 18992 (a leaf is no multiple of the 256-column tiles), H = 4096, bf16, P = 2, 4, 8."""
    inputs = _logprob_inputs(300, 151936, 4096, torch.bfloat16)
    out, gh, gw = _single(*inputs)
    for p in (2, 4, 8):
        out2, gh2, gw2 = _sharded(p, *inputs)
        assert all(torch.equal(a, b) for a, b in zip(out, out2)), p
        assert torch.equal(gh, gh2) and torch.equal(gw, gw2), p


@pytest.mark.gpu
@pytest.mark.parametrize(("k", "n"), [(4096, 4096), (12288, 4096), (4096, 12288)])
def test_matmul_k_shards_qwen3_gpu(k, n):
    """o_proj / down_proj (K = 4096 / 12288) and gate/up's grad_a (N = 12288), bf16, P = 2, 4, 8."""
    g = _gen(4)
    m = 1024
    a, w = _to(torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5, dtype=torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
    tm.matmul_fwd(a, w.t(), None, out)
    for p in (2, 4, 8):
        k_s = k // p
        parts = torch.empty(p, m, n, device=DEVICE)
        for r in range(p):
            tm.matmul_shard_fwd(
                a[:, r * k_s : (r + 1) * k_s].contiguous(),
                w[:, r * k_s : (r + 1) * k_s].contiguous().t(),
                tm.tree_leaves(k, tm.MAX_TREE_LEAVES, tm.MIN_LEAF) // p,
                parts[r],
            )
        out2 = torch.empty_like(out)
        tm.matmul_combine(parts, None, out2)
        assert torch.equal(out2, out), p
