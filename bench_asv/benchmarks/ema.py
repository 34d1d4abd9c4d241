"""Benchmarks of ``rlk.ema_`` (the in-place EMA of a reference / target model's weights) against
``torch._foreach_lerp_(target, source, 1 - decay)``.

Implementations (the ``impl`` parameter): ``rlk`` (the public op on the backend rlk selects; one Triton launch per
dtype) and ``torch_foreach`` (``torch._foreach_lerp_``, the multi-tensor apply kernel). One step updates every
weight of the list once with ``decay = 0.999``.

The parameter list is Qwen3-8B's (``shape``: layers, hidden, intermediate, vocab; 32 query and 8 key-value heads of
128, per-head q / k norms, untied LM head: 8.19e9 parameters in 399 tensors). Reported: ``track_ms`` (median ms per
step, CUDA events) and ``track_gbps``: ``3 * numel * itemsize`` bytes per step (target read and written, source
read) over the time. Quick mode (``RLK_BENCH_QUICK=1`` or no GPU) runs a two-layer toy of the same layout in fp32.
"""

from __future__ import annotations

import torch

import rlk

from .common import DEVICE, QUICK, SEED, CaseBase, _CaseSetup

DECAY = 0.999
IMPLS = ["rlk", "torch_foreach"]
DTYPES = ["float32"] if QUICK else ["bfloat16", "float32"]
# (layers, hidden, intermediate, vocab); heads of 128, 32 query and 8 key-value heads (quick: 2 and 1 of 16).
SHAPES = [(2, 64, 96, 128)] if QUICK else [(36, 4096, 12288, 151936)]


def qwen3_shapes(layers: int, hidden: int, intermediate: int, vocab: int) -> list[tuple[int, ...]]:
    """The parameter shapes of a Qwen3 dense model, in ``named_parameters`` order."""
    head = 16 if QUICK else 128
    q, kv = (2 * head, head) if QUICK else (32 * head, 8 * head)
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [
            (q, hidden),
            (kv, hidden),
            (kv, hidden),
            (hidden, q),
            (head,),
            (head,),
            (intermediate, hidden),
            (intermediate, hidden),
            (hidden, intermediate),
            (hidden,),
            (hidden,),
        ]
    return shapes + [(hidden,), (vocab, hidden)]


class EmaCase(CaseBase):
    """One EMA step over a Qwen3-sized parameter list."""

    def __init__(self, op: str, impl: str, dtype: str, shape: tuple[int, int, int, int]):
        dt = getattr(torch, dtype)
        gen = torch.Generator(DEVICE).manual_seed(SEED)
        shapes = qwen3_shapes(*shape)
        self.targets = [torch.randn(s, generator=gen, device=DEVICE, dtype=dt) for s in shapes]
        self.sources = [torch.randn(s, generator=gen, device=DEVICE, dtype=dt) for s in shapes]
        numel = sum(t.numel() for t in self.targets)
        self.work, self.unit = 3 * numel * self.targets[0].element_size(), "GB/s"
        if impl == "rlk":
            self.decision = rlk.explain("ema", self.targets[0])
        elif impl != "torch_foreach":
            raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
        self.impl = impl
        self.step()

    def step(self) -> None:
        if self.impl == "rlk":
            rlk.ema_(self.targets, self.sources, DECAY)
        else:
            torch._foreach_lerp_(self.targets, self.sources, 1 - DECAY)


class Ema(_CaseSetup):
    """``ema_`` over Qwen3-8B's weights: milliseconds and GB/s (3 numel itemsize bytes per step)."""

    op, case_type, shape_names = "ema", EmaCase, "LHIV"
    param_names = ["impl", "dtype", "shape"]
    params = [IMPLS, DTYPES, SHAPES]

    def teardown(self, impl: str, dtype: str, shape: tuple[int, int, int, int]) -> None:
        del self.case  # 2 x 16 GiB (bf16) of weights per point
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()

    def track_ms(self, impl: str, dtype: str, shape: tuple[int, int, int, int]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_gbps(self, impl: str, dtype: str, shape: tuple[int, int, int, int]) -> float:
        return self.case.rate()

    track_gbps.unit = "GB/s"
