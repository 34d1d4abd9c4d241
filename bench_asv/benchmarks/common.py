"""What every rlk benchmark module shares: the device, quick mode, timing and memory measurement,
the machine ceilings, and the asv plumbing around a benchmark point (a ``Case``).

A ``Case`` is built from ``(op, impl, option, shape)``, runs one step when built (so compiling is
never timed), and offers ``ms()``, ``rate()`` (``work`` per step in ``unit``), ``peak_extra_mib()``
and ``decision`` (``rlk.explain`` of the rlk implementation, or None).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

QUICK = os.environ.get("RLK_BENCH_QUICK") == "1" or not torch.cuda.is_available()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SEED = 1234
WARMUP, REPEATS = (1, 3) if QUICK else (3, 10)

# Machine ceilings: an n^3 matmul (2 n^3 FLOPs) and a copy of COPY_BYTES (read once, written once).
MATMUL_N, MATMUL_DTYPE = (256, torch.float32) if QUICK else (8192, torch.bfloat16)
COPY_BYTES = 2**24 if QUICK else 2**30


# ---------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------


def run_ms(fn: Callable[[], object], device: torch.device = DEVICE) -> float:
    """Milliseconds of one run of ``fn()``: CUDA events recorded around it on an idle GPU (the time includes any
    host-side work the GPU waits for), ``time.perf_counter`` on the CPU. The one timer of the benchmarks and the
    tools (``median_ms``, ``tools/bench_chain_forward.py``, ``tools/profile_policy_loss.py``, rlk-cuda's
    ``bench_cuda.py``)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    fn()
    return (time.perf_counter() - begin) * 1e3


def median_ms(
    fn: Callable[[], object], warmup: int = WARMUP, repeats: int = REPEATS, device: torch.device = DEVICE
) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs (:func:`run_ms`)."""
    for _ in range(warmup):
        fn()
    return statistics.median(run_ms(fn, device) for _ in range(repeats))


def device_ms(prof) -> float:
    """Milliseconds the GPU was busy with the work a finished ``torch.profiler.profile`` recorded: the
    union of the device intervals ``[start, end]`` of its CUDA events (kernels and memory operations:
    memcpy, memset), so time in which two of them overlap counts once.

    Kernels that run one after the other (the usual stream order) never overlap: the union is the sum of
    their durations. A kernel launched by programmatic dependent launch may start before the one ahead
    of it ends (and wait inside for it): the sum of durations would count that time twice.
    CPU events (ops, runtime calls), recorded when the profile also has ``ProfilerActivity.CPU``,
    are left out: an op's ``device_time_total`` counts its kernels a second time.
    """
    intervals = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy_us, covered_to = 0.0, float("-inf")
    for start, end in intervals:
        if end > covered_to:
            busy_us += end - max(start, covered_to)
            covered_to = end
    return busy_us / 1e3


def kernel_ms(fn: Callable[[], object], repeats: int = REPEATS) -> float | None:
    """GPU time of the kernels ``fn()`` launches, per run, from ``torch.profiler`` (CUDA only, else None).

    The time the device was busy with the kernels and memory operations of ``repeats`` runs
    (:func:`device_ms`: the sum of their durations, overlaps counted once), divided by ``repeats``.
    Unlike :func:`median_ms` it excludes the host-side time (Python, launch overhead) the GPU spends
    waiting, so it is the time that bandwidth and FLOP rates of a kernel should be judged by;
    :func:`median_ms` is what a caller waits.
    """
    if DEVICE.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(DEVICE)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize(DEVICE)
    return device_ms(prof) / repeats


def peak_extra_mib(fn: Callable[[], object]) -> float:
    """Peak GPU memory allocated while ``fn()`` runs, above what was allocated before it, in MiB."""
    torch.cuda.synchronize(DEVICE)
    torch.cuda.reset_peak_memory_stats(DEVICE)
    before = torch.cuda.memory_allocated(DEVICE)
    fn()
    torch.cuda.synchronize(DEVICE)
    return (torch.cuda.max_memory_allocated(DEVICE) - before) / 2**20


def matmul_tflops() -> float:
    """TFLOP/s of a ``MATMUL_N``-cubed matmul in ``MATMUL_DTYPE`` on random data (2 n^3 FLOPs)."""
    gen = torch.Generator(DEVICE).manual_seed(SEED)
    a = torch.randn(MATMUL_N, MATMUL_N, generator=gen, device=DEVICE, dtype=MATMUL_DTYPE)
    b = torch.randn(MATMUL_N, MATMUL_N, generator=gen, device=DEVICE, dtype=MATMUL_DTYPE)
    out = torch.empty_like(a)
    ms = median_ms(lambda: torch.matmul(a, b, out=out), warmup=5, repeats=50)
    return 2 * MATMUL_N**3 / (ms * 1e-3) / 1e12


def copy_gbps() -> float:
    """GB/s of a device-to-device copy of ``COPY_BYTES`` random bytes (bytes read + bytes written)."""
    gen = torch.Generator(DEVICE).manual_seed(SEED)
    src = torch.randn(COPY_BYTES // 4, generator=gen, device=DEVICE)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=5, repeats=50)
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------
# one benchmark point, and the asv plumbing around it
# ---------------------------------------------------------------------------


class CaseBase:
    """Time, rate and peak memory of one point. Subclasses set ``work`` (FLOPs when ``unit`` is
    "TFLOP/s", bytes when it is "GB/s"), ``unit``, ``decision`` and implement ``step()``."""

    work: float = 0.0
    unit: str = ""
    decision = None
    _ms: float | None = None

    def step(self) -> object:
        raise NotImplementedError

    def ms(self) -> float:
        """Median milliseconds per step (measured once, then remembered)."""
        if self._ms is None:
            self._ms = median_ms(self.step)
        return self._ms

    def rate(self) -> float:
        """Achieved rate in ``self.unit``: the work per step over ``ms()``."""
        scale = 1e12 if self.unit == "TFLOP/s" else 1e9
        return self.work / (self.ms() * 1e-3) / scale

    def kernel_ms(self) -> float | None:
        """GPU kernel milliseconds per step (see :func:`kernel_ms`; None off CUDA)."""
        return kernel_ms(self.step)

    def peak_extra_mib(self) -> float:
        """Peak extra GPU memory of one step, in MiB (see :func:`peak_extra_mib`)."""
        return peak_extra_mib(self.step)


# The leading underscore keeps asv from collecting the base classes as benchmarks.
class _CaseSetup:
    """asv setup shared by the op benchmarks: ``self.case`` for one (impl, option, shape).

    Subclasses set ``op``, ``case_type`` (the module's Case class), ``params`` and ``param_names``
    (the option's name, e.g. ``entropy`` or ``loss``) and ``shape_names`` (e.g. ``"NHV"``).
    """

    op = ""
    case_type: type = object
    shape_names = ""
    timeout = 900  # first compiles at the headline shape take minutes

    def setup(self, impl: str, option, shape: tuple[int, ...]) -> None:
        self.case = self.case_type(self.op, impl, option, shape)


class _MemorySetup(_CaseSetup):
    """Peak extra memory of one step; CUDA only (asv marks the CPU points skipped)."""

    def setup(self, impl: str, option, shape: tuple[int, ...]) -> None:
        if DEVICE.type != "cuda":
            raise NotImplementedError("peak memory is measured on CUDA only")
        super().setup(impl, option, shape)

    def track_peak_extra_mib(self, impl: str, option, shape: tuple[int, ...]) -> float:
        return self.case.peak_extra_mib()

    track_peak_extra_mib.unit = "MiB"


class MachineCeilings:
    """The roofs: a square matmul's TFLOP/s and a device-to-device copy's GB/s."""

    def track_matmul_tflops(self) -> float:
        return matmul_tflops()

    track_matmul_tflops.unit = "TFLOP/s"

    def track_copy_gbps(self) -> float:
        return copy_gbps()

    track_copy_gbps.unit = "GB/s"
