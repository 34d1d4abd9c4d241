"""Forward benchmarks of the batch-invariant GEMM ``rlk.ops.matmul.linear`` / ``rlk.ops.matmul.matmul`` against cuBLAS.

Implementations (the ``impl`` parameter):

* ``rlk``: the public op on the backend rlk selects for the inputs (``rlk.explain`` names it;
  ``RLK_BACKEND=<name>`` pins one);
* ``cublas``: ``torch.mm`` on the same operands (cuBLAS on a GPU), which is not batch-invariant.

The option ``layout`` says how ``b`` is stored: ``linear`` is ``x @ weight.T`` with the weight
``[N, K]`` read in place (``rlk.ops.matmul.linear``; ``torch.mm(x, weight.t())``), ``row_major`` a
contiguous ``[K, N]`` ``b`` (``rlk.ops.matmul.matmul``; ``torch.mm(x, b)``).

Shapes ``(M, N, K)``: ``M`` in 1, 16, 64, 256, 1024, 4096, 16384 at N = K = 4096 and at the
Qwen3-8B MLP shapes (gate/up: N = 12288, K = 4096; down: N = 4096, K = 12288), bf16.

One step is the forward only (``out = x @ b``). Reported as ``track_`` benchmarks:

* ``track_ms``: median milliseconds (see ``common.median_ms``);
* ``track_tflops``: ``2 * M * N * K`` FLOPs credited per step over the time, for every impl.
  At small ``M`` the GEMM is bound by reading ``b`` (``2 * N * K`` bytes), so the rate there is
  far below the matmul ceiling for every impl; compare the ``time x`` column.

Quick mode (``RLK_BENCH_QUICK=1``, or no GPU): tiny float32 shapes, so CI proves the suite runs.
"""

from __future__ import annotations

import torch

import rlk
from rlk.ops.matmul import linear, matmul

from .common import DEVICE, QUICK, SEED, CaseBase, _CaseSetup

DTYPE = torch.float32 if QUICK else torch.bfloat16
IMPLS = ["rlk", "cublas"]
LAYOUTS = ["linear", "row_major"]
M_VALUES = (1, 16, 64, 256, 1024, 4096, 16384)
# (M, N, K)
SHAPES = (
    [(1, 96, 80), (64, 96, 80)]
    if QUICK
    else [(m, n, k) for n, k in ((4096, 4096), (12288, 4096), (4096, 12288)) for m in M_VALUES]
)


class MatmulCase(CaseBase):
    """``x[M, K] @ b[K, N]`` forward, ``b`` in the layout of the option."""

    def __init__(self, op: str, impl: str, layout: str, shape: tuple[int, int, int]):
        gen = torch.Generator(DEVICE).manual_seed(SEED)
        m, n, k = shape
        self.x = torch.randn(m, k, generator=gen, device=DEVICE, dtype=DTYPE)
        weight = torch.randn(n, k, generator=gen, device=DEVICE, dtype=DTYPE) * k**-0.5
        if layout == "linear":
            self.weight, self.b = weight, weight.t()
        elif layout == "row_major":
            self.weight, self.b = None, weight.t().contiguous()
        else:
            raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
        self.work, self.unit = 2 * m * n * k, "TFLOP/s"
        if impl == "rlk":
            self.fn = (lambda: linear(self.x, self.weight)) if layout == "linear" else (lambda: matmul(self.x, self.b))
            self.decision = rlk.explain("matmul", self.x, self.b)
        elif impl == "cublas":
            self.out = torch.empty(m, n, device=DEVICE, dtype=DTYPE)
            self.fn = lambda: torch.mm(self.x, self.b, out=self.out)
        else:
            raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
        self.step()

    def step(self) -> object:
        return self.fn()


class Matmul(_CaseSetup):
    """``rlk.matmul`` forward vs cuBLAS: ms and TFLOP/s (2MNK FLOPs per step)."""

    op, case_type, shape_names = "matmul", MatmulCase, "MNK"
    baselines = ("cublas",)
    param_names = ["impl", "layout", "shape"]
    params = [IMPLS, LAYOUTS, SHAPES]

    def track_ms(self, impl: str, layout: str, shape: tuple[int, int, int]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_tflops(self, impl: str, layout: str, shape: tuple[int, int, int]) -> float:
        return self.case.rate()

    track_tflops.unit = "TFLOP/s"
