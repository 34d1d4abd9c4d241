"""Forward + backward benchmarks of ``rlk.fused_linear_kl`` (distillation: student vs teacher from hidden states).

Implementations (the ``impl`` parameter), each computing the ``mean`` over the rows of the divergence (the
``divergence`` parameter: ``forward_kl``, ``reverse_kl``, ``jsd`` with beta 0.5) at temperature 0.7, the teacher
frozen, the gradient taken with respect to the student's hidden states and LM head:

* ``rlk``: the public op on the backend rlk selects (``rlk.explain`` names it; ``RLK_BACKEND`` pins one);
* ``torch_eager``: the plain formula from materialized fp32 logits, as distillation code writes it
  (``log_softmax`` of both, ``F.kl_div(..., log_target=True)`` for the KLs, a ``logaddexp`` mixture for the JSD);
* ``torch_compile``: the same through ``torch.compile(dynamic=False)``, compiled in ``setup`` (never timed);
* ``liger``: Liger-Kernel's ``LigerFusedLinearJSD`` (only listed when ``liger_kernel`` imports), whose ``jsd_beta``
  of 0 and 1 are forward and reverse KL by its documentation (the same convention as rlk's ``beta``).

One step is the forward plus ``torch.autograd.grad`` of the loss with respect to ``student_hidden`` and
``student_weight``. Reported like ``logprob.py``: ``track_ms`` (median of one step), ``track_tflops`` with
``2 N V (Hs + Ht) + 4 N V Hs`` FLOPs credited to every implementation (the two logit matmuls of the forward, then
``grad_hidden`` and ``grad_weight``; rlk recomputes both logit tiles once more for the KLs' gradient and twice
more for the JSD, which is not credited), and ``track_peak_extra_mib`` on a GPU.

Quick mode (``RLK_BENCH_QUICK=1``, or no GPU): tiny float32 shapes, so CI proves the suite runs.
"""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor

import rlk

from .common import DEVICE, QUICK, SEED, CaseBase, _CaseSetup, _MemorySetup

DTYPE = torch.float32 if QUICK else torch.bfloat16
TEMPERATURE = 0.7
BETA = 0.5
DIVERGENCES = ["forward_kl", "reverse_kl", "jsd"]
# (N, H, V): tokens, hidden size of both models, vocabulary. The first full-size shape is the headline.
SHAPES = [(64, 64, 1000)] if QUICK else [(16384, 4096, 151936), (4096, 4096, 151936)]


def _liger_jsd():
    """``LigerFusedLinearJSD``, or None when ``liger_kernel`` does not import."""
    try:
        return importlib.import_module("liger_kernel.transformers").LigerFusedLinearJSD
    except Exception:  # not installed, or installed without what it needs (a GPU, its triton)
        return None


LIGER = _liger_jsd()
IMPLS = ["rlk", "torch_eager", "torch_compile"] + (["liger"] if LIGER is not None else [])


# ---------------------------------------------------------------------------
# implementations
# ---------------------------------------------------------------------------


def torch_divergence(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor,
    divergence: str,
) -> Tensor:
    """The plain formula: fp32 logits of both models, the divergence per row, the mean over non-ignored rows."""
    log_q = torch.log_softmax((student_hidden @ student_weight.T).float() / TEMPERATURE, dim=-1)
    with torch.no_grad():
        log_p = torch.log_softmax((teacher_hidden @ teacher_weight.T).float() / TEMPERATURE, dim=-1)
    if divergence == "forward_kl":  # KL(p || q)
        rows = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    elif divergence == "reverse_kl":  # KL(q || p)
        rows = F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    else:
        log_m = torch.logaddexp(log_p + math.log(BETA), log_q + math.log(1 - BETA))
        rows = BETA * F.kl_div(log_m, log_p, reduction="none", log_target=True).sum(-1) + (1 - BETA) * F.kl_div(
            log_m, log_q, reduction="none", log_target=True
        ).sum(-1)
    valid = targets != -100
    return torch.where(valid, rows, 0.0).sum() / valid.sum().clamp(min=1)


def rlk_divergence(student_hidden, student_weight, teacher_hidden, teacher_weight, targets, divergence):
    return rlk.fused_linear_kl(
        student_hidden,
        student_weight,
        teacher_hidden,
        teacher_weight,
        targets,
        divergence=divergence,
        beta=BETA,
        temperature=TEMPERATURE,
    )


def liger_divergence(divergence: str):
    beta = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": BETA}[divergence]
    module = LIGER(jsd_beta=beta, ignore_index=-100, temperature=TEMPERATURE)

    def run(student_hidden, student_weight, teacher_hidden, teacher_weight, targets, divergence):
        return module(student_hidden, student_weight, teacher_hidden, teacher_weight, targets)

    return run


def forward_fn(impl: str, divergence: str):
    if impl == "rlk":
        return rlk_divergence
    if impl == "torch_eager":
        return torch_divergence
    if impl == "torch_compile":
        torch.compiler.reset()  # a fresh, static-shape compile for every benchmark point
        return torch.compile(torch_divergence, dynamic=False)
    if impl == "liger" and LIGER is not None:
        return liger_divergence(divergence)
    raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")


class Case(CaseBase):
    """One point: inputs (logits of std ~2, the teacher detached), one fwd+bwd step, the FLOPs it is credited."""

    def __init__(self, op: str, impl: str, divergence: str, shape: tuple[int, int, int]):
        gen = torch.Generator(DEVICE).manual_seed(SEED)
        n, h, v = shape

        def randn(*size: int, scale: float = 1.0) -> Tensor:
            return torch.randn(*size, generator=gen, device=DEVICE, dtype=DTYPE) * scale

        self.inputs = (randn(n, h).requires_grad_(), randn(v, h, scale=2 * h**-0.5).requires_grad_())
        self.teacher = (randn(n, h), randn(v, h, scale=2 * h**-0.5))
        self.targets = torch.randint(0, v, (n,), generator=gen, device=DEVICE)
        self.divergence = divergence
        self.work, self.unit = 2 * n * v * (h + h) + 4 * n * v * h, "TFLOP/s"
        self.forward = forward_fn(impl, divergence)
        self.decision = rlk.explain("fused_linear_kl", self.inputs[0]) if impl == "rlk" else None
        self.step()

    def step(self) -> tuple[Tensor, ...]:
        loss = self.forward(*self.inputs, *self.teacher, self.targets, self.divergence)
        return torch.autograd.grad(loss, self.inputs)


# ---------------------------------------------------------------------------
# asv benchmarks
# ---------------------------------------------------------------------------


class FusedLinearKL(_CaseSetup):
    """``fused_linear_kl`` fwd+bwd: ms and TFLOP/s (2NV(Hs + Ht) + 4NVHs FLOPs per step)."""

    op, case_type, shape_names = "fused_linear_kl", Case, "NHV"
    baselines = tuple(impl for impl in IMPLS if impl != "rlk")
    param_names = ["impl", "divergence", "shape"]
    params = [IMPLS, DIVERGENCES, SHAPES]

    def track_ms(self, impl: str, divergence: str, shape: tuple[int, int, int]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_tflops(self, impl: str, divergence: str, shape: tuple[int, int, int]) -> float:
        return self.case.rate()

    track_tflops.unit = "TFLOP/s"


class FusedLinearKLMemory(_MemorySetup):
    """``fused_linear_kl`` fwd+bwd: peak extra GPU memory in MiB."""

    op, case_type, param_names, params = "fused_linear_kl", Case, FusedLinearKL.param_names, FusedLinearKL.params
