"""Triton ``ema_fwd`` against the reference: the launch table (blocks, offsets, alignment), bitwise equality with
the reference where both evaluate the multiply-add unfused (fp32 / fp16 under the CPU interpreter), bf16 within one
bf16 ulp (the interpreter truncates fp32 -> bf16 casts), and on the GPU bitwise equality with
``torch._foreach_lerp_`` (both one fma). Small shapes: on a machine without CUDA the kernel runs under
``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import triton

from rlk.reference import ema as ref
from rlk_triton import ema as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CPU = DEVICE.type == "cpu"
SIZES = [1, 2, 4095, 4096, 4097, 13, 8193, 1]


def _lists(dtype, sizes=SIZES, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = [torch.randn(n, generator=g).to(dtype).to(DEVICE) for n in sizes]
    s = [torch.randn(n, generator=g).to(dtype).to(DEVICE) for n in sizes]
    return t, s


def test_launch_table():
    base = torch.zeros(10000, device=DEVICE)
    src = torch.zeros(10000, device=DEVICE)
    targets = [base[:4097], base[4100:4101], base[5000:5003]]
    sources = [src[:4097], src[4100:4101], src[5000:5003]]
    rows, blocks, align = tk.launch_table(targets, sources)
    assert blocks == 2 + 1 + 1
    assert rows[0] == [0, 2, 3, 4] and rows[1][:3] == [0, 4100, 5000] and rows[3][:3] == [4097, 1, 3]
    assert align == 4  # every offset a multiple of 16 bytes
    rows, _, align = tk.launch_table([base[1:5]], [src[1:5]])
    assert align == 1


#: Triton 3.6's interpreter evaluates ``tl.fma`` as a multiply and an add (each rounded), as the reference does;
#: later interpreters fuse it, as the GPU does.
_INTERPRETER_FUSES_FMA = tuple(int(p) for p in triton.__version__.split(".")[:2]) > (3, 6)


def _assert_matches(got, want, targets, sources):
    """Bitwise equal to the reference where both round the multiply and the add separately (the Triton 3.6
    interpreter, 16/32-bit floats but bf16); elsewhere (bf16's truncated casts in the interpreter, the kernel's
    fma fused on the GPU and in newer interpreters) within one ulp of the dtype, measured against the inputs."""
    dtype = got[0].dtype
    if ON_CPU and dtype != torch.bfloat16 and not _INTERPRETER_FUSES_FMA:
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        return
    eps = torch.finfo(dtype).eps
    for a, b, t, s in zip(got, want, targets, sources):
        bound = eps * torch.maximum(t.double().abs(), s.double().abs()) + 1e-30
        assert bool(((a.double() - b.double()).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decay", [0.999, 0.3])
def test_against_reference(dtype, decay):
    targets, sources = _lists(dtype)
    want = [t.clone() for t in targets]
    ref.ema_fwd(want, sources, decay)
    got = [t.clone() for t in targets]
    tk.ema_fwd(got, sources, decay)
    _assert_matches(got, want, targets, sources)


def test_unaligned_views_and_one_tensor_many_times_the_block():
    big = torch.randn(3 * tk.BLOCK + 5, device=DEVICE)
    src = torch.randn(3 * tk.BLOCK + 5, device=DEVICE)
    targets, sources = [big[1:], big[:1]], [src[1:], src[:1]]
    before = [t.clone() for t in targets]
    want = [t.clone() for t in targets]
    ref.ema_fwd(want, sources, 0.9)
    tk.ema_fwd(targets, sources, 0.9)
    _assert_matches(targets, want, before, sources)


@pytest.mark.gpu
@pytest.mark.skipif(ON_CPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_bitwise_equal_to_foreach_lerp(dtype):
    targets, sources = _lists(dtype, sizes=[1, 4097, 1 << 20, 77777, 3])
    for decay in (0.999, 0.3):
        want = [t.clone() for t in targets]
        torch._foreach_lerp_(want, sources, 1 - decay)
        got = [t.clone() for t in targets]
        tk.ema_fwd(got, sources, decay)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (dtype, decay)
