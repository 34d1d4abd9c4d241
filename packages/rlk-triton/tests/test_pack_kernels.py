"""Triton pack primitives against the reference: bitwise copies (every dtype, including bf16 under the CPU
interpreter: no value is converted), rows wider than a block and narrower ones, fully padded and fully valid
maps, the fill value. On a machine without CUDA the kernels run under the Triton CPU interpreter
(``TRITON_INTERPRET=1``, set below before triton is imported) with small shapes."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from rlk.reference import pack as ref
from rlk_triton import pack as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CPU = DEVICE.type == "cpu"

pytestmark = [pytest.mark.triton_interpreter] if ON_CPU else []

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64]


@pytest.fixture(params=["default_block", "small_block"])
def block(request, monkeypatch):
    if request.param == "small_block":
        monkeypatch.setattr(tk, "MAX_BLOCK", 4)  # several chunks per row
    return request.param


def _slot(valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, torch.cumsum(valid, 0) - 1, -1).to(DEVICE)


def _rows(n, f, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.randn(n, f, generator=g).to(dtype)
        if n * f:
            x.view(-1)[0] = float("nan")
            x.view(-1)[-1] = -0.0
    else:
        x = torch.randint(-(2**31), 2**31 - 1, (n, f), generator=g).to(dtype)
    return x.to(DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes (NaN payloads and -0.0 compared too)."""
    return t.view(torch.uint8) if t.numel() else t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, f, density", [(12, 1, 0.5), (9, 7, 0.7), (5, 33, 0.0), (6, 10, 1.0)])
def test_primitives_equal_the_reference_bitwise(block, dtype, n, f, density):
    g = torch.Generator().manual_seed(n * 100 + f)
    valid = torch.rand(n, generator=g) < density
    slot = _slot(valid)
    m = int(valid.sum())
    x = _rows(n, f, dtype, seed=1)
    want = x.new_empty((m, f))
    ref.pack_fwd(x, slot, want)
    got = torch.full_like(want, 0)
    if m:
        tk.pack_fwd(x, slot, got)
    assert torch.equal(_bits(got), _bits(want))

    packed = _rows(m, f, dtype, seed=2)
    for fill in (0.0, -3.0):
        want = x.new_empty((n, f))
        ref.pack_bwd(packed, slot, fill, want)
        got = torch.full_like(want, 5)
        if m:
            tk.pack_bwd(packed, slot, fill, got)
            assert torch.equal(_bits(got), _bits(want))


def test_fill_is_rounded_like_torch():
    valid = torch.tensor([True, False, True])
    slot = _slot(valid)
    packed = _rows(2, 3, torch.bfloat16, seed=3)
    out = torch.empty(3, 3, dtype=torch.bfloat16, device=DEVICE)
    tk.pack_bwd(packed, slot, 0.1, out)
    assert torch.equal(out[1], torch.full((3,), 0.1, dtype=torch.bfloat16, device=DEVICE))
