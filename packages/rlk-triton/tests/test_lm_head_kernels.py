"""The cuBLAS-tiled path of the LM-head primitives (``rlk_triton.lm_head``).

Checked against the fp64 reference under the numerical contract; bit for bit (``torch.equal``) where the design
promises it: a row alone and inside a batch of several chunks (the last one padded), forward-only and
forward + backward log-probs, the stored forward and the plain one, the gradients run to run. On a machine without
CUDA the GEMMs run on the CPU and the kernels under the Triton interpreter, with chunks of 8 rows, vocab blocks of
48 columns and kernel tiles of 16 columns (ragged tails everywhere); ``gpu``-marked cases run bf16 at larger shapes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from test_logprob_kernels import (  # noqa: E402  (the sibling test module's helpers)
    IGNORE,
    _f64,
    check_grad,
    check_stats,
    linear_inputs,
    run_fwd,
    run_linear_bwd,
)

import rlk
from rlk.reference import logprob as ref
from rlk_triton import lm_head
from rlk_triton import logprob as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

# fp16 runs under the interpreter (its GEMMs on the CPU in fp32 from the 16-bit values); bf16 on a GPU only.
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
ENTROPY_MODES = ["off", "fwd_only", "fwd_and_grad"]
# 21 rows = chunks of 8, 8 and 5 (padded); V = 100 = vocab blocks of 48, 48 and 4; kernel tiles of 16 columns
N, V, H = 21, 100, 16


@pytest.fixture
def small_chunks(monkeypatch):
    if DEVICE.type == "cpu":
        monkeypatch.setattr(lm_head, "CHUNK_ROWS", 8)
        monkeypatch.setattr(lm_head, "VOCAB_BLOCK", 48)
        monkeypatch.setattr(lm_head, "BLOCK_V", 16)
        for family in ("selected", "stored_grad"):
            for dtype in list(tk.TILE_CONFIGS[family]):
                monkeypatch.setitem(tk.TILE_CONFIGS[family], dtype, {"BLOCK_V": 16, "num_warps": 4})


@pytest.fixture
def tiled(monkeypatch):
    monkeypatch.setenv(lm_head.ENV, "tiled")


def _fwd(hidden, weight, targets, inv_t, with_entropy, logits_out=None):
    n = hidden.shape[0]
    out = {name: torch.empty(n, dtype=torch.float32, device=hidden.device) for name in ("logprob", "entropy", "lse")}
    lm_head.tiled_fwd(
        hidden,
        weight,
        targets,
        inv_t,
        IGNORE,
        out["logprob"],
        out["entropy"] if with_entropy else None,
        out["lse"],
        logits_out,
    )
    if not with_entropy:
        del out["entropy"]
    return out


def _bwd(hidden, weight, targets, inv_t, stats, grad_lp, grad_ent):
    gh, gw = torch.empty_like(hidden), torch.empty_like(weight)
    lm_head.tiled_bwd(
        hidden, weight, targets, inv_t, stats["lse"], stats.get("entropy"), grad_lp, grad_ent, IGNORE, gh, gw
    )
    return gh, gw


def _stored(hidden, weight, targets, inv_t, grad_lp, grad_ent, with_entropy, grad_weight_out=None, accumulate=False):
    """Stored forward then stored backward; returns (stats, grad_hidden, grad_weight)."""
    logits = torch.empty((hidden.shape[0], weight.shape[0]), dtype=torch.float32, device=hidden.device)
    stats = _fwd(hidden, weight, targets, inv_t, with_entropy, logits_out=logits)
    gh = torch.empty_like(hidden)
    gw = torch.empty_like(weight) if grad_weight_out is None else grad_weight_out
    lm_head.tiled_stored_bwd(
        hidden,
        weight,
        targets,
        inv_t,
        stats["lse"],
        stats.get("entropy"),
        grad_lp,
        grad_ent,
        IGNORE,
        logits,
        gh,
        gw,
        accumulate,
    )
    return stats, gh, gw


# every entropy mode on the small shapes; the multi-chunk, multi-block one (slower under the interpreter) with none
# and with the entropy's gradient
CASES = [
    *[((1, 1, 16), mode) for mode in ENTROPY_MODES],
    ((17, 7, 40), "fwd_and_grad"),
    ((N, V, H), "off"),
    ((N, V, H), "fwd_and_grad"),
]


@pytest.mark.parametrize(("shape", "entropy_mode"), CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_matches_reference(small_chunks, dtype, shape, entropy_mode):
    n, v, h = shape
    hidden, weight, targets, inv_t, grad_lp, grad_ent = linear_inputs(n, v, h, dtype, extreme=True)
    with_entropy = entropy_mode != "off"
    g_ent = grad_ent if entropy_mode == "fwd_and_grad" else None
    got = _fwd(hidden, weight, targets, inv_t, with_entropy)
    truth = run_fwd(ref, "linear_logprob", _f64(hidden, weight), targets, inv_t.double(), with_entropy)
    max_scale = check_stats("linear_logprob", dtype, got, truth, targets)
    gh, gw = _bwd(hidden, weight, targets, inv_t, got, grad_lp, g_ent)
    gh_truth, gw_truth = run_linear_bwd(
        ref,
        *_f64(hidden, weight),
        targets,
        inv_t.double(),
        truth,
        grad_lp.double(),
        None if g_ent is None else g_ent.double(),
    )
    check_grad("linear_logprob", dtype, "grad_hidden", gh, gh_truth, max_scale)
    check_grad("linear_logprob", dtype, "grad_weight", gw, gw_truth, max_scale)
    assert bool((gh[targets == IGNORE] == 0).all())
    # the stored pair: the same log-prob bits, gradients within the contract
    stats, gh_s, gw_s = _stored(hidden, weight, targets, inv_t, grad_lp, g_ent, with_entropy)
    for name, value in got.items():
        assert torch.equal(stats[name], value), name
    check_grad("linear_logprob", dtype, "grad_hidden", gh_s, gh_truth, max_scale)
    check_grad("linear_logprob", dtype, "grad_weight", gw_s, gw_truth, max_scale)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_tiled_rows_are_bitwise_invariant_to_the_batch(small_chunks, dtype):
    hidden, weight, targets, inv_t, grad_lp, grad_ent = linear_inputs(N, V, H, dtype, seed=3)
    batch = _fwd(hidden, weight, targets, inv_t, True)
    gh, _ = _bwd(hidden, weight, targets, inv_t, batch, grad_lp, grad_ent)
    _, gh_stored, _ = _stored(hidden, weight, targets, inv_t, grad_lp, grad_ent, True)
    # the first and last rows of each chunk (8, 8, 5 rows) and a row inside one
    for rows in (slice(i, i + 1) for i in (0, 3, 7, 8, 15, 16, 20)):
        args = (hidden[rows], weight, targets[rows], inv_t[rows])
        alone = _fwd(*args, True)
        for name, value in alone.items():
            assert torch.equal(value, batch[name][rows]), (name, rows)
        gh_alone, _ = _bwd(*args, alone, grad_lp[rows], grad_ent[rows])
        assert torch.equal(gh_alone, gh[rows]), rows
        _, gh_stored_alone, _ = _stored(*args, grad_lp[rows], grad_ent[rows], True)
        assert torch.equal(gh_stored_alone, gh_stored[rows]), rows
    # a window crossing chunk boundaries at another offset
    rows = slice(5, 19)
    window = _fwd(hidden[rows], weight, targets[rows], inv_t[rows], True)
    assert torch.equal(window["logprob"], batch["logprob"][rows])


def _aligned_rows(n_rows: int, vocab: int) -> torch.Tensor:
    """An fp32 ``[n_rows, V]`` buffer whose start is 256-byte aligned (whole chunks of it are used in place)."""
    raw = torch.empty(n_rows * vocab + 64, dtype=torch.float32, device=DEVICE)
    skip = (-raw.data_ptr() % 256) // 4
    return raw[skip : skip + n_rows * vocab].view(n_rows, vocab)


def test_tiled_stored_chunks_in_place_and_in_scratch_agree(small_chunks):
    """Whole chunks of an aligned logits buffer are computed in place, the rest in a scratch tile: the same bits."""
    v = 64  # 8 rows x 64 x 4 bytes: every chunk of the aligned buffer starts 256-byte aligned
    hidden, weight, targets, inv_t, grad_lp, grad_ent = linear_inputs(N, v, H, torch.float32, seed=12)
    results = []
    for logits in (_aligned_rows(N, v), torch.empty((N, v), dtype=torch.float32, device=DEVICE)[:, :]):
        stats = _fwd(hidden, weight, targets, inv_t, True, logits_out=logits)
        gh, gw = torch.empty_like(hidden), torch.empty_like(weight)
        lm_head.tiled_stored_bwd(
            hidden,
            weight,
            targets,
            inv_t,
            stats["lse"],
            stats["entropy"],
            grad_lp,
            grad_ent,
            IGNORE,
            logits,
            gh,
            gw,
            False,
        )
        results.append((stats, gh, gw))
    assert lm_head._chunk_of(_aligned_rows(N, v), 8, 8, 8) is not None
    plain = _fwd(hidden, weight, targets, inv_t, True)
    for stats, gh, gw in results:
        assert all(torch.equal(stats[k], plain[k]) for k in plain)
        assert torch.equal(gh, results[0][1]) and torch.equal(gw, results[0][2])


def test_tiled_grads_are_deterministic_and_accumulate(small_chunks):
    dtype = torch.float32
    hidden, weight, targets, inv_t, grad_lp, grad_ent = linear_inputs(N, V, H, dtype, seed=4)
    stats = _fwd(hidden, weight, targets, inv_t, True)
    first, second = (_bwd(hidden, weight, targets, inv_t, stats, grad_lp, grad_ent) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    s1, s2 = (_stored(hidden, weight, targets, inv_t, grad_lp, grad_ent, True) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(s1[1:], s2[1:], strict=True))
    # accumulate: fp32 grad_weight_out + G.T @ hidden
    base = torch.randn(weight.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    _, _, acc = _stored(hidden, weight, targets, inv_t, grad_lp, grad_ent, True, base.clone(), accumulate=True)
    torch.testing.assert_close(acc, base + s1[2], rtol=1e-5, atol=1e-5)
    # optional outputs
    gh = torch.empty_like(hidden)
    lm_head.tiled_bwd(hidden, weight, targets, inv_t, stats["lse"], None, grad_lp, None, IGNORE, gh, None)
    gw = torch.empty_like(weight)
    lm_head.tiled_bwd(hidden, weight, targets, inv_t, stats["lse"], None, grad_lp, None, IGNORE, None, gw)
    full = _bwd(hidden, weight, targets, inv_t, stats, grad_lp, None)
    assert torch.equal(gh, full[0]) and torch.equal(gw, full[1])


def test_lm_head_path(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(lm_head.ENV, raising=False)
    assert lm_head.lm_head_path(cpu, torch.float32) == "kernels"
    assert lm_head.lm_head_path(cuda, torch.bfloat16) == "kernels"  # tiled is opt-in
    monkeypatch.setenv(lm_head.ENV, "tiled")
    assert lm_head.lm_head_path(cpu, torch.float32) == "tiled"
    monkeypatch.setenv(lm_head.ENV, "kernels")
    assert lm_head.lm_head_path(cuda, torch.bfloat16) == "kernels"
    monkeypatch.setenv(lm_head.ENV, "fast")
    with pytest.raises(ValueError, match=lm_head.ENV):
        lm_head.lm_head_path(cpu, torch.float32)


def test_the_backend_serves_the_lm_head_primitives_through_the_selector():
    from rlk_triton import backend

    table = backend().primitives
    for name, fn in lm_head.PRIMITIVES.items():
        assert table[name] is fn


# ----------------------------------------------------------------------------------------------
# through the public ops (the Triton backend pinned, the tiled path chosen)
# ----------------------------------------------------------------------------------------------


def _op_inputs(dtype, b=3, t=7, v=V, h=H, seed=5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g).to(dtype).to(DEVICE)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).to(DEVICE)
    targets = torch.randint(0, v, (b, t), generator=g).to(DEVICE)
    targets[1, 2] = IGNORE
    return hidden, weight, targets


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_linear_logprob_forward_only_equals_training_bitwise(small_chunks, tiled, dtype):
    hidden, weight, targets = _op_inputs(dtype)
    temperature = torch.tensor([[0.7], [1.0], [1.3]], device=DEVICE)
    with rlk.use_backend("triton"):
        with torch.no_grad():
            lp_roll, ent_roll = rlk.linear_logprob(
                hidden, weight, targets, temperature=temperature, return_entropy=True
            )
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = rlk.linear_logprob(h, w, targets, temperature=temperature, return_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads = (h.grad.clone(), w.grad.clone())
        h.grad = w.grad = None
        lp2, ent2 = rlk.linear_logprob(h, w, targets, temperature=temperature, return_entropy=True)
        (lp2.sum() + 0.1 * ent2.sum()).backward()
        # each row alone gives its bits in the batch
        alone = rlk.linear_logprob(hidden[2:3, 4:5], weight, targets[2:3, 4:5], temperature=1.3)
    assert torch.equal(lp_roll, lp.detach()) and torch.equal(ent_roll, ent.detach())
    assert torch.equal(grads[0], h.grad) and torch.equal(grads[1], w.grad)
    assert torch.equal(alone, lp_roll[2:3, 4:5])
    assert bool((lp_roll[1, 2] == 0) & (h.grad[1, 2] == 0).all())


def test_linear_logprob_tiled_and_kernel_paths_agree_within_the_contract(small_chunks, monkeypatch):
    hidden, weight, targets = _op_inputs(torch.float32)
    with rlk.use_backend("triton"):
        monkeypatch.setenv(lm_head.ENV, "tiled")
        tiled_lp = rlk.linear_logprob(hidden, weight, targets)
        monkeypatch.setenv(lm_head.ENV, "kernels")
        kernel_lp = rlk.linear_logprob(hidden, weight, targets)
    torch.testing.assert_close(tiled_lp, kernel_lp, rtol=1e-5, atol=5e-5)


def test_policy_loss_one_pass_and_lean_give_the_rollout_log_probs(small_chunks, tiled):
    hidden, weight, targets = _op_inputs(torch.float32, b=4, t=6)
    g = torch.Generator().manual_seed(6)
    advantages = torch.randn(4, 6, generator=g).to(DEVICE)
    mask = torch.ones(4, 6, device=DEVICE)
    mask[3, 4:] = 0
    with rlk.use_backend("triton"):
        with torch.no_grad():
            old = rlk.linear_logprob(hidden, weight, torch.where(mask != 0, targets, IGNORE))
        results = {}
        for mode in ("one_pass", "lean"):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            loss, metrics = rlk.fused_linear_policy_loss(
                h, w, targets, old, advantages, mask, mode=mode, chunk_tokens=12
            )
            loss.backward()
            results[mode] = (loss.detach(), metrics, h.grad, w.grad)
    # the first micro-step's ratio is exactly 1: the one-pass log-probs are the rollout's bits
    for mode in ("one_pass", "lean"):
        assert float(results[mode][1]["ratio_max"]) == 1.0, mode
    assert torch.equal(results["one_pass"][0], results["lean"][0])
    torch.testing.assert_close(results["one_pass"][2], results["lean"][2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results["one_pass"][3], results["lean"][3], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# GPU: bf16, chunks of the real size (several, a padded tail)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tiled_gpu_matches_reference_and_rows_are_invariant(dtype):
    n, v, h = 5000, 40000, 512  # chunks of 2048: 2 whole, one padded; vocab blocks 16384, 16384, 7232
    hidden, weight, targets, inv_t, grad_lp, grad_ent = linear_inputs(n, v, h, dtype, seed=11)
    got = _fwd(hidden, weight, targets, inv_t, True)
    truth = run_fwd(ref, "linear_logprob", _f64(hidden, weight), targets, inv_t.double(), True)
    max_scale = check_stats("linear_logprob", dtype, got, truth, targets)
    gh, gw = _bwd(hidden, weight, targets, inv_t, got, grad_lp, grad_ent)
    gh_truth, gw_truth = run_linear_bwd(
        ref, *_f64(hidden, weight), targets, inv_t.double(), truth, grad_lp.double(), grad_ent.double()
    )
    check_grad("linear_logprob", dtype, "grad_hidden", gh, gh_truth, max_scale)
    check_grad("linear_logprob", dtype, "grad_weight", gw, gw_truth, max_scale)
    stats, gh_s, gw_s = _stored(hidden, weight, targets, inv_t, grad_lp, grad_ent, True)
    for name, value in got.items():
        assert torch.equal(stats[name], value), name
    check_grad("linear_logprob", dtype, "grad_hidden", gh_s, gh_truth, max_scale)
    check_grad("linear_logprob", dtype, "grad_weight", gw_s, gw_truth, max_scale)
    for rows in (slice(0, 1), slice(2047, 2049), slice(4999, 5000), slice(100, 3100)):
        args = (hidden[rows], weight, targets[rows], inv_t[rows])
        alone = _fwd(*args, True)
        for name, value in alone.items():
            assert torch.equal(value, got[name][rows]), (name, rows)
        gh_alone, _ = _bwd(*args, alone, grad_lp[rows], grad_ent[rows])
        assert torch.equal(gh_alone, gh[rows]), rows
        _, gh_s_alone, _ = _stored(*args, grad_lp[rows], grad_ent[rows], True)
        assert torch.equal(gh_s_alone, gh_s[rows]), rows
    again = _bwd(hidden, weight, targets, inv_t, got, grad_lp, grad_ent)
    assert torch.equal(again[0], gh) and torch.equal(again[1], gw)
    stored_again = _stored(hidden, weight, targets, inv_t, grad_lp, grad_ent, True)
    assert torch.equal(stored_again[1], gh_s) and torch.equal(stored_again[2], gw_s)


@pytest.mark.gpu
def test_tiled_gpu_fallback_without_the_fp32_output_gemms(monkeypatch):
    """Where torch refuses ``mm`` / ``addmm(out_dtype=float32, out=...)`` for 16-bit operands, the tiled path writes a
    fresh fp32 GEMM and copies or adds it: the same statistics bit for bit (the forward's GEMM is the same product),
    the gradients within the contract."""
    n, v, h = 2500, 20000, 256
    dtype = torch.bfloat16
    hidden, weight, targets, inv_t, grad_lp, grad_ent = linear_inputs(n, v, h, dtype, seed=12)
    assert isinstance(lm_head.accumulates_in_place(hidden.device, dtype), bool)
    fused = _fwd(hidden, weight, targets, inv_t, True)
    for gemm in ("mm", "addmm"):
        monkeypatch.setitem(lm_head._FUSED_ACCUMULATE, (gemm, str(hidden.device), dtype), False)
    assert lm_head.accumulates_in_place(hidden.device, dtype) is False
    got = _fwd(hidden, weight, targets, inv_t, True)
    for name, value in got.items():
        assert torch.equal(value, fused[name]), name
    gh, gw = _bwd(hidden, weight, targets, inv_t, got, grad_lp, grad_ent)
    truth = run_fwd(ref, "linear_logprob", _f64(hidden, weight), targets, inv_t.double(), True)
    max_scale = check_stats("linear_logprob", dtype, got, truth, targets)
    gh_truth, gw_truth = run_linear_bwd(
        ref, *_f64(hidden, weight), targets, inv_t.double(), truth, grad_lp.double(), grad_ent.double()
    )
    check_grad("linear_logprob", dtype, "grad_hidden", gh, gh_truth, max_scale)
    check_grad("linear_logprob", dtype, "grad_weight", gw, gw_truth, max_scale)
