"""Triton ``sample_fwd`` against the reference primitive, bitwise (tokens and logprobs), at small shapes around the
kernel's chunk size, for every filter path the kernel compiles (plain, top-k, top-p, min-p, greedy), for
adversarial rows (ties, -inf logits, one dominant token) and for the radix selects' hard cases (keys sharing their
upper bytes with ties across a digit's boundary, negative keys and signed zeros, k = 1 and k = V - 1, tiny top_p and
top_p just below 1), each top-p select over the candidate list, over the whole row (no list: too many candidates)
and after a list that falls short of the target. On a machine without CUDA the kernel runs under
``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from rlk.reference import sampling as ref
from rlk_triton import sampling as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (inv_temperature, top_k, top_p, min_p, greedy)
MODES = [
    (1.0, 0, 1.0, 0.0, False),
    (1.25, 3, 1.0, 0.0, False),
    (1.0, 0, 0.75, 0.0, False),
    (0.5, 0, 1.0, 0.2, False),
    (2.0, 17, 0.9, 0.01, False),
    (1.0, 0, 1.0, 0.0, True),
]


def _run(fn, x, seed, step, mode):
    tokens = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    logprob = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    fn(x, seed, step, *mode, tokens, logprob)
    return tokens, logprob


@pytest.mark.parametrize("mode", MODES, ids=["plain", "top_k", "top_p", "min_p", "all", "greedy"])
@pytest.mark.parametrize("vocab", [1, 3, tk.BLOCK - 1, tk.BLOCK, tk.BLOCK + 1, 2500])
def test_kernel_matches_reference(mode, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(4, vocab, generator=g) * 2).to(DEVICE)
    seed = torch.tensor([0, 99, -3, 2**50], dtype=torch.int64, device=DEVICE)
    step = torch.tensor([0, 1, 2**40, -7], dtype=torch.int64, device=DEVICE)
    a = _run(ref.sample_fwd, x, seed, step, mode)
    b = _run(tk.sample_fwd, x, seed, step, mode)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_adversarial_rows():
    vocab = 1500
    x = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1))
    x[0] = 1.0  # all tied
    x[1, 700:] = float("-inf")  # masked tokens
    x[2, 1234] = 60.0  # one dominant token
    x[3] = torch.round(x[3])  # many ties at each value (top-k / top-p thresholds on ties)
    x[4, ::2] = -0.0  # signed zeros
    x[4, 1::2] = 0.0
    x = x.to(DEVICE)
    seed = torch.arange(5, dtype=torch.int64, device=DEVICE)
    step = torch.arange(5, dtype=torch.int64, device=DEVICE) * 1000
    for mode in MODES + [(1.0, 1, 1.0, 0.0, False), (1.0, 2, 0.3, 0.0, False), (1.0, 0, 1e-6, 0.0, False)]:
        a = _run(ref.sample_fwd, x, seed, step, mode)
        b = _run(tk.sample_fwd, x, seed, step, mode)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), mode
    assert (a[0][1] < 700).item()


def test_fp16_and_strided_rows():
    x = torch.randn(3, 2 * 800, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)[:, :800]
    seed = torch.tensor([5, 6, 7], dtype=torch.int64, device=DEVICE)
    step = torch.tensor([1, 2, 3], dtype=torch.int64, device=DEVICE)
    for mode in MODES:
        a = _run(ref.sample_fwd, x, seed, step, mode)
        b = _run(tk.sample_fwd, x, seed, step, mode)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values of int32 bit patterns (given as int64, wrapped to 32 bits)."""
    return bits.to(torch.int32).view(torch.float32)


def _threshold_rows(vocab: int) -> torch.Tensor:
    """Rows whose thresholds fall on the radix selects' hard cases."""
    g = torch.Generator().manual_seed(3)
    ulps = torch.randint(0, 600, (vocab,), generator=g)
    sign = torch.randint(0, 2, (vocab,), generator=g) << 31
    rows = [
        _from_bits(0x3F800000 + ulps),  # 1 + k ulp: keys sharing their upper bytes, ties, low bytes 0x00-0x57
        -_from_bits(0x3F800000 + ulps),  # the same, negative
        _from_bits(sign | (ulps // 2)),  # +-0 and subnormals of both signs (all e = 1: flat)
        torch.where(torch.rand(vocab, generator=g) < 0.5, float("-inf"), torch.randn(vocab, generator=g)),
        torch.randn(vocab, generator=g) * 3,
    ]
    rows[4][7] = 40.0  # one dominant token
    return torch.stack(rows)


def _threshold_modes(vocab: int) -> list:
    modes = [(1.0, k, 1.0, 0.0, False) for k in (1, 2, 255, 256, 257, vocab - 1)]
    modes += [(1.0, 0, p, 0.0, False) for p in (1e-6, 0.3, 0.999, 0.99999994)]
    return modes + [
        (1.0, 256, 0.5, 0.0, False),
        (1.0, vocab - 1, 0.99999994, 0.0, False),
        (1.25, 3, 1e-6, 0.0, False),
        (1.0, 300, 0.9, 0.3, False),
    ]


@pytest.mark.parametrize(
    "list_cap,list_margin",
    [
        pytest.param(tk.LIST_CAP, tk.LIST_MARGIN, marks=pytest.mark.slow, id="list"),
        pytest.param(0, tk.LIST_MARGIN, marks=pytest.mark.slow, id="no_list"),
        pytest.param(5, tk.LIST_MARGIN, marks=pytest.mark.slow, id="small_list"),
        pytest.param(tk.LIST_CAP, 0.25, id="short_list"),
    ],
)
def test_radix_select_hard_cases(list_cap, list_margin, monkeypatch):
    """Every mode on the hard rows; the top-p select over the candidate list, over the row when the list would be
    too long (cap 0 or 5), and over the row after a list that a too small margin leaves short of the target."""
    monkeypatch.setattr(tk, "LIST_CAP", list_cap)
    monkeypatch.setattr(tk, "LIST_MARGIN", list_margin)
    vocab = 1500
    x = _threshold_rows(vocab).to(DEVICE)
    seed = torch.arange(5, dtype=torch.int64, device=DEVICE) * 7
    step = torch.arange(5, dtype=torch.int64, device=DEVICE) + 2**35
    modes = _threshold_modes(vocab)
    if (list_cap, list_margin) != (tk.LIST_CAP, tk.LIST_MARGIN):
        modes = [mode for mode in modes if mode[2] < 1.0]
    for mode in modes:
        a = _run(ref.sample_fwd, x, seed, step, mode)
        b = _run(tk.sample_fwd, x, seed, step, mode)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), mode


@pytest.mark.parametrize("vocab", [1, 2])
def test_tiny_vocabularies(vocab):
    """V = 1 and V = 2 (top_k = 1 = V - 1), with a tie and a -inf logit."""
    x = torch.tensor([[0.5, -1.0], [3.0, 3.0], [float("-inf"), 2.0]])[: vocab + 1, :vocab].to(DEVICE)
    seed = torch.tensor([1, 2, 3], dtype=torch.int64, device=DEVICE)[: x.shape[0]]
    step = torch.tensor([4, 5, 6], dtype=torch.int64, device=DEVICE)[: x.shape[0]]
    for mode in MODES + [(1.0, 1, 0.5, 0.0, False), (1.0, 1, 1e-6, 0.9, False)]:
        a = _run(ref.sample_fwd, x, seed, step, mode)
        b = _run(tk.sample_fwd, x, seed, step, mode)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), mode
