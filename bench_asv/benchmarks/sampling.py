"""Benchmarks of ``rlk.sample`` (batch-invariant fused sampling, Philox4x32-10 Gumbel-max) against
``torch.multinomial(torch.softmax(logits / T, -1), 1)`` (not batch-invariant; torch's generator).

Implementations (the ``impl`` parameter): ``rlk`` (the public op on the backend rlk selects) and
``torch_multinomial``. ``option``: ``plain`` (temperature 0.8) or ``top_k_top_p`` (temperature 0.8, top-k 50,
top-p 0.9; the torch baseline stays plain multinomial, which does no filtering). Shape ``[256, 151936]`` bf16 (a
Qwen vocabulary); quick mode (``RLK_BENCH_QUICK=1`` or no GPU) runs ``[4, 1000]`` fp32. Reported: ``track_ms``
(median ms per call) and ``track_gbps`` (the logits read once, over the time).
"""

from __future__ import annotations

import torch

import rlk

from .common import DEVICE, QUICK, SEED, CaseBase, _CaseSetup

TEMPERATURE = 0.8
IMPLS = ["rlk", "torch_multinomial"]
OPTIONS = ["plain", "top_k_top_p"]
DTYPES = ["float32"] if QUICK else ["bfloat16"]
SHAPES = [(4, 1000)] if QUICK else [(256, 151936)]


class SampleCase(CaseBase):
    """One sampling call over a batch of logits rows."""

    def __init__(self, op: str, impl: str, option: str, dtype: str, shape: tuple[int, int]):
        gen = torch.Generator(DEVICE).manual_seed(SEED)
        rows, vocab = shape
        self.logits = torch.randn(shape, generator=gen, device=DEVICE).mul_(3).to(getattr(torch, dtype))
        self.seeds = torch.arange(rows, dtype=torch.int64, device=DEVICE)
        self.steps = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
        self.kw = (
            dict(temperature=TEMPERATURE) if option == "plain" else dict(temperature=TEMPERATURE, top_k=50, top_p=0.9)
        )
        self.work, self.unit = self.logits.numel() * self.logits.element_size(), "GB/s"
        if impl == "rlk":
            self.decision = rlk.explain("sample", self.logits)
        elif impl != "torch_multinomial":
            raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
        self.impl = impl
        self.step()

    def step(self) -> object:
        if self.impl == "rlk":
            return rlk.sample(self.logits, self.seeds, self.steps, **self.kw)
        return torch.multinomial(torch.softmax(self.logits.float() / TEMPERATURE, -1), 1)


class Sample(_CaseSetup):
    """``sample`` at ``[256, 151936]`` bf16: milliseconds and GB/s (the logits read once)."""

    op, case_type, shape_names = "sample", SampleCase, "BV"
    param_names = ["impl", "option", "dtype", "shape"]
    params = [IMPLS, OPTIONS, DTYPES, SHAPES]

    def setup(self, impl: str, option: str, dtype: str, shape: tuple[int, int]) -> None:
        self.case = SampleCase(self.op, impl, option, dtype, shape)

    def track_ms(self, impl: str, option: str, dtype: str, shape: tuple[int, int]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_gbps(self, impl: str, option: str, dtype: str, shape: tuple[int, int]) -> float:
        return self.case.rate()

    track_gbps.unit = "GB/s"
