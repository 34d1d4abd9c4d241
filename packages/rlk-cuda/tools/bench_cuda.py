"""Bandwidth of the rlk-cuda kernels against the device's copy bandwidth, and whether CUDA and Triton agree
bit for bit (a report, not a requirement).

    python packages/rlk-cuda/tools/bench_cuda.py [--quick]

Targets (issue 4, H200): selected_logprob fwd+bwd from bf16 logits [16384, 151936] >= 85% of copy
bandwidth; rms_norm fwd+bwd [16384, 4096] bf16 >= 80%. Bytes counted: what each kernel must move at
least (selected_logprob: the forward reads the logits, the backward reads them and writes the gradient;
rms_norm: the forward reads x and writes y, the backward reads grad_y and s and writes grad_x; per-row
vectors, the weight and the grad-weight partials are not counted). Copy bandwidth: a device-to-device copy
of a tensor as large as the logits (bytes read + written). Times: median of CUDA-event timings around each
Python call (what a caller waits, host time included) and the kernels' own GPU time from torch.profiler (what
the bandwidth targets judge; the two differ by the host overhead when a kernel is short).

linear_logprob (compute-bound): fwd+bwd of bf16 hidden [N, 4096] and weight [151936, 4096] with entropy and
both gradients, credited 8 * N * H * V FLOPs (forward GEMM 2NHV; backward: logits recomputed 2NHV, grad_hidden
2NHV, grad_weight 2NHV), against torch.mm's rate on a bf16 [N, H] @ [H, 8192] product of the same N and H.
Each kernel pair that can run here is timed side by side: mma.sync everywhere, and the Hopper (wgmma) pair on a
compute capability 9.0 GPU with sm_90a built (else the reason it cannot), with the largest differences between
their outputs and the extra memory of one fwd+bwd (its scratch). The cuda-vs-triton comparison uses the
primitives' default kernels (RLK_CUDA_LINEAR_FWD / RLK_CUDA_LINEAR_BWD, printed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench_asv"))
from benchmarks.common import median_ms  # noqa: E402  (the benchmarks' timer)

from rlk_cuda import logprob as ck  # noqa: E402
from rlk_cuda import norm as cn  # noqa: E402


def timed(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (CUDA events)."""
    return median_ms(fn, warmup=warmup, repeats=reps, device=torch.device("cuda")) / 1e3


def kernel_seconds(fn, reps: int = 10) -> float:
    """GPU time of the kernels ``fn()`` launches, per run (``torch.profiler``): without the host time the GPU
    waits for, which :func:`timed` includes (tens of microseconds per Python call on a slow host, as much as
    a [16384, 4096] rms_norm kernel takes)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    device_us = sum(e.device_time_total for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return device_us / 1e6 / reps


def copy_bandwidth(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src))


def logprob_case(n: int, v: int, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, v, generator=g, device="cuda") * 3).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g, device="cuda")
    inv_t = torch.ones(n, device="cuda")
    lp, ent, lse = (torch.empty(n, device="cuda") for _ in range(3))
    g_lp, g_ent = torch.randn(2, n, generator=g, device="cuda")
    grad = torch.empty_like(x)

    def fwd(impl):
        impl.selected_logprob_fwd(x, targets, inv_t, -100, lp, ent, lse)

    def bwd(impl):
        impl.selected_logprob_bwd(x, targets, inv_t, lse, ent, g_lp, g_ent, -100, grad)

    return x, fwd, bwd, (lp, ent, lse, grad)


def norm_case(n: int, h: int, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, generator=g, device="cuda").to(dtype)
    w = (torch.randn(h, generator=g, device="cuda") * 0.1 + 1).to(dtype)
    y = torch.empty_like(x)
    rstd = torch.empty(n, device="cuda")
    gy = torch.randn(n, h, generator=g, device="cuda").to(dtype)
    gx = torch.empty_like(x)
    gw = torch.empty_like(w)

    def fwd(impl):
        impl.rms_norm_fwd(x, w, None, 1e-6, False, y, None, rstd)

    def bwd(impl):
        impl.rms_norm_bwd(gy, x, w, rstd, False, None, gx, gw)

    return x, fwd, bwd, (y, rstd, gx, gw)


def linear_case(n: int, h: int = 4096, v: int = 151936, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, generator=g, device="cuda").to(dtype)
    weight = (torch.randn(v, h, generator=g, device="cuda") / h**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g, device="cuda")
    inv_t = torch.ones(n, device="cuda")
    lp, ent, lse = (torch.empty(n, device="cuda") for _ in range(3))
    g_lp, g_ent = torch.randn(2, n, generator=g, device="cuda")
    gh, gw = torch.empty_like(hidden), torch.empty_like(weight)

    def fwd(impl):
        impl.linear_logprob_fwd(hidden, weight, targets, inv_t, -100, lp, ent, lse)

    def bwd(impl):
        impl.linear_logprob_bwd(hidden, weight, targets, inv_t, lse, ent, g_lp, g_ent, -100, gh, gw)

    def on_kernel(direction: str, name: str):
        """The forward or backward ("fwd" / "bwd") on one kernel, "mma" or "wgmma", whatever the environment says."""
        fn = getattr(ck, f"linear_logprob_{direction}_{name}")
        if direction == "fwd":
            fn(hidden, weight, targets, inv_t, -100, lp, ent, lse)
        else:
            fn(hidden, weight, targets, inv_t, lse, ent, g_lp, g_ent, -100, gh, gw)

    def mm_rate() -> float:
        b = torch.randn(h, 8192, generator=g, device="cuda").to(dtype)
        out = torch.empty(n, 8192, dtype=dtype, device="cuda")
        return 2 * n * h * 8192 / timed(lambda: torch.mm(hidden, b, out=out))

    return fwd, bwd, mm_rate, (lp, ent, lse, gh, gw), on_kernel


def extra_memory(fn) -> int:
    """Peak bytes ``fn()`` allocates above what was allocated before it (its scratch)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def report_linear(n: int, h: int = 4096, v: int = 151936) -> None:
    """fwd + bwd (entropy on, both gradients) on each kernel pair that can run here, side by side: times, the
    credited rate (8NHV) against torch.mm's, the extra memory, and the largest differences wgmma vs mma."""
    fwd, bwd, mm_rate, outs, on_kernel = linear_case(n, h, v)
    reps = 5 if n > 4096 else 10
    mm = mm_rate()
    device = torch.device("cuda")
    problem = ck.wgmma_problem(device)
    kernels = ("mma",) if problem is not None else ("mma", "wgmma")
    results = {}
    for name in kernels:
        t_fwd = timed(lambda name=name: on_kernel("fwd", name), reps=reps, warmup=1)
        t_bwd = timed(lambda name=name: on_kernel("bwd", name), reps=reps, warmup=1)
        extra = extra_memory(lambda name=name: (on_kernel("fwd", name), on_kernel("bwd", name)))
        results[name] = [o.clone() for o in outs]
        rate = 8 * n * h * v / (t_fwd + t_bwd)
        print(
            f"linear_logprob bf16 N={n} H={h} V={v} (entropy, both grads), {name} kernels: fwd {t_fwd * 1e3:.1f} ms "
            f"({100 * 2 * n * h * v / t_fwd / mm:.0f}% of mm), bwd {t_bwd * 1e3:.1f} ms "
            f"({100 * 6 * n * h * v / t_bwd / mm:.0f}% of mm), fwd+bwd {(t_fwd + t_bwd) * 1e3:.1f} ms = "
            f"{rate / 1e12:.0f} TFLOP/s credited (8NHV) = {100 * rate / mm:.0f}% of torch.mm's {mm / 1e12:.0f} "
            f"TFLOP/s; extra memory {extra / 2**30:.2f} GiB"
        )
    if problem is not None:
        print(f"linear_logprob wgmma kernels: not run ({problem})")
    else:
        for key, a, b in zip(
            ("logprob", "entropy", "lse", "grad_hidden", "grad_weight"), results["mma"], results["wgmma"]
        ):
            note = "" if bool(torch.isfinite(b).all()) else " (NON-FINITE wgmma values)"
            diff = (a.double() - b.double()).abs().max().item()
            print(f"linear_logprob N={n}: {key} wgmma vs mma max |diff| {diff:.3g}{note}")
    print(
        f"linear_logprob: the primitives' default kernels here: fwd {ck.forward_kernel(device)}, "
        f"bwd {ck.backward_kernel(device)}"
    )
    compare_linear_with_triton(n, fwd, bwd, outs, reps)


def compare_linear_with_triton(n: int, fwd, bwd, outputs, reps: int) -> None:
    """The Triton kernels' fwd+bwd time on the same case (side by side with the lines above), and max
    |cuda - triton| per output (both batch-invariant; different tilings, so not bitwise)."""
    try:
        import rlk_triton.logprob as tl_logprob
    except Exception as exc:
        print(f"linear_logprob: triton comparison skipped ({type(exc).__name__}: {exc})")
        return
    t_fwd = timed(lambda: fwd(tl_logprob), reps=reps, warmup=1)
    t_bwd = timed(lambda: bwd(tl_logprob), reps=reps, warmup=1)
    extra = extra_memory(lambda: (fwd(tl_logprob), bwd(tl_logprob)))
    print(
        f"linear_logprob N={n}, triton kernels: fwd {t_fwd * 1e3:.1f} ms, bwd {t_bwd * 1e3:.1f} ms, fwd+bwd "
        f"{(t_fwd + t_bwd) * 1e3:.1f} ms; extra memory {extra / 2**30:.2f} GiB"
    )
    fwd(ck)
    bwd(ck)
    ours = [t.clone() for t in outputs]
    fwd(tl_logprob)
    bwd(tl_logprob)
    for name, a, b in zip(("logprob", "entropy", "lse", "grad_hidden", "grad_weight"), ours, outputs):
        diff = (a.double() - b.double()).abs().max().item()
        print(f"linear_logprob N={n}: {name} cuda vs triton max |diff| {diff:.3g}")


def report(name: str, tensor_bytes: int, n_passes: int, fwd, bwd, copy_bw: float) -> None:
    """Event and kernel times of the cuda primitives and, side by side, of the triton ones (when importable)."""
    impls = {"cuda": ck if name.startswith("selected") else cn}
    try:
        import rlk_triton.logprob as tl_logprob
        import rlk_triton.norm as tl_norm

        impls["triton"] = tl_logprob if name.startswith("selected") else tl_norm
    except Exception as exc:
        print(f"{name}: triton timing skipped ({type(exc).__name__}: {exc})")
    for backend, impl in impls.items():
        t_fwd = timed(lambda impl=impl: fwd(impl))
        t_bwd = timed(lambda impl=impl: bwd(impl))
        k_fwd = kernel_seconds(lambda impl=impl: fwd(impl))
        k_bwd = kernel_seconds(lambda impl=impl: bwd(impl))
        total = n_passes * tensor_bytes
        bw, kernel_bw = total / (t_fwd + t_bwd), total / (k_fwd + k_bwd)
        print(
            f"{name} ({backend}): events (host included) fwd {t_fwd * 1e3:.3f} ms, bwd {t_bwd * 1e3:.3f} ms, "
            f"fwd+bwd {bw / 1e12:.2f} TB/s = {100 * bw / copy_bw:.1f}% of copy bandwidth; kernels fwd "
            f"{k_fwd * 1e3:.3f} ms, bwd {k_bwd * 1e3:.3f} ms, fwd+bwd {kernel_bw / 1e12:.2f} TB/s = "
            f"{100 * kernel_bw / copy_bw:.1f}% of copy"
        )


def compare_with_triton(name: str, fwd, bwd, outputs) -> None:
    """Run the same case on rlk_triton and report bitwise agreement per output."""
    try:
        import rlk_triton.logprob as tl_logprob
        import rlk_triton.norm as tl_norm
    except Exception as exc:
        print(f"{name}: triton comparison skipped ({type(exc).__name__}: {exc})")
        return
    impl_cuda, impl_triton = (ck, tl_logprob) if name.startswith("selected") else (cn, tl_norm)
    fwd(impl_cuda)
    bwd(impl_cuda)
    ours = [t.clone() for t in outputs]
    fwd(impl_triton)
    bwd(impl_triton)
    for i, (a, b) in enumerate(zip(ours, outputs)):
        same = torch.equal(a, b)
        diff = (a.double() - b.double()).abs().max().item()
        print(f"{name}: output {i} cuda vs triton bitwise {'equal' if same else 'DIFFERENT'} (max |diff| {diff:.3g})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes (smoke run)")
    parser.add_argument("--only", choices=("selected", "norm", "linear"), help="one kernel family")
    args = parser.parse_args()
    families = (args.only,) if args.only else ("selected", "norm", "linear")
    n_lp, v = (1024, 151936) if args.quick else (16384, 151936)
    n_norm, h = (2048, 4096) if args.quick else (16384, 4096)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    copy_bw = None
    if "selected" in families or "norm" in families:
        copy_bw = copy_bandwidth(n_lp * v * 2)
        print(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s (bytes read + written)")
    if "selected" in families:
        x, fwd, bwd, outs = logprob_case(n_lp, v)
        report(f"selected_logprob bf16 [{n_lp}, {v}]", x.numel() * x.element_size(), 3, fwd, bwd, copy_bw)
        compare_with_triton("selected_logprob", fwd, bwd, outs)
        del x, fwd, bwd, outs
        torch.cuda.empty_cache()
    if "norm" in families:
        x, fwd, bwd, outs = norm_case(n_norm, h)
        report(f"rms_norm bf16 [{n_norm}, {h}]", x.numel() * x.element_size(), 5, fwd, bwd, copy_bw)
        compare_with_triton("rms_norm", fwd, bwd, outs)
        del x, fwd, bwd, outs
        torch.cuda.empty_cache()
    if "linear" in families:
        for n in (1024,) if args.quick else (4096, 16384):
            report_linear(n)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
