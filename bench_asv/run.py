"""Run the rlk benchmarks without asv: a Markdown table on stdout, JSON with ``--out``.

Every point of the asv suite's classes listed in ``OPS`` (each module's docstring defines what is
measured and the work credited) runs through the same ``Case`` class asv uses, in one process, after
measuring the machine's ceilings (a square matmul's TFLOP/s and a device-to-device copy's GB/s). Each
row reports the achieved rate as a fraction of its ceiling (TFLOP/s of the matmul for compute-bound
ops, GB/s of the copy for memory-bound ones) and the speedup over each of the class's baselines at
the same point (their time over this row's time).

Usage::

    python bench_asv/run.py                      # the full suite on a GPU (bf16, headline shapes)
    python bench_asv/run.py --quick              # tiny float32 shapes (also what runs without a GPU)
    python bench_asv/run.py --only linear --out out/bench

``RLK_BACKEND=<name>`` pins rlk's backend; ``RLK_REQUIRE_GPU=1`` refuses to run without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import itertools
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# --only key -> (module of bench_asv/benchmarks, asv class); each class names its Case type.
OPS = {
    "linear": ("logprob", "LinearLogprob"),
    "selected": ("logprob", "SelectedLogprob"),
    "policy_loss": ("rl_objectives", "PolicyLoss"),
    "gae": ("rl_objectives", "Gae"),
    "rollout_correction": ("rl_objectives", "RolloutCorrection"),
    "scatter_rewards": ("rewards", "ScatterRewards"),
    "fused_linear_policy_loss": ("rl_objectives", "FusedLinearPolicyLoss"),
    "fused_linear_kl": ("distill", "FusedLinearKL"),
    "rms_norm": ("norm", "RmsNorm"),
    "matmul": ("matmul", "Matmul"),
    "attention": ("attention", "Attention"),
    "chain": ("chain", "ChainForward"),
    "prefix_sharing": ("prefix_sharing", "PrefixSharing"),
    "pack": ("pack", "Pack"),
    "span_logprob": ("multimodal", "SpanLogprob"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny float32 shapes (sets RLK_BENCH_QUICK=1)")
    parser.add_argument("--only", choices=sorted(OPS), help="run one op's benchmarks")
    parser.add_argument("--out", type=Path, help="directory for bench.json and bench.md")
    parser.add_argument("--shape", help="run only this shape, e.g. 16384,4096,151936 (linear) or 16384,151936")
    return parser.parse_args()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def environment(common) -> dict:
    """Hardware, versions and the command line of this run."""
    if common.DEVICE.type == "cuda":
        device = torch.cuda.get_device_name(common.DEVICE)
    else:
        device = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "rlk": _version("rlk"),
        "rlk_triton": _version("rlk-triton"),
        "git_commit": _git_commit(),
        "command": shlex.join(["python", *sys.argv]),
        "rlk_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("RLK_")},
        "quick": common.QUICK,
        "warmup": common.WARMUP,
        "repeats": common.REPEATS,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def measure_point(cls, impl: str, option, shape: tuple[int, ...]) -> dict:
    """One row: time, rate and (on a GPU) peak extra memory, or the out-of-memory status."""
    row = {
        "op": cls.op,
        "impl": impl,
        "option_name": cls.param_names[1],
        "option": option,
        "shape_names": cls.shape_names,
        "baselines": list(getattr(cls, "baselines", ("torch_compile", "torch_eager"))),
        "shape": list(shape),
        "backend": None,
        "status": "ok",
        "ms": None,
        "kernel_ms": None,
        "rate": None,
        "unit": None,
        "peak_extra_mib": None,
    }
    case = None
    try:
        case = cls.case_type(cls.op, impl, option, shape)
        row["ms"], row["rate"], row["unit"] = case.ms(), case.rate(), case.unit
        if case.decision is not None:
            row["backend"], row["rlk_explain"] = case.decision.backend, str(case.decision)
        if torch.cuda.is_available():
            row["kernel_ms"] = case.kernel_ms()
            row["peak_extra_mib"] = case.peak_extra_mib()
    except torch.OutOfMemoryError:
        row["status"] = "OOM"
    except Exception as exc:  # keep the other points of a long GPU run; main() exits non-zero
        row["status"] = f"error: {type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        del case
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def add_ratios(rows: list[dict], ceilings: dict) -> None:
    """Fraction of the ceiling, and time and memory against each baseline at the same point.

    ``speedup_vs_<base>`` is the baseline's ms over this row's ms; ``memory_vs_<base>`` this row's
    peak extra MiB over the baseline's. With GPU kernel times, ``kernel_of_ceiling`` is the rate over
    the kernel time as a fraction of the ceiling and ``kernel_speedup_vs_<base>`` the ratio of kernel
    times (what the kernels do, without host overhead).
    """
    by_point = {(r["op"], tuple(r["shape"]), r["option"], r["impl"]): r for r in rows}
    for row in rows:
        if row["status"] != "ok":
            continue
        ceiling = {"TFLOP/s": ceilings["matmul_tflops"], "GB/s": ceilings["copy_gbps"]}.get(row["unit"])
        row["of_ceiling"] = row["rate"] / ceiling if ceiling else None  # None for a rate without a ceiling (tokens/s)
        kernel = row.get("kernel_ms")
        row["kernel_of_ceiling"] = row["of_ceiling"] * row["ms"] / kernel if kernel and ceiling else None
        for base in row["baselines"]:
            other = by_point.get((row["op"], tuple(row["shape"]), row["option"], base))
            ok = other is not None and other["status"] == "ok"
            row[f"speedup_vs_{base}"] = other["ms"] / row["ms"] if ok else None
            both = ok and kernel and other.get("kernel_ms")
            row[f"kernel_speedup_vs_{base}"] = other["kernel_ms"] / kernel if both else None
            mib = row["peak_extra_mib"]
            # a baseline that allocates nothing extra (e.g. cuBLAS writing an 8 KiB output) has no ratio
            base_mib = other["peak_extra_mib"] if ok else None
            row[f"memory_vs_{base}"] = mib / base_mib if mib is not None and base_mib else None


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def markdown(rows: list[dict], ceilings: dict, env: dict) -> str:
    """The results as a Markdown report: environment, ceilings, one table row per point."""
    lines = [
        f"rlk benchmarks: {env['device']}, torch {env['torch']}, triton {env['triton']}, "
        f"rlk {env['rlk']}, rlk-triton {env['rlk_triton']}; median of {env['repeats']} after {env['warmup']} warm-up",
        f"command: `{env['command']}`",
        "",
        f"ceilings: matmul {ceilings['matmul_n']}^3 {ceilings['matmul_dtype']} "
        f"{ceilings['matmul_tflops']:.3g} TFLOP/s; copy {ceilings['copy_bytes'] / 2**20:.0f} MiB "
        f"{ceilings['copy_gbps']:.3g} GB/s (read + write)",
        "rates credit every impl of a point with the same nominal work (each benchmark module's docstring "
        "gives it: linear_logprob 8NHV FLOPs although the torch baselines do 6NHV; fused_linear_policy_loss "
        "6NHV although its lean mode does 8NHV; selected_logprob 3NV*itemsize bytes); "
        "time x = baseline ms / row ms (above 1: faster); memory x = row MiB / baseline MiB. "
        "ms: one step timed by CUDA events on an idle device (includes the host time the GPU waits for); "
        "kernel ms: the GPU time of the step's kernels (torch.profiler; time in which two overlap counted once), "
        "which the kernel columns use",
        "",
        "| op | impl | shape | option | ms | rate | of ceiling | kernel ms | kernel of ceiling | peak extra MiB "
        "| time x vs baselines | kernel time x vs baselines | memory x vs baselines |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        impl = f"{r['impl']} ({r['backend']})" if r["backend"] else r["impl"]
        shape = " ".join(f"{k}={v}" for k, v in zip(r["shape_names"], r["shape"]))
        head = f"| {r['op']} | {impl} | {shape} | {r['option_name']}={r['option']} |"
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']} | | | | | | | | |")
            continue
        speedups = ", ".join(f"{b} {_fmt(r[f'speedup_vs_{b}'], '.2f', 'x')}" for b in r["baselines"] if b != r["impl"])
        kernel_speedups = ", ".join(
            f"{b} {_fmt(r.get(f'kernel_speedup_vs_{b}'), '.2f', 'x')}" for b in r["baselines"] if b != r["impl"]
        )
        memory = ", ".join(f"{b} {_fmt(r[f'memory_vs_{b}'], '.2f', 'x')}" for b in r["baselines"] if b != r["impl"])
        lines.append(
            f"{head} {r['ms']:.3f} | {r['rate']:.3g} {r['unit']} | {_fmt(r['of_ceiling'], '.1%')} "
            f"| {_fmt(r.get('kernel_ms'), '.3f')} | {_fmt(r.get('kernel_of_ceiling'), '.1%')} "
            f"| {_fmt(r['peak_extra_mib'], '.0f')} | {speedups} | {kernel_speedups} | {memory} |"
        )
    return "\n".join(lines) + "\n"


def save(out: Path, env: dict, ceilings: dict, rows: list[dict]) -> None:
    """Write ``bench.json`` (everything) and ``bench.md`` (the report) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    document = {"env": env, "ceilings": ceilings, "results": rows}
    (out / "bench.json").write_text(json.dumps(document, indent=2) + "\n")
    (out / "bench.md").write_text(markdown(rows, ceilings, env))


def main() -> None:
    args = parse_args()
    if args.quick:
        os.environ["RLK_BENCH_QUICK"] = "1"
    if os.environ.get("RLK_REQUIRE_GPU") == "1" and not torch.cuda.is_available():
        sys.exit("RLK_REQUIRE_GPU=1 but torch sees no GPU")
    sys.path.insert(0, str(HERE))
    from benchmarks import common

    env = environment(common)
    print(f"device: {env['device']}; measuring ceilings", file=sys.stderr)
    ceilings = {
        "matmul_n": common.MATMUL_N,
        "matmul_dtype": str(common.MATMUL_DTYPE).removeprefix("torch."),
        "matmul_tflops": common.matmul_tflops(),
        "copy_bytes": common.COPY_BYTES,
        "copy_gbps": common.copy_gbps(),
    }
    rows = []
    for key in [args.only] if args.only else list(OPS):
        module, name = OPS[key]
        cls = getattr(importlib.import_module(f"benchmarks.{module}"), name)
        for impl, option, shape in itertools.product(*cls.params):
            if args.shape and shape != tuple(int(x) for x in args.shape.split(",")):
                continue
            row = measure_point(cls, impl, option, shape)
            print(
                f"{cls.op} {impl} {cls.param_names[1]}={option} {shape}: {row['status']} "
                f"{_fmt(row['ms'], '.3f', ' ms')}",
                file=sys.stderr,
            )
            rows.append(row)
            add_ratios(rows, ceilings)
            if args.out:  # after every point, so a run cut short keeps what it measured
                save(args.out, env, ceilings, rows)
    print(markdown(rows, ceilings, env))
    if args.out:
        print(f"wrote {args.out / 'bench.json'} and {args.out / 'bench.md'}", file=sys.stderr)
    if any(r["status"].startswith("error") for r in rows):
        sys.exit("some points failed (status 'error' above)")


if __name__ == "__main__":
    main()
