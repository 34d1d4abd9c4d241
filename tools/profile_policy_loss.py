"""Where the time of one ``rlk.policy_loss`` fwd+bwd step goes, on a CUDA machine.

Prints, for the benchmark's PPO step on ``[B, T]`` fp32 tokens (the shape of
``bench_asv/benchmarks/rl_objectives.py``): the time of one step timed by CUDA events on an idle
device (what the benchmark reports), the host time per step when steps are queued back to back
(the Python and launch cost), and the GPU kernels of one step from ``torch.profiler`` with their
durations, so the kernels' own bandwidth can be told apart from host overhead.

Usage: ``python tools/profile_policy_loss.py [--shape 512,8192]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import rlk

CLIP, DUAL_CLIP, CLAMP = 0.2, 3.0, 20.0


def step(logprob, old, adv, mask):
    loss, metrics = rlk.policy_loss(logprob, old, adv, mask, loss="ppo", clip_low=CLIP, dual_clip=DUAL_CLIP,
                                    clamp_log_ratio=CLAMP, agg="token-mean")
    return torch.autograd.grad(loss, logprob), metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="512,8192")
    args = parser.parse_args()
    b, t = (int(x) for x in args.shape.split(","))
    gen = torch.Generator("cuda").manual_seed(0)
    old = -torch.rand(b, t, generator=gen, device="cuda") * 5
    logprob = (old + 0.1 * torch.randn(b, t, generator=gen, device="cuda")).requires_grad_()
    adv = torch.randn(b, t, generator=gen, device="cuda")
    mask = torch.rand(b, t, generator=gen, device="cuda") < 0.9
    for _ in range(5):
        step(logprob, old, adv, mask)
    torch.cuda.synchronize()

    event_ms = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        step(logprob, old, adv, mask)
        end.record()
        end.synchronize()
        event_ms.append(start.elapsed_time(end))
    torch.cuda.synchronize()
    n = 200
    begin = time.perf_counter()
    for _ in range(n):
        step(logprob, old, adv, mask)
    host_ms = (time.perf_counter() - begin) * 1e3 / n
    torch.cuda.synchronize()

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step(logprob, old, adv, mask)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_kernel: dict[str, list[float]] = {}
    for e in kernels:
        per_kernel.setdefault(e.name, []).append(e.device_time_total / 1e3)
    gpu_ms = sum(sum(v) for v in per_kernel.values()) / 10
    nominal_bytes = b * t * (4 + 4 + 4 + 1 + 4)
    print(f"policy_loss ppo fwd+bwd [{b}, {t}] fp32 on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    print(f"  one step, CUDA events on an idle device: median {statistics.median(event_ms):.3f} ms")
    print(f"  host time per step, steps queued back to back: {host_ms:.3f} ms")
    print(f"  GPU kernel time per step: {gpu_ms:.3f} ms -> {nominal_bytes / gpu_ms / 1e6:.0f} GB/s of the "
          f"{nominal_bytes / 2**20:.0f} MiB credited")
    for name, times in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1])):
        print(f"    {sum(times) / 10 * 1e3:8.1f} us  x{len(times) // 10}  {name[:100]}")


if __name__ == "__main__":
    main()
