"""Compile the Triton kernels that CPU tests launch for a real GPU target, without a GPU.

Under ``TRITON_INTERPRET=1`` a kernel runs as Python and is never compiled, so an error that only the
compiler sees (a constexpr default it cannot lower, an unsupported op, a type mismatch the
interpreter's numpy tolerates) first shows on the GPU. This module closes that gap:

* :func:`record_launches` (in the interpreting process): records every kernel launch inside the ``with`` block:
  the kernel's module and name, each argument's Triton type (a tensor's pointer type, a host TMA descriptor's
  ``tensordesc<dtype[box]>``, ``i32`` / ``i64`` / ``fp32`` / ``i1`` scalars) or, for ``tl.constexpr`` parameters
  and ``None``, its value, and ``num_warps`` / ``num_stages`` (a launch with an argument it cannot type is
  recorded as left out, and the compile step lists it). The repository's ``conftest.py`` records a whole pytest
  session this way when ``RLK_RECORD_TRITON_LAUNCHES=<dir>`` is set (one JSON file per worker); ``ci/test.sh``
  does.
* ``python tools/triton_aot_check.py RECORDS.json... [--arch 90 80 gfx942 gfx90a]`` (a process WITHOUT
  ``TRITON_INTERPRET``, where ``@triton.jit`` gives real ``JITFunction`` objects): compiles each
  distinct record with ``triton.compile`` for each arch given, prints one line per failure and a summary per
  arch; exit status 1 if any failed.

  - A number is a CUDA compute capability: ``GPUTarget("cuda", arch, 32)`` (Triton's own LLVM and ptxas: no
    driver, no GPU); a kernel with TMA descriptors only from sm_90.
  - A ``gfx`` name is an AMD GPU: ``GPUTarget("hip", arch, 64)`` for CDNA (``gfx942``, ``gfx90a``: wavefronts of
    64 lanes, so a record's ``num_warps`` means ``64 * num_warps`` threads), through the AMD backend Triton's wheel
    carries (its LLVM and ``ld.lld``: no ROCm, no GPU). Every record, the TMA descriptor kernels too (the AMD
    backend lowers a descriptor to plain loads and stores), without the CUDA-only launch options ``maxnreg`` and
    ``launch_pdl`` (rlk passes them on NVIDIA GPUs only).
  - A compiled kernel that needs more threads or shared memory per block than the target has fails too (the
    launch, not the compiler, would raise it).
  - Records are deduplicated first: each distinct (kernel, signature, constexprs, options) is compiled once per
    arch, ``--jobs`` processes at a time (default: the CPUs).

Specialization attributes (16-byte alignment, integers equal to 1) are not recorded: they change
the generated code, not whether it compiles. Only the kernels of ``--packages`` (default rlk and
rlk_triton) are compiled: a kernel defined in a test module is not importable by name.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import sys
from collections.abc import Iterator

_TORCH_TO_TRITON = {
    "torch.float32": "fp32",
    "torch.float16": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float64": "fp64",
    "torch.int8": "i8",
    "torch.uint8": "u8",
    "torch.int16": "i16",
    "torch.int32": "i32",
    "torch.int64": "i64",
    "torch.bool": "i1",
}


def _arg_type(value) -> tuple[str, object]:
    """("type", Triton type) for a runtime argument, ("value", value) for one compiled in as a constant."""
    import torch

    if value is None:
        return "value", None
    if isinstance(value, torch.Tensor):
        return "type", "*" + _TORCH_TO_TRITON[str(value.dtype)]
    if type(value).__name__ == "TensorDescriptor":  # a host-side TMA descriptor: its dtype and box
        return "type", f"tensordesc<{_TORCH_TO_TRITON[str(value.base.dtype)]}{list(value.block_shape)}>"
    if isinstance(value, bool):
        return "type", "i1"
    if isinstance(value, int):
        return "type", "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "type", "fp32"
    raise TypeError(f"unsupported kernel argument {type(value).__name__}")


@contextlib.contextmanager
def record_launches(records: list[dict]) -> Iterator[list[dict]]:
    """Append one dict per interpreted kernel launch inside the block to ``records`` (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        params = list(inspect.signature(fn).parameters.values())
        bound = dict(zip((p.name for p in params), args))
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
        bound.update(kwargs)
        signature, constants = {}, {}
        for p in params:
            if p.name not in bound:
                continue
            value = bound[p.name]
            if "constexpr" in str(p.annotation):
                if not isinstance(value, (bool, int, float, str, type(None))):  # e.g. a tl.dtype
                    records.append(
                        {
                            "module": fn.__module__,
                            "kernel": fn.__name__,
                            "left_out": f"constexpr {p.name} of type {type(value).__name__}",
                        }
                    )
                    return original(self, *args, grid=grid, warmup=warmup, **kwargs, **options)
                constants[p.name] = value
                continue
            try:
                kind, what = _arg_type(value)
            except (TypeError, KeyError) as exc:  # an argument type this checker does not map
                records.append(
                    {
                        "module": fn.__module__,
                        "kernel": fn.__name__,
                        "left_out": f"argument {p.name}: {type(exc).__name__} {exc}",
                    }
                )
                return original(self, *args, grid=grid, warmup=warmup, **kwargs, **options)
            if kind == "value":
                constants[p.name] = what
            else:
                signature[p.name] = what
        records.append(
            {
                "module": fn.__module__,
                "kernel": fn.__name__,
                "signature": signature,
                "constants": constants,
                "options": options,
            }
        )
        return original(self, *args, grid=grid, warmup=warmup, **kwargs, **options)

    InterpretedFunction.run = run
    try:
        yield records
    finally:
        InterpretedFunction.run = original


def unique(records: list[dict]) -> list[dict]:
    """The distinct records, in first-seen order."""
    seen, out = set(), []
    for r in records:
        key = json.dumps(r, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def with_programmatic_launch(records: list[dict]) -> list[dict]:
    """``records`` and, for each with ``PDL_*`` constexprs (the switches of programmatic dependent launch, off under
    the interpreter, which cannot run ``griddepcontrol``), the specialization a GPU of compute capability 9.0 or
    later launches: each switch on, launched with ``launch_pdl``."""
    out = list(records)
    for r in records:
        switches = [name for name in r["constants"] if name.startswith("PDL_")]
        if switches:
            constants = dict(r["constants"], **{name: True for name in switches})
            out.append(dict(r, constants=constants, options=dict(r["options"], launch_pdl=True)))
    return unique(out)


def uses_tma(record: dict) -> bool:
    """Whether a record takes TMA descriptors (Hopper's tensor memory accelerator: compute capability 9.0 on)."""
    return any(str(t).startswith("tensordesc") for t in record["signature"].values())


#: Launch options of Triton's NVIDIA backend only, which rlk passes on NVIDIA GPUs only (``maxnreg``: policy_loss's
#: ``_register_limit``; ``launch_pdl``: its ``_programmatic_launch``); left out of the AMD compiles.
CUDA_ONLY_OPTIONS = ("maxnreg", "launch_pdl")

#: Shared memory (bytes) one block may use, per target (CUDA: the opt-in maximum; AMD: the LDS of a workgroup),
#: and threads per block. A compiled kernel above either fails at launch (Triton's ``OutOfResources``, or the
#: driver), not in the compiler.
MAX_SHARED = {
    "sm_80": 166912,
    "sm_86": 101376,
    "sm_89": 101376,
    "sm_90": 232448,
    "sm_100": 232448,
    "gfx90a": 65536,
    "gfx942": 65536,
    "gfx950": 163840,
}
MAX_THREADS = 1024


def target_of(arch: str | int) -> tuple[str, int | str, int]:
    """``(backend, arch, warp size)`` of an ``--arch`` value: ``"90"`` is ``("cuda", 90, 32)``, ``"gfx942"``
    ``("hip", "gfx942", 64)`` (wavefront 64 below gfx10, i.e. CDNA and GCN; 32 on RDNA, as Triton's AMD backend)."""
    arch = str(arch)
    if arch.isdigit():
        return "cuda", int(arch), 32
    if arch.startswith("gfx") and len(arch) > 5:
        return "hip", arch, 64 if int(arch[3:-2]) < 10 else 32
    raise ValueError(f"unknown arch {arch!r}: a CUDA compute capability (90, 80) or an AMD gfx name (gfx942)")


def label(arch: str | int) -> str:
    """``sm_90`` / ``gfx942``: how the output names a target."""
    backend, name, _ = target_of(arch)
    return f"sm_{name}" if backend == "cuda" else str(name)


def compiled_for(records: list[dict], arch: str | int) -> list[dict]:
    """The records compiled for ``arch``: for CUDA from sm_90 on all, with :func:`with_programmatic_launch`'s
    variants, below sm_90 those without TMA descriptors (rlk launches a TMA kernel only on a GPU of 9.0 or later);
    for AMD all, without the :data:`CUDA_ONLY_OPTIONS` (deduplicated again: two records may differ only there)."""
    backend, number, _ = target_of(arch)
    if backend == "hip":
        return unique(
            [dict(r, options={k: v for k, v in r["options"].items() if k not in CUDA_ONLY_OPTIONS}) for r in records]
        )
    return with_programmatic_launch(records) if number >= 90 else [r for r in records if not uses_tma(r)]


def _launch_problem(kernel, arch: str | int) -> str | None:
    """Why a compiled kernel would not launch on ``arch`` (too many threads or too much shared memory per block),
    or None."""
    _, _, warp = target_of(arch)
    threads = kernel.metadata.num_warps * warp
    if threads > MAX_THREADS:
        return f"{kernel.metadata.num_warps} warps of {warp} = {threads} threads per block, at most {MAX_THREADS}"
    limit = MAX_SHARED.get(label(arch))
    if limit is not None and kernel.metadata.shared > limit:
        return f"{kernel.metadata.shared} bytes of shared memory per block, {label(arch)} has {limit}"
    return None


def _compile_one(r: dict, arch: str | int) -> str | None:
    """Compile one record for ``arch``; None, or its failure as a ``module.kernel(constants): error`` line."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget(*target_of(arch))
    fn = getattr(importlib.import_module(r["module"]), r["kernel"])
    signature = {
        name: "constexpr" if name in r["constants"] else r["signature"][name]
        for name in fn.arg_names
        if name in r["signature"] or name in r["constants"]
    }
    try:
        src = ASTSource(fn=fn, signature=signature, constexprs=dict(r["constants"]))
        problem = _launch_problem(triton.compile(src, target=target, options=r["options"]), arch)
    except Exception as exc:  # report every failure, not just the first
        first = str(exc).strip().splitlines()
        return f"{r['module']}.{r['kernel']}({r['constants']}): {type(exc).__name__}: {' | '.join(first[-3:])}"
    if problem is not None:
        return f"{r['module']}.{r['kernel']}({r['constants']}, {r['options']}): does not launch: {problem}"
    return None


def _compile_job(job: tuple[dict, str | int]) -> str | None:
    return _compile_one(*job)


def compile_records(records: list[dict], arch: str | int, pool=None) -> list[str]:
    """Compile each record of :func:`compiled_for` for ``arch`` (in ``pool``'s processes, an ``Executor``, when
    given); the failures as ``module.kernel(constants): error`` lines, in record order."""
    jobs = [(r, arch) for r in compiled_for(records, arch)]
    # small chunks: a worker that drew the long compiles (attention, the GEMMs) does not hold up the end
    results = map(_compile_job, jobs) if pool is None else pool.map(_compile_job, jobs, chunksize=4)
    return [line for line in results if line is not None]


def _pool(jobs: int):
    """``jobs`` compiler processes (a fresh interpreter each, spawned: no forked LLVM state), or None for one."""
    if jobs <= 1:
        return contextlib.nullcontext()
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))


def main(argv: list[str]) -> int:
    import argparse
    import os
    import time

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="+", help="JSON lists written from record_launches")
    parser.add_argument(
        "--arch",
        nargs="+",
        default=["90"],
        type=str,
        help="CUDA compute capabilities (90 80) and / or AMD gfx names (gfx942 gfx90a)",
    )
    parser.add_argument(
        "--packages",
        default="rlk,rlk_triton",
        help="top-level packages whose kernels are compiled (others, e.g. kernels defined in tests, are left out)",
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes at a time (default: the CPUs)"
    )
    args = parser.parse_args(argv)
    for arch in args.arch:
        try:
            target_of(arch)
        except ValueError as exc:
            parser.error(str(exc))
    packages = set(args.packages.split(","))
    records = []
    for path in args.records:
        with open(path) as f:
            records += json.load(f)
    records = unique([r for r in records if r["module"].split(".")[0] in packages])
    left_out = [r for r in records if "left_out" in r]
    records = [r for r in records if "left_out" not in r]
    failed = False
    summary = []
    with _pool(args.jobs) as pool:  # one set of workers for every arch
        for arch in args.arch:
            start = time.monotonic()
            failures = compile_records(records, arch, pool)
            seconds = time.monotonic() - start
            n = len(compiled_for(records, arch))
            name, tma = label(arch), sum(map(uses_tma, records))
            below_sm90 = target_of(arch)[0] == "cuda" and int(arch) < 90
            note = f" ({tma} with TMA descriptors left out below sm_90)" if below_sm90 else ""
            print(f"compiled {n - len(failures)} of {n} kernel specializations for {name}{note}", flush=True)
            for line in failures:
                print(f"FAILED {name}", line)
            summary.append(f"{name}: {n - len(failures)}/{n} compiled ({seconds:.0f} s)")
            failed = failed or bool(failures)
    for r in left_out:
        print(f"left out (not typed by this checker): {r['module']}.{r['kernel']}: {r['left_out']}")
    print("summary:", "; ".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
