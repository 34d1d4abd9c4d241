"""Forward + backward benchmarks of ``rlk.ops.norm.rms_norm`` (Llama / Qwen3 form) against PyTorch.

Implementations (the ``impl`` parameter):

* ``rlk``: the public op on the backend rlk selects for the inputs (``rlk.explain`` names it;
  ``RLK_BACKEND=<name>`` pins one);
* ``torch_eager``: Hugging Face's ``LlamaRMSNorm.forward`` (``x.float()``, ``pow(2).mean(-1)``,
  ``rsqrt``, ``weight * n.to(x.dtype)``), with HF's residual add ``s = residual + x`` in front when the
  ``residual`` option is on;
* ``torch_compile``: the same function through ``torch.compile(dynamic=False)``, compiled when the point is
  built (compilation and warm-up are never timed).

The option ``residual``: off, ``y = rms_norm(x)``; on, the fused pre-norm step ``s = x + residual``,
``y = rms_norm(s)``, both returned. One step is the forward plus ``torch.autograd.grad`` of the outputs
(random ``grad_y``, and a random gradient of ``s`` when fused) with respect to ``x``, ``weight`` (and
``residual``). Inputs are random and seeded; weight has x's dtype.

Reported (asv ``track_``): ``track_ms`` (median ms of one step, CUDA events), ``track_gbps``: nominal bytes
per step over the time, the minimum traffic of a fused implementation, credited the same to every impl:

* residual off: ``5 * N * H * itemsize``: forward reads x and writes y, backward reads grad_y and x and
  writes grad_x;
* residual on: ``8 * N * H * itemsize``: forward reads x and residual and writes y and s, backward reads
  grad_y, s and the gradient of s and writes grad_x (which is also grad_residual: the same tensor).

Per-row ``rstd``, the weight and the grad-weight partials are not credited (under 4% at ``H = 4096``).
``track_peak_extra_mib`` (``RmsNormMemory``, GPU only): peak memory of one step above the inputs.
The headline is ``[16384, 4096]`` bf16; quick mode (``RLK_BENCH_QUICK=1`` or no GPU) runs ``[64, 96]`` fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

import rlk
from rlk.ops.norm import rms_norm

from .common import DEVICE, QUICK, SEED, CaseBase, _CaseSetup, _MemorySetup

DTYPE = torch.float32 if QUICK else torch.bfloat16
EPS = 1e-6
IMPLS = ["rlk", "torch_eager", "torch_compile"]
RESIDUAL = [False, True]
# (N, H): tokens, hidden size.
SHAPES = [(64, 96)] if QUICK else [(16384, 4096)]


def hf_rms_norm(x: Tensor, weight: Tensor, residual: Tensor | None) -> tuple[Tensor, ...]:
    """Hugging Face's LlamaRMSNorm (and the decoder layer's residual add before it), as eager PyTorch."""
    if residual is not None:
        x = residual + x
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + EPS)
    y = weight * h.to(input_dtype)
    return (y,) if residual is None else (y, x)


def rlk_rms_norm(x: Tensor, weight: Tensor, residual: Tensor | None) -> tuple[Tensor, ...]:
    out = rms_norm(x, weight, EPS, residual=residual)
    return out if residual is not None else (out,)


class RmsNormCase(CaseBase):
    """``rms_norm`` fwd+bwd on ``[N, H]`` tokens, with or without the fused residual add."""

    def __init__(self, op: str, impl: str, residual: bool, shape: tuple[int, int]):
        gen = torch.Generator(DEVICE).manual_seed(SEED)
        n, h = shape
        x = torch.randn(n, h, generator=gen, device=DEVICE, dtype=DTYPE)
        weight = 1 + 0.1 * torch.randn(h, generator=gen, device=DEVICE, dtype=DTYPE)
        res = torch.randn(n, h, generator=gen, device=DEVICE, dtype=DTYPE) if residual else None
        self.inputs = tuple(t.requires_grad_() for t in (x, weight, res) if t is not None)
        self.residual = res
        self.grad_outputs = tuple(
            torch.randn(n, h, generator=gen, device=DEVICE, dtype=DTYPE) for _ in range(1 + residual)
        )
        self.work, self.unit = (8 if residual else 5) * n * h * x.element_size(), "GB/s"
        if impl == "rlk":
            fn = rlk_rms_norm
            self.decision = rlk.explain("rms_norm", x)
        elif impl in ("torch_eager", "torch_compile"):
            fn = hf_rms_norm
            if impl == "torch_compile":
                torch.compiler.reset()  # a fresh, static-shape compile for every benchmark point
                fn = torch.compile(fn, dynamic=False)
        else:
            raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
        self.fn = fn
        self.step()

    def step(self) -> tuple[Tensor, ...]:
        """Forward, then the gradients of the outputs with respect to x, weight (and residual)."""
        x, weight = self.inputs[:2]
        outputs = self.fn(x, weight, self.residual)
        return torch.autograd.grad(outputs, self.inputs, self.grad_outputs)


class RmsNorm(_CaseSetup):
    """``rms_norm`` fwd+bwd: milliseconds and GB/s (5 or 8 N H itemsize bytes per step)."""

    op, case_type, shape_names = "rms_norm", RmsNormCase, "NH"
    param_names = ["impl", "residual", "shape"]
    params = [IMPLS, RESIDUAL, SHAPES]

    def track_ms(self, impl: str, residual: bool, shape: tuple[int, int]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_gbps(self, impl: str, residual: bool, shape: tuple[int, int]) -> float:
        return self.case.rate()

    track_gbps.unit = "GB/s"


class RmsNormMemory(_MemorySetup):
    """``rms_norm`` fwd+bwd: peak extra GPU memory in MiB."""

    op, case_type, param_names, params = "rms_norm", RmsNormCase, RmsNorm.param_names, RmsNorm.params
