"""Host cost of one Triton kernel launch on this machine, and how much of it a cached direct launch saves.

rlk's small ops are host-bound on the H200 host (``tools/profile_policy_loss.py``: about 45 us per Triton
launch). This measures, for a trivial elementwise kernel with few and with many arguments:

* ``kernel[grid](...)``: Triton's normal path (``JITFunction.run``: binder, specialization, cache key,
  launch metadata, then the C launcher);
* ``compiled[grid](...)``: the ``CompiledKernel`` the first launch returned, launched directly (skips the
  binder and the cache lookup; the caller must guarantee the same specialization: dtypes, 16-byte alignment,
  integer values 1 / divisible by 16);
* a torch elementwise op of the same size, for reference.

It informs whether a launch cache in ``rlk_triton`` is worth its risk; it changes nothing in rlk.

    python tools/profile_launch.py      (CUDA machine)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from profile_policy_loss import host_us  # tools/, next to this script


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)


@triton.jit
def _add_kernel_many_args(
    x_ptr,
    y_ptr,
    out_ptr,
    n,
    a0,
    a1,
    a2,
    a3,
    a4,
    a5,
    a6,
    a7,
    a8,
    a9,
    s0,
    s1,
    s2,
    s3,
    BLOCK: tl.constexpr,
    FLAG: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m)
    if FLAG:
        v = v * a0 + a1 + s0
    tl.store(out_ptr + offs, v, mask=m)


def main() -> None:
    n = 4096
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.empty_like(x)
    grid = (triton.cdiv(n, 1024),)
    floats = [0.5 + i for i in range(10)]
    ints = [3, 5, 7, 9]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    cases = {
        # the direct runner takes every argument in signature order, constexprs included
        "few args": (
            lambda: _add_kernel[grid](x, y, out, n, BLOCK=1024),
            _add_kernel[grid](x, y, out, n, BLOCK=1024),
            (x, y, out, n, 1024),
        ),
        "18 args": (
            lambda: _add_kernel_many_args[grid](x, y, out, n, *floats, *ints, BLOCK=1024, FLAG=True),
            _add_kernel_many_args[grid](x, y, out, n, *floats, *ints, BLOCK=1024, FLAG=True),
            (x, y, out, n, *floats, *ints, 1024, True),
        ),
    }
    for name, (normal, compiled, runtime_args) in cases.items():
        normal_us = host_us(normal, n=2000)
        normal()  # this case's result (`out` is shared by the cases: the last launch wrote it)
        expected = out.clone()
        try:
            runner = compiled[(grid[0], 1, 1)]  # CompiledKernel wants a 3-D grid
            out.zero_()
            runner(*runtime_args)
            torch.cuda.synchronize()
            same = torch.equal(out, expected)
            direct_us = host_us(lambda runner=runner, args=runtime_args: runner(*args), n=2000)
            direct = f"{direct_us:7.1f} us (same result: {same})"
        except Exception as exc:  # the CompiledKernel API differs across Triton versions
            direct = f"unavailable ({type(exc).__name__}: {exc})"
        print(f"{name:9s}: kernel[grid](...) {normal_us:7.1f} us; compiled[grid](...) {direct}")
    print(f"torch x + y (same size): {host_us(lambda: torch.add(x, y, out=out), n=2000):7.1f} us")


if __name__ == "__main__":
    main()
