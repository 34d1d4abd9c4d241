"""Tile sweep of the Triton policy-loss kernels on a CUDA machine: any of ``rlk_triton.policy_loss``'s constants.

For each point of the grid given by ``--grid NAME=v1,v2 ...`` (constants of ``rlk_triton.policy_loss``:
``BLOCK_T``, ``NUM_WARPS``, ``COUNT_PROGRAMS``, ``MAX_REGISTERS``, ``COMBINE_BLOCK``, ``FINISH_WARPS``,
``PROGRAMMATIC_LAUNCH``...; default ``BLOCK_T=1024,2048,4096 NUM_WARPS=4,8``) it runs the benchmark's PPO step on
``[B, T]`` fp32 tokens (verl's defaults, token-mean: the mask-count kernel runs) through
``rlk.policy_loss_and_grad`` and through ``rlk.policy_loss`` + ``autograd.grad``, and prints the GPU time of each
kernel (``torch.profiler``), the GPU busy time of a step (the union of its kernels' intervals: the benchmark's
kernel time, ``device_ms`` of ``bench_asv/benchmarks/common.py``; below the sum of the kernel times when kernels
overlap under programmatic dependent launch) and its share of the copy bandwidth measured in the same run (17 bytes
credited per token, as ``bench_asv/benchmarks/rl_objectives.py``), and the time per step of a CUDA graph of
``GRAPH_STEPS`` steps (no host time; the gaps between kernels included) and per step when ``GRAPH_STEPS`` steps queue
up behind a busy GPU (as in training), each next to the same measurement of same-size copies. The gradients must
be the same bits under every configuration (each token's gradient depends on no tile size); the loss may differ in
its last bits (the chunk sums change with ``BLOCK_T``).

``--global-tokens`` passes the batch's token count as ``global_tokens`` (what a trainer with micro-batches or
data-parallel ranks passes: RL_MATH.md's global normalizers): no count kernel.

    python tools/sweep_policy_loss.py [--shape 512,8192] [--global-tokens] [--grid BLOCK_T=2048 NUM_WARPS=4]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
from profile_policy_loss import ppo_inputs  # tools/, next to this script
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench_asv"))
from benchmarks.common import copy_gbps, device_ms, median_ms  # noqa: E402  (the benchmark's measurements)

import rlk
from rlk_triton import policy_loss as tk

CLIP, DUAL_CLIP, CLAMP = 0.2, 3.0, 20.0
KWARGS = dict(loss="ppo", clip_low=CLIP, dual_clip=DUAL_CLIP, clamp_log_ratio=CLAMP, agg="token-mean")


GRAPH_STEPS = 20


def kernel_us(fn, repeats: int = 20) -> tuple[dict[str, float], float]:
    """Microseconds per step of each CUDA kernel ``fn()`` launches, and the GPU busy time per step (``torch.profiler``;
    steps never overlap: each waits for the host)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.split("(")[0].removeprefix("void ")[:40]
            per_kernel[name] = per_kernel.get(name, 0.0) + e.device_time_total / repeats
    return per_kernel, device_ms(prof) * 1e3 / repeats


def queued_us(fn, repeats: int = 5) -> float:
    """Microseconds per step when ``GRAPH_STEPS`` calls queue up behind a busy GPU (the host ahead of it, as in
    training): a sleep kernel holds the stream while they are launched, then they run back to back (median of
    ``repeats``). Raises if the sleep ended before the last launch (the time would include the host's)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU clock cycles
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(GRAPH_STEPS):
            fn()
        end.record()
        if start.query():
            raise RuntimeError("the sleep kernel ended before the steps were queued: raise its cycle count")
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_STEPS)
    return sorted(times)[len(times) // 2]


def graph_us(fn, repeats: int = 10) -> float:
    """Microseconds per step of a CUDA graph of ``GRAPH_STEPS`` calls of ``fn()`` (median of ``repeats`` replays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_STEPS):
            fn()
    return median_ms(graph.replay, warmup=2, repeats=repeats) * 1e3 / GRAPH_STEPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="512,8192")
    parser.add_argument("--global-tokens", action="store_true", help="pass the token count as global_tokens")
    parser.add_argument(
        "--grid",
        nargs="*",
        default=["BLOCK_T=1024,2048,4096", "NUM_WARPS=4,8"],
        help="NAME=v1,v2 for constants of rlk_triton.policy_loss (integers or strings)",
    )
    args = parser.parse_args()
    b, t = (int(x) for x in args.shape.split(","))
    logprob, old, adv, mask = ppo_inputs(b, t, seed=1234)
    kwargs = dict(KWARGS, global_tokens=float(mask.sum())) if args.global_tokens else KWARGS
    credited = b * t * 17
    copy = copy_gbps()
    same_size = torch.empty(credited // 8, dtype=torch.float32, device="cuda")  # read + write = the credited bytes
    same_size_us = kernel_us(lambda: same_size.clone())[1]
    same_size_graph_us = graph_us(lambda: same_size.clone())
    same_size_queued_us = queued_us(lambda: same_size.clone())
    given = " (global_tokens given)" if args.global_tokens else ""
    print(
        f"policy-loss tile sweep, [{b}, {t}] fp32 PPO token-mean{given}, {torch.cuda.get_device_name()}, torch "
        f"{torch.__version__}; copy {copy:.0f} GB/s; share = {credited / 2**20:.0f} MiB / busy time / copy"
    )
    print(
        f"a copy moving the credited bytes takes {same_size_us:.1f} us of kernel time = "
        f"{credited / (same_size_us * 1e-6) / 1e9 / copy:.1%} of the 1 GiB copy rate; "
        f"{same_size_graph_us:.1f} us per step in a CUDA graph of {GRAPH_STEPS}, {same_size_queued_us:.1f} us queued"
    )

    def fused():
        return rlk.policy_loss_and_grad(logprob, old, adv, mask, **kwargs)

    def autograd():
        value, _ = rlk.policy_loss(logprob, old, adv, mask, **kwargs)
        return torch.autograd.grad(value, logprob)[0]

    axes = []
    for spec in args.grid:
        name, values = spec.split("=", 1)
        if not hasattr(tk, name):
            parser.error(f"rlk_triton.policy_loss has no constant {name}")
        axes.append([(name, int(v) if v.lstrip("-").isdigit() else v) for v in values.split(",")])
    defaults = {name: getattr(tk, name) for name in (axis[0][0] for axis in axes)}
    first = None
    with rlk.use_backend("triton"):
        for point in itertools.product(*axes):
            for name, value in point:
                setattr(tk, name, value)
            label = " ".join(
                f"{name}={value!r}" if isinstance(value, str) else f"{name}={value}" for name, value in point
            )
            out = fused()
            grad = autograd()
            same = torch.equal(out.grad_logprob, grad)
            if first is None:
                first = (out.loss, grad)
            same_first = torch.equal(first[1], grad)
            loss_rel = abs(float(out.loss) - float(first[0])) / max(abs(float(first[0])), 1e-30)
            for name, fn in (("policy_loss_and_grad", fused), ("policy_loss + autograd", autograd)):
                kernels, busy = kernel_us(fn)
                share = credited / (busy * 1e-6) / 1e9 / copy
                detail = ", ".join(f"{k} {v:.1f}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]))
                graph, queued = graph_us(fn), queued_us(fn)
                print(
                    f"{label}  {name:22s} busy {busy:6.1f} us = {share:6.1%} of copy (kernels summed "
                    f"{sum(kernels.values()):.1f}; graph {graph:.1f} us/step = {same_size_graph_us / graph:.1%} of "
                    f"the copy's; queued {queued:.1f} us/step = {same_size_queued_us / queued:.1%})  [{detail}]"
                )
            print(
                f"    gradients: fused == autograd {same}; == first point {same_first}; "
                f"loss vs first point: rel {loss_rel:.1e}"
            )
    for name, value in defaults.items():
        setattr(tk, name, value)


if __name__ == "__main__":
    main()
