"""Triton embedding primitives against the reference.

The forward is a gather (bitwise copy); the backward follows the reference's position-ordered fp32
sum, so it must equal the reference bit for bit in the same dtype (fp32 and fp16 under the CPU
interpreter, every dtype on the GPU: the interpreter truncates fp32 -> bf16 casts instead of
rounding), and lie within the contract of the fp64 truth. On a machine without CUDA the kernels
run under the Triton CPU interpreter (``TRITON_INTERPRET=1``, set below before triton is
imported) with small shapes; with CUDA the same tests run on the GPU, plus the ``gpu``-marked ones.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import rlk
from rlk.core import contract
from rlk.ops.embedding import embedding
from rlk.reference import embedding as ref
from rlk_triton import embedding as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CPU = DEVICE.type == "cpu"

pytestmark = [pytest.mark.triton_interpreter] if ON_CPU else []

# bf16 gradients are rounded by a cast the interpreter truncates: bf16 backward is compared on the GPU only
BWD_DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]

# Tiny tiles so that CPU-sized problems cover several hidden chunks and run walks of several steps.
SMALL_TILES = {"BLOCK_H_FWD": 16, "BLOCK_H": 32, "UNROLL": 4, "num_warps": 4}


@pytest.fixture(params=["default_tiles", "small_tiles"])
def tiles(request, monkeypatch):
    if request.param == "small_tiles":
        for dtype in list(tk.TILE_CONFIGS):
            monkeypatch.setitem(tk.TILE_CONFIGS, dtype, dict(SMALL_TILES))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def case(v, h, n, dtype, seed=0, hot_id=None, hot_count=0):
    g = _gen(seed)
    weight = torch.randn(v, h, generator=g).to(DEVICE, dtype)
    ids = torch.randint(0, v, (n,), generator=g)
    if hot_id is not None:
        ids[torch.randperm(n, generator=g)[:hot_count]] = hot_id
    grad_out = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    return weight, ids.to(DEVICE), grad_out


def fwd(module, weight, ids):
    out = torch.full((ids.shape[0], weight.shape[1]), float("nan"), dtype=weight.dtype, device=weight.device)
    module.embedding_fwd(weight, ids, out)
    return out


def bwd(module, grad_out, ids, padding_idx, vocab):
    grad_weight = torch.full((vocab, grad_out.shape[1]), float("nan"), dtype=grad_out.dtype, device=grad_out.device)
    module.embedding_bwd(grad_out, ids, padding_idx, grad_weight)
    return grad_weight


def check_against_truth(dtype, grad_weight, grad_out, ids, padding_idx):
    g = grad_out.double()
    truth = torch.zeros(grad_weight.shape, dtype=torch.float64, device=g.device).index_add_(0, ids, g)
    scale = torch.zeros_like(truth).index_add_(0, ids, g.abs())
    if padding_idx >= 0:
        truth[padding_idx] = 0
        scale[padding_idx] = 0
    e = contract.entry("embedding", dtype)
    dev = contract.compare_outputs(e, "grad_weight", grad_weight.reshape(-1), truth.reshape(-1), scale.reshape(-1))
    assert dev.ok, dev
    dev = contract.compare_grad(e, "grad_weight", grad_weight, truth, 0.0)
    assert dev.ok, dev


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1), (13, 70, 40), (300, 5, 9)], ids=lambda s: "x".join(map(str, s)))
def test_forward_is_a_bitwise_gather(tiles, dtype, shape):
    v, h, n = shape
    weight, ids, _ = case(v, h, n, dtype)
    assert torch.equal(fwd(tk, weight, ids), weight[ids])


@pytest.mark.parametrize("padding_idx", [-1, 3])
@pytest.mark.parametrize("dtype", BWD_DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 1, 1), (13, 70, 40), (300, 5, 9), (6, 33, 50)], ids=lambda s: "x".join(map(str, s))
)
def test_backward_equals_reference_bitwise(tiles, dtype, shape, padding_idx):
    v, h, n = shape
    padding_idx = min(padding_idx, v - 1)
    weight, ids, grad_out = case(v, h, n, dtype, seed=1, hot_id=min(2, v - 1), hot_count=n // 3)
    if padding_idx >= 0:
        ids[::7] = padding_idx
    got = bwd(tk, grad_out, ids, padding_idx, v)
    assert torch.equal(got, bwd(ref, grad_out, ids, padding_idx, v))
    assert torch.equal(got, bwd(tk, grad_out, ids, padding_idx, v))  # run to run
    check_against_truth(dtype, got, grad_out, ids, padding_idx)
    unused = torch.ones(v, dtype=torch.bool, device=DEVICE)
    unused[ids] = False
    assert bool((got[unused] == 0).all())
    if padding_idx >= 0:
        assert bool((got[padding_idx] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_duplicates_heavy(tiles, dtype):
    """One id 1000 times among 1100 rows, the order checked against a plain position loop."""
    v, h, n = 20, 40, 1100
    weight, ids, grad_out = case(v, h, n, dtype, seed=2, hot_id=5, hot_count=1000)
    got = bwd(tk, grad_out, ids, -1, v)
    acc = torch.zeros(h, dtype=torch.float32, device=DEVICE)
    for pos in (ids == 5).nonzero()[:, 0].tolist():
        acc = acc + grad_out[pos].float()
    assert torch.equal(got[5], acc.to(dtype))
    assert torch.equal(got, bwd(ref, grad_out, ids, -1, v))
    check_against_truth(dtype, got, grad_out, ids, -1)


def test_every_id_once_and_all_ids_equal(tiles):
    v, h = 40, 8
    g = _gen(3)
    grad_out = torch.randn(v, h, generator=g).to(DEVICE)
    perm = torch.randperm(v, generator=g).to(DEVICE)
    got = bwd(tk, grad_out, perm, -1, v)
    assert torch.equal(got[perm], grad_out)
    same = torch.full((37,), 9, device=DEVICE)
    got = bwd(tk, grad_out[:37], same, -1, v)
    assert torch.equal(got, bwd(ref, grad_out[:37], same, -1, v))
    assert bool((got[torch.arange(v, device=DEVICE) != 9] == 0).all())
    assert bool((bwd(tk, grad_out[:37], same, 9, v) == 0).all())


BATCH_SIZES = [1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_batch_invariance(dtype):
    """Forward: a row alone equals that row at the first, a middle and the last position of batches of
    many sizes. Backward: the gradient row of a probe id, whose rows sit at those positions (in that
    order), equals the probe rows' gradient computed alone, whatever the other rows."""
    v, h = 64, 48
    weight, _, _ = case(v, h, 1, dtype, seed=4)
    probe_id = 17
    probe_rows = torch.randn(3, h, generator=_gen(5)).to(DEVICE, dtype)
    alone_fwd = fwd(tk, weight, torch.tensor([probe_id], device=DEVICE))
    for n in BATCH_SIZES:
        _, ids, grad_out = case(v, h, n, dtype, seed=n)
        ids[ids == probe_id] = probe_id + 1
        positions = sorted({0, n // 2, n - 1})
        for i, pos in enumerate(positions):
            ids[pos] = probe_id
            grad_out[pos] = probe_rows[i]
        out = fwd(tk, weight, ids)
        for pos in positions:
            assert torch.equal(out[pos : pos + 1], alone_fwd), (n, pos)
        alone_bwd = bwd(tk, probe_rows[: len(positions)], torch.full((len(positions),), probe_id, device=DEVICE), -1, v)
        assert torch.equal(bwd(tk, grad_out, ids, -1, v)[probe_id], alone_bwd[probe_id]), n


def test_op_layer_on_the_triton_backend():
    """embedding pinned to Triton: forward and backward (run on the forward's backend) equal the primitives."""
    weight, ids, grad_out = case(30, 24, 26, torch.float32, seed=6, hot_id=4, hot_count=10)
    w = weight.clone().requires_grad_(True)
    with rlk.use_backend("triton"):
        assert rlk.explain("embedding", weight).backend == "triton"
        out = embedding(ids.view(2, 13).to(torch.int32), w, padding_idx=4)
        out.backward(grad_out.view(2, 13, 24))
    assert torch.equal(out.view(26, 24), fwd(tk, weight, ids))
    assert torch.equal(w.grad, bwd(tk, grad_out, ids, 4, 30))


def test_tile_configs_are_consistent():
    assert set(tk.TILE_CONFIGS) == {torch.float32, torch.float16, torch.bfloat16}
    for cfg in tk.TILE_CONFIGS.values():
        for key in ("BLOCK_H_FWD", "BLOCK_H"):
            assert cfg[key] & (cfg[key] - 1) == 0
        assert cfg["UNROLL"] >= 1


# ----------------------------------------------------------------------------------------------
# GPU only: realistic shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_qwen_vocab_bf16_gpu():
    """V = 151936, H = 4096, N = 16384 bf16 ids with heavy repetition (one id 3000 times, 200 ids ~20
    times each, the rest random; a padding id): forward bitwise, backward bitwise equal to the
    reference and within the contract, run-to-run equal, and a probe id's gradient row equal to its
    rows' gradient computed alone."""
    v, h, n = 151936, 4096, 16384
    dtype = torch.bfloat16
    g = _gen(7)
    weight = torch.randn(v, h, generator=g).to(DEVICE, dtype)
    ids = torch.randint(0, v, (n,), generator=g)
    ids[torch.randperm(n, generator=g)[:4000]] = torch.randint(0, 200, (4000,), generator=g)
    ids[torch.randperm(n, generator=g)[:3000]] = 151643
    ids[-50:] = 0
    ids = ids.to(DEVICE)
    grad_out = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    assert torch.equal(fwd(tk, weight, ids), weight[ids])
    for padding_idx in (-1, 0):
        got = bwd(tk, grad_out, ids, padding_idx, v)
        assert torch.equal(got, bwd(tk, grad_out, ids, padding_idx, v))
        assert torch.equal(got, bwd(ref, grad_out, ids, padding_idx, v))
        check_against_truth(dtype, got, grad_out, ids, padding_idx)
    probe = 151643
    rows = (ids == probe).nonzero()[:, 0]
    alone = bwd(tk, grad_out[rows], ids[rows], -1, v)
    assert torch.equal(alone[probe], got[probe])
