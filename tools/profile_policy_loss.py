"""Where the time of one ``rlk.policy_loss`` fwd+bwd step goes, on a CUDA machine.

Prints, for the benchmark's PPO step on ``[B, T]`` fp32 tokens (the shape of
``bench_asv/benchmarks/rl_objectives.py``), once through autograd (``policy_loss`` +
``autograd.grad``) and once through ``policy_loss_and_grad``: the time of one step timed by CUDA events on an idle
device (what the benchmark reports), the host time per step when steps are queued back to back
(the Python and launch cost), and the GPU kernels of one step from ``torch.profiler`` with their
durations, so the kernels' own bandwidth can be told apart from host overhead, and the Python
functions that take the host time (``cProfile``, by own time).

Usage: ``python tools/profile_policy_loss.py [--shape 512,8192]``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench_asv"))
from benchmarks.common import run_ms  # noqa: E402  (the benchmarks' timer)

import rlk  # noqa: E402

CLIP, DUAL_CLIP, CLAMP = 0.2, 3.0, 20.0


def step(logprob, old, adv, mask):
    """policy_loss forward + autograd backward."""
    loss, metrics = rlk.policy_loss(
        logprob, old, adv, mask, loss="ppo", clip_low=CLIP, dual_clip=DUAL_CLIP, clamp_log_ratio=CLAMP, agg="token-mean"
    )
    return torch.autograd.grad(loss, logprob), metrics


def fused_step(logprob, old, adv, mask):
    """policy_loss_and_grad: the same loss and gradient in one pass, no autograd."""
    return rlk.policy_loss_and_grad(
        logprob, old, adv, mask, loss="ppo", clip_low=CLIP, dual_clip=DUAL_CLIP, clamp_log_ratio=CLAMP, agg="token-mean"
    )


def ppo_inputs(b: int, t: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The benchmark's ``[B, T]`` CUDA inputs: (logprob requiring grad, old logprob, advantages, bool mask)."""
    gen = torch.Generator("cuda").manual_seed(seed)
    old = -torch.rand(b, t, generator=gen, device="cuda") * 5
    logprob = (old + 0.1 * torch.randn(b, t, generator=gen, device="cuda")).requires_grad_()
    adv = torch.randn(b, t, generator=gen, device="cuda")
    mask = torch.rand(b, t, generator=gen, device="cuda") < 0.9
    return logprob, old, adv, mask


def host_us(fn, n: int = 500) -> float:
    """Host microseconds per call of ``fn`` queued back to back (no synchronization inside the loop)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - begin
    torch.cuda.synchronize()
    return elapsed * 1e6 / n


def _layers(logprob, old, adv, mask):
    """(name, call) from the whole step down to the backend's kernels, to tell where host time goes."""
    from rlk.core import dispatch
    from rlk.ops import policy_loss as policy_ops

    detached = logprob.detach()
    config = rlk.PolicyLossConfig(loss="ppo", clip_low=CLIP, dual_clip=DUAL_CLIP, clamp_log_ratio=CLAMP)
    call = policy_ops.prepare(tuple(logprob.shape), logprob.device, logprob.dtype, old, adv, mask, config, entropy=None)
    op_args = (
        call.old,
        call.advantages,
        call.mask,
        None,
        None,
        None,
        False,
        *call.norm_tensors,
        call.agg,
        call.loss,
        call.kl,
        call.flags,
        call.params,
    )
    backend = dispatch.select("policy_loss", logprob.device, logprob.dtype)
    b, t = logprob.shape
    outs = (
        logprob.new_empty(()),
        torch.empty_like(detached),
        None,
        logprob.new_empty((b,)),
        logprob.new_empty((b, 9)),
        logprob.new_empty((8,)),
    )
    attrs = (
        dict(agg=call.agg, loss=call.loss, kl=call.kl)
        | dict(zip(policy_ops._BOOL_ATTRS, call.flags))
        | dict(zip(policy_ops._FLOAT_ATTRS, call.params))
    )
    grad_out = torch.ones((), device=logprob.device)

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def dispatcher_step():
        with PassThrough():  # any dispatch mode sends rlk's ops through torch's custom-op path (rlk.core.custom_op)
            loss, _ = rlk.policy_loss(
                logprob,
                old,
                adv,
                mask,
                loss="ppo",
                clip_low=CLIP,
                dual_clip=DUAL_CLIP,
                clamp_log_ratio=CLAMP,
                agg="token-mean",
            )
        return torch.autograd.grad(loss, logprob)

    return [
        ("step through torch's custom-op dispatcher (and a pass-through dispatch mode)", dispatcher_step),
        ("step: rlk.policy_loss + autograd.grad", lambda: step(logprob, old, adv, mask)),
        ("step: rlk.policy_loss_and_grad", lambda: fused_step(logprob, old, adv, mask)),
        (
            "rlk.policy_loss forward, logprob requires grad",
            lambda: rlk.policy_loss(
                logprob, old, adv, mask, loss="ppo", clip_low=CLIP, dual_clip=DUAL_CLIP, clamp_log_ratio=CLAMP
            ),
        ),
        (
            "rlk.policy_loss forward, no grad",
            lambda: rlk.policy_loss(
                detached, old, adv, mask, loss="ppo", clip_low=CLIP, dual_clip=DUAL_CLIP, clamp_log_ratio=CLAMP
            ),
        ),
        ("torch.ops.rlk.policy_loss_fwd, requires grad", lambda: torch.ops.rlk.policy_loss_fwd(logprob, *op_args)),
        ("torch.ops.rlk.policy_loss_fwd, no grad", lambda: torch.ops.rlk.policy_loss_fwd(detached, *op_args)),
        (
            "backend primitive policy_loss_fwd (outputs preallocated)",
            lambda: backend.primitives["policy_loss_fwd"](
                detached, old, adv, mask, None, None, None, None, None, None, *outs, **attrs
            ),
        ),
        (
            "backend primitive policy_loss_bwd",
            lambda: backend.primitives["policy_loss_bwd"](grad_out, outs[1], None, torch.empty_like(detached), None),
        ),
        ("torch.empty_like([B, T]) (reference point)", lambda: torch.empty_like(detached)),
    ]


def _report_step(name, fn, logprob, old, adv, mask, nominal_bytes: int) -> None:
    """CUDA-event time, host time and the kernels of one step of ``fn``."""
    for _ in range(5):
        fn(logprob, old, adv, mask)
    torch.cuda.synchronize()
    event_ms = [run_ms(lambda: fn(logprob, old, adv, mask), logprob.device) for _ in range(20)]
    torch.cuda.synchronize()
    n = 200
    begin = time.perf_counter()
    for _ in range(n):
        fn(logprob, old, adv, mask)
    host_ms = (time.perf_counter() - begin) * 1e3 / n
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn(logprob, old, adv, mask)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_kernel: dict[str, list[float]] = {}
    for e in kernels:
        per_kernel.setdefault(e.name, []).append(e.device_time_total / 1e3)
    gpu_ms = sum(sum(v) for v in per_kernel.values()) / 10
    print(f"  {name}:")
    print(f"    one step, CUDA events on an idle device: median {statistics.median(event_ms):.3f} ms")
    print(f"    host time per step, steps queued back to back: {host_ms:.3f} ms")
    print(
        f"    GPU kernel time per step: {gpu_ms:.4f} ms -> {nominal_bytes / gpu_ms / 1e6:.0f} GB/s of the "
        f"{nominal_bytes / 2**20:.0f} MiB credited"
    )
    for kernel, times in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1])):
        print(f"      {sum(times) / 10 * 1e3:8.1f} us  x{len(times) // 10}  {kernel[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="512,8192")
    args = parser.parse_args()
    b, t = (int(x) for x in args.shape.split(","))
    logprob, old, adv, mask = ppo_inputs(b, t, seed=0)
    nominal_bytes = b * t * (4 + 4 + 4 + 1 + 4)
    print(f"policy_loss ppo fwd+bwd [{b}, {t}] fp32 on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    for name, fn in (("policy_loss + autograd.grad", step), ("policy_loss_and_grad", fused_step)):
        _report_step(name, fn, logprob, old, adv, mask, nominal_bytes)

    print("  host time per call of each layer (no synchronization, 500 calls each):")
    for name, fn in _layers(logprob, old, adv, mask):
        print(f"    {host_us(fn):8.1f} us  {name}")

    n = 200
    for name, fn in (("policy_loss + autograd.grad", step), ("policy_loss_and_grad", fused_step)):
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(n):
            fn(logprob, old, adv, mask)
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(f"  {name}: host functions over {n} steps, by own time (cProfile adds its own overhead):")
        print(text.getvalue())


if __name__ == "__main__":
    main()
