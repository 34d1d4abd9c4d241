"""Sweep the fixed tile configurations of the Triton linear_logprob kernels on a GPU.

The shipped configuration is one constant per dtype (batch invariance forbids choosing
tiles at run time); this script is how the constant is chosen. It times the forward,
the backward and the backward's GEMM alone at the headline shape, next to cuBLAS in
the same run, for a handful of candidate configurations, and prints a table.

    python tools/sweep_linear.py [--n 16384 --h 4096 --v 151936]
"""

from __future__ import annotations

import argparse
import copy

import torch
import triton

from rlk_triton import logprob as tl_logprob
from rlk_triton import matmul as tl_matmul

FWD_CANDIDATES = [
    dict(BLOCK_N=128, BLOCK_V=256, BLOCK_K=64, VOCAB_SPLIT=4096, GROUP_N=8, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_V=256, BLOCK_K=64, VOCAB_SPLIT=4096, GROUP_N=8, num_warps=8, num_stages=4),
    dict(BLOCK_N=128, BLOCK_V=256, BLOCK_K=64, VOCAB_SPLIT=8192, GROUP_N=4, num_warps=8, num_stages=3),
    dict(BLOCK_N=256, BLOCK_V=128, BLOCK_K=64, VOCAB_SPLIT=4096, GROUP_N=8, num_warps=8, num_stages=4),
]
BWD_CANDIDATES = [
    dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, VOCAB_CHUNK=4096, GROUP_N=8, num_warps=8, num_stages=4),
    dict(BLOCK_N=128, BLOCK_V=256, BLOCK_K=64, VOCAB_CHUNK=4096, GROUP_N=8, num_warps=8, num_stages=3),
    dict(BLOCK_N=256, BLOCK_V=128, BLOCK_K=64, VOCAB_CHUNK=4096, GROUP_N=8, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, VOCAB_CHUNK=8192, GROUP_N=4, num_warps=4, num_stages=4),
]
GEMM_CANDIDATES = [
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
]


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=400, return_mode="median")


def _kernel_breakdown(fn) -> str:
    """Total device time per kernel name over one call, from torch.profiler."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:40]] = totals.get(event.name[:40], 0.0) + event.device_time / 1e3
    return ", ".join(f"{name}: {ms:.1f}" for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:4])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--h", type=int, default=4096)
    parser.add_argument("--v", type=int, default=151936)
    args = parser.parse_args()
    n, h, v, dtype = args.n, args.h, args.v, torch.bfloat16
    dev = "cuda"
    torch.manual_seed(0)
    hidden = (torch.randn(n, h, device=dev) / h**0.25).to(dtype)
    weight = (torch.randn(v, h, device=dev) / h**0.25).to(dtype)
    targets = torch.randint(0, v, (n,), device=dev)
    inv_t = torch.ones(n, device=dev)
    lp, ent, lse = (torch.empty(n, device=dev) for _ in range(3))
    g_lp, g_ent = torch.randn(n, device=dev), torch.randn(n, device=dev)
    grad_h, grad_w = torch.empty_like(hidden), torch.empty_like(weight)
    flops_fwd, flops_bwd = 2 * n * h * v, 6 * n * h * v

    a = torch.randn(8192, 8192, device=dev, dtype=dtype)
    b = torch.randn(8192, 8192, device=dev, dtype=dtype)
    cublas = 2 * 8192**3 / _ms(lambda: a @ b) / 1e9
    print(f"cuBLAS bf16 8192^3: {cublas:.0f} TFLOP/s")
    # The backward's grad_hidden GEMM shape for one chunk: [N, 4096] @ [4096, H].
    ga = torch.randn(n, 4096, device=dev, dtype=dtype)
    gb = torch.randn(4096, h, device=dev, dtype=dtype)
    gout = torch.empty(n, h, device=dev, dtype=dtype)
    gemm_flops = 2 * n * 4096 * h
    print(f"cuBLAS [N,4096]@[4096,H]: {gemm_flops / _ms(lambda: ga @ gb) / 1e9:.0f} TFLOP/s")
    shipped = copy.deepcopy(tl_logprob.TILE_CONFIGS)
    # The backward's GEMM: rlk_triton.matmul._gemm with each candidate in place of BACKWARD_TILE_CONFIGS.
    print(f"shipped backward GEMM tiles: {tl_matmul.BACKWARD_TILE_CONFIGS[dtype]}")
    for cfg in GEMM_CANDIDATES:
        try:
            rate = gemm_flops / _ms(lambda cfg=cfg: tl_matmul._gemm(ga, gb, gout, cfg=cfg)) / 1e9
            print(f"triton gemm {cfg}: {rate:.0f} TFLOP/s")
        except Exception as exc:  # a config the compiler rejects (shared memory): report, keep going
            print(f"triton gemm {cfg}: FAILED {type(exc).__name__}: {str(exc)[:120]}")

    def fwd():
        tl_logprob.linear_logprob_fwd(hidden, weight, targets, inv_t, -100, lp, ent, lse)

    def bwd():
        tl_logprob.linear_logprob_bwd(hidden, weight, targets, inv_t, lse, ent, g_lp, g_ent, -100, grad_h, grad_w)

    print("| linear_fwd config | fwd ms | fwd TFLOP/s |")
    print("|---|---|---|")
    for cfg in FWD_CANDIDATES:
        tl_logprob.TILE_CONFIGS["linear_fwd"][dtype] = cfg
        try:
            f = _ms(fwd)
        except Exception as exc:
            print(f"| {cfg} | FAILED {type(exc).__name__}: {str(exc)[:100]} |")
            continue
        print(f"| {cfg} | {f:.1f} | {flops_fwd / f / 1e9:.0f} |")
    tl_logprob.TILE_CONFIGS.update(copy.deepcopy(shipped))
    fwd()
    print("| linear_bwd config | bwd ms | bwd TFLOP/s | per-kernel ms (profiler) |")
    print("|---|---|---|---|")
    for cfg in BWD_CANDIDATES:
        tl_logprob.TILE_CONFIGS["linear_bwd"][dtype] = cfg
        try:
            b_ = _ms(bwd)
        except Exception as exc:
            print(f"| {cfg} | FAILED {type(exc).__name__}: {str(exc)[:100]} |")
            continue
        print(f"| {cfg} | {b_:.1f} | {flops_bwd / b_ / 1e9:.0f} | {_kernel_breakdown(bwd)} |")
    tl_logprob.TILE_CONFIGS.update(shipped)


if __name__ == "__main__":
    main()
