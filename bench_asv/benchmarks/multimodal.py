"""Benchmarks of span-masked log-probs on a vision-language batch (issue 21 item 8): the response tokens' log-probs
of an image-text GRPO batch, forward and backward, against the framework-style PyTorch path.

Batch (seeded): ``B`` right-padded rows of ``T`` columns; each row holds an image's visual tokens (a third to a half
of ``T``), a short text prompt and a response of random length (the loss tokens, about a quarter of the batch), then
padding. ``hidden [B, T, H]`` (bf16, the final hidden states), ``weight [V, H]`` (the LM head), next-token
``targets [B, T]``, the response's span table ``loss_spans`` (int32 ``[S, 4]``, shifted onto the positions that
predict the response tokens) and, for the baseline, its dense ``[B, T]`` bool mask (built once on the host, as
trainers do from their masks; not timed).

Implementations (``impl``):

* ``rlk_host_spans``: ``rlk.linear_logprob(hidden, weight, targets, loss_spans=spans)`` with the span table on the
  CPU (as a data loader builds it): only the scored rows are packed and computed, no ``[N, V]`` logits;
* ``rlk_device_spans``: the same with the table on the GPU: every row computed, the unscored ones masked in place;
* ``torch_dense``: ``logits = hidden @ weight.T`` for every position (visual, prompt and padding included: the model's
  LM head computes them all), ``log_softmax`` in fp32, ``gather``, times the dense mask: what verl / TRL / OpenRLHF
  compute from a model's logits.

Each step: the forward, then the gradients with respect to ``hidden`` and ``weight`` for a random ``[B, T]`` output
gradient. Reported: ``track_ms`` (median ms), ``track_tflops`` (``8 N H V`` FLOPs credited to every impl, ``N = B T``:
the forward GEMM, its recomputation or a logits read, and the two backward GEMMs, over all positions; the packed path
does about a quarter of that, so its rate can pass the roof, ``MachineCeilings``' matmul in the same run) and
``track_peak_extra_mib`` (``SpanLogprobMemory``, GPU only).

Shape ``(B, T, H, V)``: ``[4, 2048, 3584, 151936]`` (Qwen2-VL-7B's LM head) bf16; quick mode (``RLK_BENCH_QUICK=1``
or no GPU): ``[2, 48, 32, 96]`` fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

import rlk

from .common import DEVICE, QUICK, SEED, CaseBase, _CaseSetup, _MemorySetup

IMPLS = ["rlk_host_spans", "rlk_device_spans", "torch_dense"]
DTYPE = torch.float32 if QUICK else torch.bfloat16
# (B, T, H, V): rows, padded length, hidden size, vocabulary.
SHAPES = [(2, 48, 32, 96)] if QUICK else [(4, 2048, 3584, 151936)]


def vlm_batch(b: int, t: int, v: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(targets [B, T] int64, loss_spans [B, 4] int32 on the CPU, mask [B, T] bool)`` of a seeded image-text batch:
    per row an image's visual tokens from column 1 (``T/3`` to ``T/2`` of them), a prompt of ``T/16`` tokens, then a
    response of ``T/8`` to ``3T/8`` tokens; the spans and mask mark the positions predicting the response."""
    g = torch.Generator().manual_seed(SEED)
    rows = []
    for i in range(b):
        visual = int(torch.randint(t // 3, t // 2 + 1, (1,), generator=g))
        start = 1 + visual + t // 16
        length = int(torch.randint(t // 8, 3 * t // 8 + 1, (1,), generator=g))
        end = min(start + length, t)
        rows.append([i, start - 1, end - 1, 0])  # positions predicting tokens [start, end)
    spans = torch.tensor(rows, dtype=torch.int32)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, first, last, _ in rows:
        mask[i, first:last] = True
    targets = torch.randint(0, v, (b, t), generator=g)
    return targets.to(DEVICE), spans, mask.to(DEVICE)


def torch_dense_logprob(hidden: Tensor, weight: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """The framework-style path: every position's logits, fp32 log-softmax, gather, times the dense mask."""
    logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1) * mask


def rlk_span_logprob(hidden: Tensor, weight: Tensor, targets: Tensor, spans: Tensor) -> Tensor:
    return rlk.linear_logprob(hidden, weight, targets, loss_spans=spans)


class SpanLogprobCase(CaseBase):
    """Response log-probs of one vision-language batch, forward and backward."""

    def __init__(self, op: str, impl: str, option, shape: tuple[int, int, int, int]):
        if impl not in IMPLS:
            raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
        b, t, h, v = shape
        gen = torch.Generator(DEVICE).manual_seed(SEED)
        hidden = torch.randn(b, t, h, generator=gen, device=DEVICE, dtype=DTYPE)
        weight = torch.randn(v, h, generator=gen, device=DEVICE, dtype=DTYPE) * h**-0.5
        self.inputs = (hidden.requires_grad_(), weight.requires_grad_())
        self.targets, self.spans, self.mask = vlm_batch(b, t, v)
        self.grad_output = torch.randn(b, t, generator=gen, device=DEVICE)
        self.work, self.unit = 8 * b * t * h * v, "TFLOP/s"
        self.impl = impl
        if impl == "rlk_device_spans":
            self.spans = self.spans.to(DEVICE)
        self.decision = rlk.explain("linear_logprob", hidden.view(-1, h), weight) if impl != "torch_dense" else None
        self.step()

    def forward(self) -> Tensor:
        if self.impl != "torch_dense":
            return rlk_span_logprob(*self.inputs, self.targets, self.spans)
        return torch_dense_logprob(*self.inputs, self.targets, self.mask)

    def step(self) -> tuple[Tensor, ...]:
        return torch.autograd.grad(self.forward(), self.inputs, self.grad_output)


class SpanLogprob(_CaseSetup):
    """Response log-probs of a ``[4, 2048]`` image-text batch through Qwen2-VL-7B's LM head, fwd+bwd: ms and TFLOP/s
    (``8 N H V``)."""

    op, case_type, shape_names = "linear_logprob", SpanLogprobCase, "BTHV"
    baselines = ("torch_dense",)
    param_names = ["impl", "option", "shape"]
    params = [IMPLS, ["fwd_bwd"], SHAPES]

    def track_ms(self, impl: str, option: str, shape: tuple[int, int, int, int]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_tflops(self, impl: str, option: str, shape: tuple[int, int, int, int]) -> float:
        return self.case.rate()

    track_tflops.unit = "TFLOP/s"


class SpanLogprobMemory(_MemorySetup):
    """The same step's peak extra GPU memory in MiB (CUDA only)."""

    op, case_type, param_names, params = "linear_logprob", SpanLogprobCase, SpanLogprob.param_names, SpanLogprob.params
