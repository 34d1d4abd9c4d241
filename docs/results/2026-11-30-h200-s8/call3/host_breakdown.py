"""Host-time breakdown of rlk.policy_loss_and_grad on a CUDA machine (session 8, call 3): the cost of a few torch
calls the op makes, the op layer alone (the backend primitive stubbed out) and the whole call, with cProfile tables.
Run from the repository root: ``python3 docs/results/2026-11-30-h200-s8/call3/host_breakdown.py``."""

import cProfile
import pstats
import time

import torch

import rlk
from rlk import dispatch

B, T = 512, 8192
dev = torch.device("cuda")
g = torch.Generator("cuda").manual_seed(0)
old = -torch.rand(B, T, generator=g, device=dev) * 5
lp = (old + 0.1 * torch.randn(B, T, generator=g, device=dev)).requires_grad_()
adv = torch.randn(B, T, generator=g, device=dev)
mask = torch.rand(B, T, generator=g, device=dev) < 0.9
KW = dict(loss="ppo", clip_low=0.2, dual_clip=3.0, clamp_log_ratio=20.0, agg="token-mean")


def us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    e = time.perf_counter() - t0
    torch.cuda.synchronize()
    return e / n * 1e6


def prof(fn, n=500, top=30):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def full():
    return rlk.policy_loss_and_grad(lp, old, adv, mask, **KW)


m8 = torch.zeros(8, device=dev)
print(f"torch.empty(()) cuda       {us(lambda: torch.empty((), device=dev)):.1f} us")
print(f"torch.empty((512,9)) cuda  {us(lambda: torch.empty((512, 9), device=dev)):.1f} us")
print(f"torch.empty_like([B,T])    {us(lambda: torch.empty_like(old)):.1f} us")
print(f"torch.zeros(2049) int32    {us(lambda: torch.zeros(2049, dtype=torch.int32, device=dev)):.1f} us")
print(f"x.to(float32) same dtype   {us(lambda: old.to(torch.float32)):.1f} us")
print(f"x.contiguous()             {us(lambda: old.contiguous()):.1f} us")
print(f"metrics.unbind()           {us(lambda: m8.unbind()):.1f} us")
print(f"policy_loss_and_grad       {us(full):.1f} us")
with rlk.use_backend("triton"):
    print(f"  (use_backend triton)     {us(full):.1f} us")
be = dispatch.select("policy_loss", dev, torch.float32)
real = be.primitives["policy_loss_fwd"]
be.primitives["policy_loss_fwd"] = lambda *a, **k: None
print(f"op layer (primitive stubbed) {us(full):.1f} us")
prof(full)
be.primitives["policy_loss_fwd"] = real
print(f"full again                 {us(full):.1f} us")
prof(full, top=40)
