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
* ``python tools/triton_aot_check.py RECORDS.json... [--arch 90 80]`` (a process WITHOUT
  ``TRITON_INTERPRET``, where ``@triton.jit`` gives real ``JITFunction`` objects): compiles each
  distinct record with ``triton.compile`` for ``GPUTarget("cuda", arch, 32)``, each arch given (Triton's own LLVM and
  ptxas: no driver, no GPU; a kernel with TMA descriptors only from sm_90) and prints one line per failure; exit
  status 1 if any failed.

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
    "torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float64": "fp64",
    "torch.int8": "i8", "torch.uint8": "u8", "torch.int16": "i16", "torch.int32": "i32", "torch.int64": "i64",
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
                    records.append({"module": fn.__module__, "kernel": fn.__name__,
                                    "left_out": f"constexpr {p.name} of type {type(value).__name__}"})
                    return original(self, *args, grid=grid, warmup=warmup, **kwargs, **options)
                constants[p.name] = value
                continue
            try:
                kind, what = _arg_type(value)
            except (TypeError, KeyError) as exc:  # an argument type this checker does not map
                records.append({"module": fn.__module__, "kernel": fn.__name__,
                                "left_out": f"argument {p.name}: {type(exc).__name__} {exc}"})
                return original(self, *args, grid=grid, warmup=warmup, **kwargs, **options)
            if kind == "value":
                constants[p.name] = what
            else:
                signature[p.name] = what
        records.append({"module": fn.__module__, "kernel": fn.__name__, "signature": signature,
                        "constants": constants, "options": options})
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


def compiled_for(records: list[dict], arch: int) -> list[dict]:
    """The records compiled for ``sm_arch``: from 90 on all, with :func:`with_programmatic_launch`'s variants;
    below 90 those without TMA descriptors (rlk launches a TMA kernel only on a GPU of 9.0 or later)."""
    return with_programmatic_launch(records) if arch >= 90 else [r for r in records if not uses_tma(r)]


def compile_records(records: list[dict], arch: int) -> list[str]:
    """Compile each record for ``cuda:arch`` (from sm_90 on also :func:`with_programmatic_launch`'s variants); the
    failures as ``module.kernel(constants): error`` lines."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    failures = []
    for r in compiled_for(records, arch):
        fn = getattr(importlib.import_module(r["module"]), r["kernel"])
        signature = {name: "constexpr" if name in r["constants"] else r["signature"][name]
                     for name in fn.arg_names if name in r["signature"] or name in r["constants"]}
        try:
            src = ASTSource(fn=fn, signature=signature, constexprs=dict(r["constants"]))
            triton.compile(src, target=target, options=r["options"])
        except Exception as exc:  # report every failure, not just the first
            first = str(exc).strip().splitlines()
            failures.append(f"{r['module']}.{r['kernel']}({r['constants']}): {type(exc).__name__}: "
                            f"{' | '.join(first[-3:])}")
    return failures


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="+", help="JSON lists written from record_launches")
    parser.add_argument("--arch", type=int, nargs="+", default=[90], help="CUDA compute capabilities, e.g. 90 80")
    parser.add_argument("--packages", default="rlk,rlk_triton",
                        help="top-level packages whose kernels are compiled (others, e.g. kernels defined in tests, "
                             "are left out)")
    args = parser.parse_args(argv)
    packages = set(args.packages.split(","))
    records = []
    for path in args.records:
        with open(path) as f:
            records += json.load(f)
    records = unique([r for r in records if r["module"].split(".")[0] in packages])
    left_out = [r for r in records if "left_out" in r]
    records = [r for r in records if "left_out" not in r]
    failed = False
    for arch in args.arch:
        failures = compile_records(records, arch)
        n = len(compiled_for(records, arch))
        tma = "" if arch >= 90 else f" ({sum(map(uses_tma, records))} with TMA descriptors left out below sm_90)"
        print(f"compiled {n - len(failures)} of {n} kernel specializations for sm_{arch}{tma}")
        for line in failures:
            print(f"FAILED sm_{arch}", line)
        failed = failed or bool(failures)
    for r in left_out:
        print(f"left out (not typed by this checker): {r['module']}.{r['kernel']}: {r['left_out']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
