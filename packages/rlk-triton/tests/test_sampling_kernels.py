"""Triton ``sample_fwd`` against the reference primitive, bitwise (tokens and logprobs), at small shapes around the
kernel's chunk size, for every filter path the kernel compiles (plain, top-k, top-p, min-p, greedy) and for
adversarial rows (ties, -inf logits, one dominant token). On a machine without CUDA the kernel runs under
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
MODES = [(1.0, 0, 1.0, 0.0, False), (1.25, 3, 1.0, 0.0, False), (1.0, 0, 0.75, 0.0, False),
         (0.5, 0, 1.0, 0.2, False), (2.0, 17, 0.9, 0.01, False), (1.0, 0, 1.0, 0.0, True)]


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
    x[0] = 1.0                     # all tied
    x[1, 700:] = float("-inf")     # masked tokens
    x[2, 1234] = 60.0              # one dominant token
    x[3] = torch.round(x[3])       # many ties at each value (top-k / top-p thresholds on ties)
    x[4, ::2] = -0.0               # signed zeros
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
