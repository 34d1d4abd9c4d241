"""rlk.distributed ops against the single-device ops, bit for bit: vocab-parallel linear_logprob, column- and
row-parallel linear, context-parallel attention, all_reduce_fixed, GradientTree and the global normalizers.

Simulated ranks (``SimulatedGroup``, P = 1, 2, 4, 8) run in this process; real ranks run as gloo processes
(``rlk.distributed.testing.run_ranks``: spawn, file store) with 2 and 4 ranks, on the reference backend and
on the Triton kernels under the CPU interpreter (fp32, small tiles so that shards cut vocab splits and K
segments at unaligned places). Every comparison is ``torch.equal``; negative controls show that the stock
way of combining shards (left-to-right sums, ``x @ w.T`` partials) does not give the single-device bits.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.distributed as dist

import rlk
from rlk import distributed as rd
from rlk.distributed import testing
from rlk.reference import matmul as ref_matmul

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

IGNORE = -100
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.triton_interpreter)]

# Small Triton tiles: vocab splits of 32 and backward chunks of 24 columns against leaves of 13 or 37 columns
# (a split longer than, or cut short by, a leaf), 16-row/column tiles against 8-column shards.
_LOGPROB_TILES = {
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
_MATMUL_TILES = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}
#: K segments of at least 8 (instead of 128), so that tiny K and N still split into 8 segments.
_MIN_LEAF = 8


def degrees(backend: str) -> tuple[int, ...]:
    """Simulated degrees per backend: all of them on the reference; 1 and 8 under the Triton interpreter (slow;
    the gloo tests run it at 2 and 4)."""
    return (1, 2, 4, 8) if backend == "reference" else (1, 8)


def small_kernels(backend: str) -> None:
    """Small tiles (Triton) and short K segments (both backends), and the matmul's tensor-parallel order, set in
    this process."""
    rlk.set_tensor_parallel_invariant(True)
    ref_matmul.MIN_LEAF = _MIN_LEAF
    if backend == "triton":
        from rlk_triton import logprob as tk_logprob
        from rlk_triton import matmul as tk_matmul

        for family, cfg in _LOGPROB_TILES.items():
            tk_logprob.TILE_CONFIGS[family][torch.float32] = dict(cfg)
        tk_matmul.TILE_CONFIGS[torch.float32] = dict(_MATMUL_TILES)
        tk_matmul.BACKWARD_TILE_CONFIGS[torch.float32] = dict(_MATMUL_TILES)
        tk_matmul.MIN_LEAF = _MIN_LEAF


@pytest.fixture
def kernels(monkeypatch, request):
    backend = request.param
    monkeypatch.setattr(ref_matmul, "MIN_LEAF", _MIN_LEAF)
    if backend == "triton":
        from rlk_triton import logprob as tk_logprob
        from rlk_triton import matmul as tk_matmul

        for family, cfg in _LOGPROB_TILES.items():
            monkeypatch.setitem(tk_logprob.TILE_CONFIGS[family], torch.float32, dict(cfg))
        monkeypatch.setitem(tk_matmul.TILE_CONFIGS, torch.float32, dict(_MATMUL_TILES))
        monkeypatch.setitem(tk_matmul.BACKWARD_TILE_CONFIGS, torch.float32, dict(_MATMUL_TILES))
        monkeypatch.setattr(tk_matmul, "MIN_LEAF", _MIN_LEAF)
    with rlk.use_backend(backend), rlk.tensor_parallel_invariant():
        yield backend


# ----------------------------------------------------------------------------------------------
# inputs and single-device truths
# ----------------------------------------------------------------------------------------------


def logprob_case(vocab: int, seed: int = 0, n: tuple[int, int] = (3, 7), h: int = 16):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*n, h, generator=g)
    weight = torch.randn(vocab, h, generator=g) / 2
    targets = torch.randint(0, vocab, n, generator=g)
    targets[0, :2] = IGNORE
    temperature = torch.rand(n[0], 1, generator=g) + 0.5
    coef = torch.randn(2, *n, generator=g)
    return hidden, weight, targets, temperature, coef


def single_logprob(hidden, weight, targets, temperature, coef):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = rlk.linear_logprob(h, w, targets, temperature=temperature, return_entropy=True)
    ((lp * coef[0]) + ent * coef[1]).sum().backward()
    return lp, ent, h.grad, w.grad


def linear_case(m: tuple[int, int], k: int, n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    grad = torch.randn(*m, n, generator=g)
    return x, w, b, grad


def single_linear(x, w, b, grad):
    x1, w1, b1 = (t.clone().requires_grad_() for t in (x, w, b))
    y = rlk.linear(x1, w1, b1)
    (y * grad).sum().backward()
    return y, x1.grad, w1.grad, b1.grad


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_()


# ----------------------------------------------------------------------------------------------
# the tree and the kernels' leaves
# ----------------------------------------------------------------------------------------------


def test_tree_sum_is_the_fixed_tree():
    """tree_sum adds (a + b) + (c + d), (a + b) + c, ...: bitwise what the formulas say, and not the left fold."""
    g = torch.Generator().manual_seed(0)
    a, b, c, d = torch.randn(4, 4096, generator=g) * torch.logspace(-8, 8, 4096)
    assert torch.equal(rd.tree_sum([a, b, c, d]), (a + b) + (c + d))
    assert torch.equal(rd.tree_sum(torch.stack([a, b, c])), (a + b) + c)
    assert torch.equal(rd.tree_sum([a]), a)
    assert not torch.equal(rd.tree_sum([a, b, c, d]), ((a + b) + c) + d)


def _shape(reduce, n: int) -> str:
    return reduce(lambda j: str(j), n, lambda x, y: f"({x}+{y})")


@pytest.mark.triton_interpreter
def test_tree_shape_is_the_same_everywhere():
    """The distributed combine, the reference kernels and the Triton kernels build one tree for every n."""
    from rlk.distributed.reduce import tree_reduce
    from rlk_triton import matmul as tk_matmul

    assert _shape(tree_reduce, 8) == "(((0+1)+(2+3))+((4+5)+(6+7)))"
    assert _shape(tree_reduce, 6) == "(((0+1)+(2+3))+(4+5))"
    for n in range(1, 17):
        assert _shape(tree_reduce, n) == _shape(ref_matmul.tree_reduce, n) == _shape(tk_matmul.tree_reduce, n)
    for size in (1, 7, 8, 12, 96, 256, 151936, 128256, 32000, 50257, 4096, 12288):
        for min_leaf in (1, 128):
            assert ref_matmul.tree_leaves(size, 8, min_leaf) == tk_matmul.tree_leaves(size, 8, min_leaf)
    assert ref_matmul.tree_leaves(151936, 8) == 8  # 8 x 18992
    assert ref_matmul.tree_leaves(50257, 8) == 1  # odd: one leaf
    assert ref_matmul.tree_leaves(4096, 8, 128) == 8
    assert ref_matmul.tree_leaves(128, 8, 128) == 1  # a head dim stays one segment
    assert ref_matmul.tree_leaves(12, 8) == 4


# ----------------------------------------------------------------------------------------------
# simulated ranks, in this process
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", BACKENDS, indirect=True)
@pytest.mark.parametrize("vocab", [8 * 13, 8 * 37])
def test_vocab_parallel_simulated(kernels, vocab):
    """P = 1, 2, 4, 8 shards give the single-device log-prob, entropy, grad_hidden and grad_weight bits."""
    case = logprob_case(vocab, n=(3, 7) if kernels == "reference" else (2, 5))
    hidden, weight, targets, temperature, coef = case
    lp, ent, gh, gw = single_logprob(*case)
    for p in degrees(kernels):
        h, shards = leaf(hidden), [leaf(s) for s in weight.chunk(p)]
        lp2, ent2 = rd.vocab_parallel_linear_logprob(
            h, shards, targets, group=rd.SimulatedGroup(p), temperature=temperature, return_entropy=True
        )
        ((lp2 * coef[0]) + ent2 * coef[1]).sum().backward()
        assert torch.equal(lp2, lp) and torch.equal(ent2, ent), p
        assert torch.equal(h.grad, gh), p
        assert torch.equal(torch.cat([s.grad for s in shards]), gw), p
    assert bool((lp[0, :2] == 0).all()) and bool((gh[0, :2] == 0).all())


@pytest.mark.parametrize("kernels", BACKENDS, indirect=True)
def test_vocab_parallel_logprob_only(kernels):
    """Without entropy, and with the gradient of the log-prob only (grad_weight not needed)."""
    hidden, weight, targets, _, coef = logprob_case(8 * 13, seed=3)
    h = leaf(hidden)
    lp = rlk.linear_logprob(h, weight, targets)
    (lp * coef[0]).sum().backward()
    h2 = leaf(hidden)
    lp2 = rd.vocab_parallel_linear_logprob(h2, list(weight.chunk(4)), targets, group=rd.SimulatedGroup(4))
    (lp2 * coef[0]).sum().backward()
    assert torch.equal(lp2, lp) and torch.equal(h2.grad, h.grad)


@pytest.mark.parametrize("kernels", BACKENDS, indirect=True)
def test_linear_simulated(kernels):
    """Column- and row-parallel linear, P = 1, 2, 4, 8: outputs and every gradient bitwise rlk.linear's."""
    x, w, b, grad = linear_case((2, 5), 64, 64)
    y, gx, gw, gb = single_linear(x, w, b, grad)
    for p in degrees(kernels):
        group = rd.SimulatedGroup(p)
        x1, ws, bs = leaf(x), [leaf(s) for s in w.chunk(p)], [leaf(s) for s in b.chunk(p)]
        y1 = rd.column_parallel_linear(x1, ws, bs, group=group, gather_output=True)
        (y1 * grad).sum().backward()
        assert torch.equal(y1, y) and torch.equal(x1.grad, gx), p
        assert torch.equal(torch.cat([s.grad for s in ws]), gw) and torch.equal(torch.cat([s.grad for s in bs]), gb)

        x2, ws2 = leaf(x), [leaf(s) for s in w.chunk(p)]
        outs = rd.column_parallel_linear(x2, ws2, group=group)
        assert isinstance(outs, list) and len(outs) == p
        assert torch.equal(torch.cat(outs, dim=-1), rlk.linear(x, w))

        xs, wr, b3 = [leaf(s) for s in x.chunk(p, dim=-1)], [leaf(s) for s in w.chunk(p, dim=1)], leaf(b)
        y3 = rd.row_parallel_linear(xs, wr, b3, group=group)
        (y3 * grad).sum().backward()
        assert torch.equal(y3, y), p
        assert torch.equal(torch.cat([s.grad for s in xs], dim=-1), gx), p
        assert torch.equal(torch.cat([s.grad for s in wr], dim=1), gw) and torch.equal(b3.grad, gb), p


def test_row_parallel_negative_controls(monkeypatch):
    """The stock ways to combine row-parallel shards give other bits than the single-device tree: each rank's
    rlk.linear (the tree of its own K) summed left to right, and stock ``x @ w.T`` partials."""
    monkeypatch.setattr(ref_matmul, "MIN_LEAF", _MIN_LEAF)
    x, w, b, _ = linear_case((3, 5), 256, 48, seed=5)
    with rlk.use_backend("reference"), rlk.tensor_parallel_invariant():
        y = rlk.linear(x, w)
        xs, ws = x.chunk(4, dim=-1), w.chunk(4, dim=1)
        own = [rlk.linear(xi, wi) for xi, wi in zip(xs, ws)]
        assert not torch.equal(((own[0] + own[1]) + own[2]) + own[3], y)
        stock = [xi @ wi.T for xi, wi in zip(xs, ws)]
        assert not torch.equal(rd.tree_sum(stock), y)
        assert torch.equal(rd.row_parallel_linear(list(xs), list(ws), group=rd.SimulatedGroup(4)), y)


def test_argument_errors_name_the_argument():
    hidden, weight, targets, _, _ = logprob_case(8 * 13)
    group = rd.SimulatedGroup(4)
    with pytest.raises(TypeError, match="weight_shard: with SimulatedGroup"):
        rd.vocab_parallel_linear_logprob(hidden, weight, targets, group=group)
    with pytest.raises(ValueError, match=r"weight_shard\[1\]: expected shape"):
        rd.vocab_parallel_linear_logprob(
            hidden, [weight[:26], weight[:25], weight[:26], weight[:26]], targets, group=group
        )
    with pytest.raises(ValueError, match="group: a vocab-parallel degree of 3"):
        rd.vocab_parallel_linear_logprob(
            hidden, list(weight[:96].chunk(3)), targets.clamp(max=95), group=rd.SimulatedGroup(3)
        )
    with pytest.raises(ValueError, match="targets: values must lie in"):
        rd.vocab_parallel_linear_logprob(hidden, list(weight.chunk(4)), targets + 200, group=group)
    with pytest.raises(TypeError, match="return_entropy: expected a bool"):
        rd.vocab_parallel_linear_logprob(hidden, list(weight.chunk(4)), targets, group=group, return_entropy=1)
    x, w, b, _ = linear_case((2,), 24, 16)
    with pytest.raises(ValueError, match="x_shard: the K sum over 24"):  # 24 < 2 x 128: one segment, P = 8 won't do
        with rlk.use_backend("reference"), rlk.tensor_parallel_invariant():
            rd.row_parallel_linear(list(x.chunk(8, dim=-1)), list(w.chunk(8, dim=1)), group=rd.SimulatedGroup(8))
    assert not rlk.is_tensor_parallel_invariant()  # the default, restored after the block
    x2, w2, _, _ = linear_case((2,), 256, 16)
    for call in (
        lambda: rd.row_parallel_linear(list(x2.chunk(2, dim=-1)), list(w2.chunk(2, dim=1)), group=rd.SimulatedGroup(2)),
        lambda: rd.column_parallel_linear(x2, list(w2.chunk(2)), group=rd.SimulatedGroup(2)),
    ):
        with pytest.raises(RuntimeError, match=r"order, which is off: call rlk.set_tensor_parallel_invariant\(True\)"):
            with rlk.use_backend("reference"):
                call()
    with pytest.raises(TypeError, match="enabled: expected a bool"):
        rlk.set_tensor_parallel_invariant(1)
    with pytest.raises(ValueError, match=r"bias_shard\[0\]: expected shape \(8,\)"):
        rd.column_parallel_linear(x, list(w.chunk(2)), [b, b], group=rd.SimulatedGroup(2))
    with pytest.raises(TypeError, match="group: expected a torch.distributed ProcessGroup"):
        rd.column_parallel_linear(x, w, group=2)
    with pytest.raises(ValueError, match="size: expected an int >= 1"):
        rd.SimulatedGroup(0)
    with pytest.raises(TypeError, match="group: GradientTree runs on a real process group"):
        rd.GradientTree(4, group)
    tree = rd.GradientTree(4)
    tree.add(1, [torch.ones(2)])
    with pytest.raises(ValueError, match="index: micro-batch 1 was added already"):
        tree.add(1, [torch.ones(2)])
    with pytest.raises(ValueError, match="grads: expected the shapes"):
        tree.add(2, [torch.ones(3)])
    with pytest.raises(ValueError, match="micro-batch 0 was added on no rank"):
        tree.reduce()


def test_single_process_group_none_is_one_rank():
    """Without torch.distributed initialized, group=None is one rank: the single-device bits, and GradientTree
    finishes the tree locally in any order of add()."""
    case = logprob_case(8 * 13, seed=4)
    hidden, weight, targets, temperature, _ = case
    with rlk.use_backend("reference"):
        lp = rlk.linear_logprob(hidden, weight, targets, temperature=temperature)
        assert torch.equal(
            rd.vocab_parallel_linear_logprob(hidden, weight, targets, group=None, temperature=temperature), lp
        )
    grads = [torch.randn(3, 5, generator=torch.Generator().manual_seed(i)) * 10.0**i for i in range(6)]
    tree = rd.GradientTree(6)
    for i in (4, 1, 5, 0, 3, 2):
        tree.add(i, [grads[i], None])
    total, none = tree.reduce()
    assert none is None
    assert torch.equal(total, rd.tree_sum(grads))
    assert torch.equal(total, ((grads[0] + grads[1]) + (grads[2] + grads[3])) + (grads[4] + grads[5]))
    assert not torch.equal(total, sum(grads[1:], grads[0]))  # the left fold autograd's accumulation would give


# ----------------------------------------------------------------------------------------------
# real ranks: gloo processes
# ----------------------------------------------------------------------------------------------


def _ops_worker(rank: int, world: int) -> None:
    for backend in ("reference", "triton"):
        small_kernels(backend)
        with rlk.use_backend(backend):
            _check_logprob(rank, world)
            _check_linear(rank, world)
    small_kernels("triton")
    with rlk.use_backend("triton"):
        _check_context_parallel(rank, world)
    _check_reductions(rank, world)


def _check_logprob(rank, world):
    for vocab in (8 * 13, 8 * 37):
        case = logprob_case(vocab, seed=vocab)
        hidden, weight, targets, temperature, coef = case
        lp, ent, gh, gw = single_logprob(*case)
        h, shard = leaf(hidden), leaf(weight.chunk(world)[rank])
        lp2, ent2 = rd.vocab_parallel_linear_logprob(
            h, shard, targets, group=None, temperature=temperature, return_entropy=True
        )
        ((lp2 * coef[0]) + ent2 * coef[1]).sum().backward()
        assert torch.equal(lp2, lp) and torch.equal(ent2, ent), (rank, vocab)
        assert torch.equal(h.grad, gh), (rank, vocab)
        assert torch.equal(shard.grad, gw.chunk(world)[rank]), (rank, vocab)


def _check_linear(rank, world):
    x, w, b, grad = linear_case((3, 5), 64, 64)
    y, gx, gw, gb = single_linear(x, w, b, grad)
    x1, w1, b1 = leaf(x), leaf(w.chunk(world)[rank]), leaf(b.chunk(world)[rank])
    y1 = rd.column_parallel_linear(x1, w1, b1, group=None, gather_output=True)
    (y1 * grad).sum().backward()
    assert torch.equal(y1, y) and torch.equal(x1.grad, gx)
    assert torch.equal(w1.grad, gw.chunk(world)[rank]) and torch.equal(b1.grad, gb.chunk(world)[rank])
    y_local = rd.column_parallel_linear(x, w.chunk(world)[rank], group=None)
    assert torch.equal(y_local, rlk.linear(x, w).chunk(world, dim=-1)[rank])
    x2, w2, b2 = leaf(x.chunk(world, dim=-1)[rank]), leaf(w.chunk(world, dim=1)[rank]), leaf(b)
    y2 = rd.row_parallel_linear(x2, w2, b2, group=None)
    (y2 * grad).sum().backward()
    assert torch.equal(y2, y)
    assert torch.equal(x2.grad, gx.chunk(world, dim=-1)[rank]) and torch.equal(w2.grad, gw.chunk(world, dim=1)[rank])
    assert torch.equal(b2.grad, gb)


def _check_context_parallel(rank, world):
    """Each sequence cut into ``world`` contiguous chunks (of unequal lengths, some empty): a query's output, LSE
    and dq are the single-device bits; dk / dv are deterministic sums over ranks (not compared bitwise)."""
    g = torch.Generator().manual_seed(7)
    lengths = [13, 1, 22, 9]
    n_heads, n_kv, dim = 4, 2, 16
    total = sum(lengths)
    q, k, v = torch.randn(total, n_heads, dim, generator=g), *torch.randn(2, total, n_kv, dim, generator=g)
    grad_out, grad_lse = torch.randn(total, n_heads, dim, generator=g), torch.randn(n_heads, total, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q1, k1, v1 = leaf(q), leaf(k), leaf(v)
    out, lse = rlk.attention(
        q1,
        k1,
        v1,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_k=max(lengths),
        return_lse=True,
    )
    ((out * grad_out).sum() + (lse * grad_lse).sum()).backward()
    rows, local = [], [0]
    for b, n in enumerate(lengths):
        lo, hi = n * rank // world, n * (rank + 1) // world
        rows.append(torch.arange(int(cu[b]) + lo, int(cu[b]) + hi))
        local.append(local[-1] + hi - lo)
    rows = torch.cat(rows)
    q2, k2, v2 = leaf(q[rows]), leaf(k[rows]), leaf(v[rows])
    out2, lse2 = rd.context_parallel_attention(
        q2, k2, v2, cu_seqlens=torch.tensor(local, dtype=torch.int32), group=None, return_lse=True
    )
    ((out2 * grad_out[rows]).sum() + (lse2 * grad_lse[:, rows]).sum()).backward()
    assert torch.equal(out2, out[rows]) and torch.equal(lse2, lse[:, rows]), rank
    assert torch.equal(q2.grad, q1.grad[rows]), rank
    torch.testing.assert_close(k2.grad, k1.grad[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v2.grad, v1.grad[rows], rtol=1e-5, atol=1e-5)
    again = [leaf(q[rows]), leaf(k[rows]), leaf(v[rows])]
    out3 = rd.context_parallel_attention(*again, cu_seqlens=torch.tensor(local, dtype=torch.int32), group=None)
    (out3 * grad_out[rows]).sum().backward()
    out4 = rd.context_parallel_attention(
        q2.detach(),
        k2.detach(),
        v2.detach(),
        cu_seqlens=torch.tensor(local, dtype=torch.int32),
        group=None,
        causal=False,
    )
    full = rlk.attention(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths), causal=False
    )
    assert torch.equal(out4, full[rows])


def _check_reductions(rank, world):
    g = torch.Generator().manual_seed(11)
    parts = torch.randn(world, 37, 5, generator=g) * torch.logspace(-6, 6, 5)
    for dtype in (torch.float32, torch.bfloat16):
        mine = parts[rank].to(dtype, copy=True)
        assert rd.all_reduce_fixed(mine) is mine
        assert torch.equal(mine, rd.tree_sum(parts.to(dtype)))

    n = 8
    grads = [[torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) * 4.0**i, None] for i in range(n)]
    truth = rd.tree_sum([gr[0] for gr in grads])
    per = n // world
    splits = {"aligned": [i * per for i in range(world + 1)], "uneven": [0, 3, 8] if world == 2 else [0, 1, 4, 6, 8]}
    for name, bounds in splits.items():
        tree = rd.GradientTree(n)
        for i in reversed(range(bounds[rank], bounds[rank + 1])):
            tree.add(i, grads[i])
        total, none = tree.reduce()
        assert none is None and torch.equal(total, truth), (name, rank)
    # the stock way: autograd-style accumulation in arrival order, then torch.distributed.all_reduce
    stock = sum((grads[i][0] for i in range(per * rank + 1, per * (rank + 1))), grads[per * rank][0].clone())
    dist.all_reduce(stock)
    assert not torch.equal(stock, truth)

    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[0, : rank + 1] = True
    mask[2, 2] = rank == 0
    norms = rd.global_normalizers([mask, mask[:1]])
    tokens = sum(2 * (r + 1) + (r == 0) for r in range(world))
    seqs = sum(2 + (r == 0) for r in range(world))
    assert norms["global_tokens"].item() == tokens and norms["global_seqs"].item() == seqs
    assert norms["global_tokens"].dtype == torch.float32 and norms["global_tokens"].shape == ()
    # context parallelism: ranks 0 and 1 hold halves of the same 2 sequences; row 1 is masked only on rank 1
    if world == 2:
        cp = torch.zeros(2, 4, dtype=torch.bool)
        cp[0, rank] = True
        cp[1, 3] = rank == 1
        assert sorted(rd.sequence_token_counts(cp, dist.group.WORLD).tolist()) == [1, 2]
        norms = rd.global_normalizers(cp, group=dist.new_group([rank]), sequence_group=dist.group.WORLD)
        assert norms["global_tokens"].item() == 3 and norms["global_seqs"].item() == 2


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ops_on_gloo_ranks(world):
    """Every op above on ``world`` gloo processes, reference and Triton: the single-device bits on every rank."""
    testing.run_ranks(_ops_worker, world)
