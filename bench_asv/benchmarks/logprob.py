"""Forward + backward benchmarks of ``rlk.linear_logprob`` and ``rlk.selected_logprob`` against PyTorch.

Implementations (the ``impl`` parameter):

* ``rlk``: the public op on the backend rlk selects for the inputs (``rlk.explain`` names it and the
  standalone runner records it; ``RLK_BACKEND=<name>`` pins one);
* ``torch_eager``: the expression RL code writes by hand,
  ``torch.log_softmax((hidden @ weight.T).float() / T, -1).gather(-1, targets[..., None])``
  (from ``logits.float() / T`` for ``selected_logprob``), plus ``-(p * log p).sum(-1)`` when the entropy
  is on;
* ``torch_compile``: the same expression through ``torch.compile(dynamic=False)``, compiled in ``setup``
  (compilation and warm-up are never timed).

One step is the forward plus ``torch.autograd.grad`` of its outputs, with random output gradients, with
respect to ``hidden`` and ``weight`` (linear) or ``logits`` (selected). Inputs are random and seeded.

Reported as asv ``track_`` benchmarks (GPU work is asynchronous, so asv's wall-clock ``time_`` would
time kernel launches):

* ``track_ms``: median milliseconds of one step over ``REPEATS`` runs after ``WARMUP`` runs, timed with
  CUDA events on a GPU and ``time.perf_counter`` on the CPU;
* ``track_tflops`` (linear): ``8 * N * H * V`` FLOPs per step over the time. The forward is one
  ``[N, H] x [H, V]`` matmul (2NHV); the backward recomputes the logits (2NHV) and forms ``grad_hidden``
  and ``grad_weight`` (2NHV each). Every implementation is credited the same nominal count, so rates
  compare like times (the PyTorch baselines keep the logits instead of recomputing them: 6NHV);
* ``track_gbps`` (selected): ``3 * N * V * itemsize`` bytes per step over the time: the logits read by
  the forward, read again by the backward, and ``grad_logits`` written (per-row vectors are negligible);
* ``track_peak_extra_mib`` (GPU only; skipped on the CPU): ``torch.cuda.max_memory_allocated`` during
  one step minus the memory allocated before it (the inputs); it includes the returned gradients.
* ``common.MachineCeilings``: a square matmul's TFLOP/s and a device-to-device copy's GB/s (bytes read +
  written), the roofs the rates above are read against.

Quick mode (``RLK_BENCH_QUICK=1``, or no GPU): tiny float32 shapes, so CI proves the suite runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

import rlk

from .common import (  # noqa: F401  (re-exported for bench_asv/run.py)
    COPY_BYTES,
    DEVICE,
    MATMUL_DTYPE,
    MATMUL_N,
    QUICK,
    REPEATS,
    SEED,
    WARMUP,
    CaseBase,
    _CaseSetup,
    _MemorySetup,
    copy_gbps,
    matmul_tflops,
    median_ms,
    peak_extra_mib,
)

DTYPE = torch.float32 if QUICK else torch.bfloat16
TEMPERATURE = 0.7

IMPLS = ["rlk", "torch_eager", "torch_compile"]
ENTROPY = [False, True]
# (N, H, V): tokens, hidden size, vocabulary. The first full-size shape is the headline (Qwen vocabulary).
LINEAR_SHAPES = [(64, 64, 1000)] if QUICK else [(16384, 4096, 151936), (4096, 4096, 151936), (4096, 4096, 32000)]
# (N, V): tokens, vocabulary.
SELECTED_SHAPES = [(64, 1000)] if QUICK else [(4096, 151936), (16384, 151936)]


# ---------------------------------------------------------------------------
# implementations
# ---------------------------------------------------------------------------


def _torch_logprob(z: Tensor, targets: Tensor, entropy: bool) -> tuple[Tensor, ...]:
    """Target log-prob (and entropy) from fp32 scaled logits ``z``, as PyTorch users write it."""
    logp = torch.log_softmax(z, dim=-1)
    logprob = logp.gather(-1, targets[..., None]).squeeze(-1)
    if not entropy:
        return (logprob,)
    return logprob, -(logp.exp() * logp).sum(-1)


def torch_linear_logprob(hidden: Tensor, weight: Tensor, targets: Tensor, entropy: bool) -> tuple[Tensor, ...]:
    """PyTorch baseline of ``rlk.linear_logprob``: materializes the ``[N, V]`` logits."""
    return _torch_logprob((hidden @ weight.T).float() / TEMPERATURE, targets, entropy)


def torch_selected_logprob(logits: Tensor, targets: Tensor, entropy: bool) -> tuple[Tensor, ...]:
    """PyTorch baseline of ``rlk.selected_logprob``."""
    return _torch_logprob(logits.float() / TEMPERATURE, targets, entropy)


def _rlk_outputs(op: Callable[..., Tensor | tuple[Tensor, Tensor]], *args: Tensor, entropy: bool) -> tuple:
    out = op(*args, temperature=TEMPERATURE, return_entropy=entropy)
    return out if entropy else (out,)


_RLK_OPS = {"linear_logprob": rlk.linear_logprob, "selected_logprob": rlk.selected_logprob}
_BASELINES = {"linear_logprob": torch_linear_logprob, "selected_logprob": torch_selected_logprob}


def forward_fn(op: str, impl: str, entropy: bool) -> Callable[..., tuple[Tensor, ...]]:
    """The forward of ``op`` by ``impl`` (see the module docstring), returning a tuple of outputs."""
    if impl == "rlk":
        return functools.partial(_rlk_outputs, _RLK_OPS[op], entropy=entropy)
    baseline = functools.partial(_BASELINES[op], entropy=entropy)
    if impl == "torch_eager":
        return baseline
    if impl == "torch_compile":
        torch.compiler.reset()  # a fresh, static-shape compile for every benchmark point
        return torch.compile(baseline, dynamic=False)
    raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")


# ---------------------------------------------------------------------------
# one benchmark point
# ---------------------------------------------------------------------------


class Case(CaseBase):
    """One benchmark point: inputs, the fwd+bwd step of one implementation, and the work it does.

    ``work`` is FLOPs per step when ``unit`` is "TFLOP/s" and bytes per step when it is "GB/s" (the
    counts are in the module docstring). Building a Case runs one step, which compiles what needs it.
    """

    def __init__(self, op: str, impl: str, entropy: bool, shape: tuple[int, ...]):
        gen = torch.Generator(DEVICE).manual_seed(SEED)
        if op == "linear_logprob":
            n, h, v = shape
            hidden = torch.randn(n, h, generator=gen, device=DEVICE, dtype=DTYPE)
            weight = torch.randn(v, h, generator=gen, device=DEVICE, dtype=DTYPE) * h**-0.5  # logits ~ N(0, 1)
            self.inputs = (hidden.requires_grad_(), weight.requires_grad_())
            self.work, self.unit = 8 * n * h * v, "TFLOP/s"
        elif op == "selected_logprob":
            n, v = shape
            logits = 2 * torch.randn(n, v, generator=gen, device=DEVICE, dtype=DTYPE)
            self.inputs = (logits.requires_grad_(),)
            self.work, self.unit = 3 * n * v * logits.element_size(), "GB/s"
        else:
            raise ValueError(f"unknown op {op!r}; expected one of {list(_RLK_OPS)}")
        self.targets = torch.randint(0, v, (n,), generator=gen, device=DEVICE)
        self.grad_outputs = tuple(torch.randn(n, generator=gen, device=DEVICE) for _ in range(1 + entropy))
        self.forward = forward_fn(op, impl, entropy)
        self.decision = rlk.explain(op, *self.inputs) if impl == "rlk" else None
        self.step()

    def step(self) -> tuple[Tensor, ...]:
        """Forward, then the gradients of the outputs with respect to the inputs."""
        outputs = self.forward(*self.inputs, self.targets)
        return torch.autograd.grad(outputs, self.inputs, self.grad_outputs)


# ---------------------------------------------------------------------------
# asv benchmarks
# ---------------------------------------------------------------------------


class LinearLogprob(_CaseSetup):
    """``linear_logprob`` fwd+bwd: milliseconds and TFLOP/s (8NHV FLOPs per step)."""

    op = "linear_logprob"
    case_type = Case
    param_names = ["impl", "entropy", "shape"]
    shape_names = "NHV"
    params = [IMPLS, ENTROPY, LINEAR_SHAPES]

    def track_ms(self, impl: str, entropy: bool, shape: tuple[int, ...]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_tflops(self, impl: str, entropy: bool, shape: tuple[int, ...]) -> float:
        return self.case.rate()

    track_tflops.unit = "TFLOP/s"


class LinearLogprobMemory(_MemorySetup):
    """``linear_logprob`` fwd+bwd: peak extra GPU memory in MiB."""

    op, case_type, param_names, params = "linear_logprob", Case, LinearLogprob.param_names, LinearLogprob.params


class SelectedLogprob(_CaseSetup):
    """``selected_logprob`` fwd+bwd: milliseconds and GB/s (3 N V itemsize bytes per step)."""

    op = "selected_logprob"
    case_type = Case
    param_names = ["impl", "entropy", "shape"]
    shape_names = "NV"
    params = [IMPLS, ENTROPY, SELECTED_SHAPES]

    def track_ms(self, impl: str, entropy: bool, shape: tuple[int, ...]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_gbps(self, impl: str, entropy: bool, shape: tuple[int, ...]) -> float:
        return self.case.rate()

    track_gbps.unit = "GB/s"


class SelectedLogprobMemory(_MemorySetup):
    """``selected_logprob`` fwd+bwd: peak extra GPU memory in MiB."""

    op, case_type, param_names = "selected_logprob", Case, SelectedLogprob.param_names
    params = SelectedLogprob.params
