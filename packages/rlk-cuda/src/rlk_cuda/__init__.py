"""rlk-cuda: the native CUDA backend of rlk (distributions ``rlk-cuda12`` and ``rlk-cuda13``, both
importing ``rlk_cuda``).

rlk finds it through the entry point ``rlk.backends: cuda = rlk_cuda:backend``. The kernels are CUDA
C++ (``csrc/*.cuh``) behind a thin nanobind layer (``rlk_cuda._C``): tensors travel through DLPack,
outputs are caller-allocated, the stream is torch's current stream passed as an integer, and nothing
links libtorch, so one wheel serves every torch version. Every kernel is batch-invariant by
construction (fixed block sizes, a fixed element-to-thread map, fixed-order reductions, no atomics).

Implemented primitives: ``selected_logprob_fwd/bwd``, ``linear_logprob_fwd/bwd`` and ``linear_logprob_stored_fwd/bwd``
(``logprob.py``; ``linear_logprob`` for float16 / bfloat16 only: ``supports`` declines float32, which falls through
to triton; the stored pair, ``fused_linear_policy_loss``'s one-pass mode, on the Hopper kernels only),
``rms_norm_fwd/bwd`` (``norm.py``), ``fused_linear_kl_fwd/bwd`` (``distill.py``; float16 / bfloat16 on the Hopper
kernels only). Every other op falls through to the next backend of the chain
(triton, reference).

Importing this package is cheap and never fails for a missing GPU or driver: the probe says why the
backend is unavailable (native module not importable, no driver, driver too old, no GPU, no kernel
image for the GPU's architecture, rlk version mismatch).
"""

from __future__ import annotations

import functools

__version__ = "0.1.0"

#: The rlk op ABI this backend implements (rlk.core.abi.ABI_VERSION it was written for); rlk refuses a
#: backend whose ABI differs from its own.
ABI_VERSION = 3

_DTYPE_NAMES = ("float32", "float16", "bfloat16")
#: Primitives with a tensor-core path only (mma.sync on 16-bit inputs): float32 falls through.
_HALF_ONLY = ("linear_logprob_", "fused_linear_kl_")


def _cuda_version(version: int) -> str:
    """``12040`` -> ``"12.4"``."""
    return f"{version // 1000}.{version % 1000 // 10}"


def version_problem(rlk_version: str) -> str | None:
    """None if this backend may run under rlk ``rlk_version``, else why not (the extras pin them exactly)."""
    if rlk_version == __version__:
        return None
    return (
        f"rlk-cuda {__version__} needs rlk {__version__}, found rlk {rlk_version}: install matching versions "
        f"(pip install 'rlk[cudaXYZ]=={rlk_version}' pins both)"
    )


@functools.cache
def _native_problem() -> str | None:
    """Why the native module cannot run anything here (import, build, driver, GPU), or None."""
    from rlk_cuda import _native

    if _native.C is None:
        return f"native module rlk_cuda._C failed to import: {_native.IMPORT_ERROR}"
    c = _native.C
    if c.__version__ != __version__:
        return f"native module is version {c.__version__}, the Python package {__version__}: a stale build, reinstall"
    runtime = c.runtime_version()
    driver = c.driver_version()
    if driver == 0:
        return "no NVIDIA driver found (libcuda.so.1 not loadable): no GPU on this machine?"
    if driver // 1000 < runtime // 1000:
        return (
            f"NVIDIA driver too old: it supports CUDA {_cuda_version(driver)}, {c.distribution} is built with "
            f"CUDA {_cuda_version(runtime)} and needs a driver for CUDA >= {runtime // 1000}.0 (update the driver, "
            f"or install rlk-cuda{driver // 1000} if there is one)"
        )
    if c.device_count() == 0:
        return "no CUDA GPU visible (CUDA_VISIBLE_DEVICES?)"
    return None


def _arch_problem(index: int) -> str | None:
    """Why the kernels cannot run on CUDA device ``index`` (architecture not compiled in), or None."""
    import torch

    from rlk_cuda import _native

    major, minor = torch.cuda.get_device_capability(index)
    archs = _native.C.compiled_architectures()
    if _native.compute_capability_served(archs, (major, minor)):
        return None
    return (
        f"GPU {index} ({torch.cuda.get_device_name(index)}) is sm_{major}{minor}; this build has kernels for "
        f"{', '.join(archs)} only (rebuild with RLK_CUDA_ARCHS={major}{minor})"
    )


@functools.cache
def _probe_cached() -> str | None:
    problem = _native_problem()
    if problem is not None:
        return problem
    import torch

    if torch.version.hip is not None:
        return f"torch {torch.__version__} is a ROCm build; rlk-cuda serves NVIDIA GPUs"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU (a CPU-only torch build?)"
    problems = [_arch_problem(i) for i in range(torch.cuda.device_count())]
    if all(problems):
        return problems[0]
    return None


def _probe() -> str | None:
    try:
        return _probe_cached()
    except Exception as exc:  # the probe must never raise
        return f"probe failed: {type(exc).__name__}: {exc}"


def _device_types() -> tuple[str, ...]:
    return ("cuda",) if _probe() is None else ()


@functools.cache
def _device_problem(index: int) -> str | None:
    return _arch_problem(index)


def _supports(primitive: str, device, dtype) -> str | None:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        return f"dtype {name} not supported (bfloat16, float16, float32)"
    if device.type != "cuda":
        return f"device type {device.type} not served (cuda only)"
    if name == "float32" and primitive.startswith(_HALF_ONLY):
        return f"{primitive}: float32 not implemented in rlk-cuda (tensor-core path for bfloat16 / float16 only)"
    import torch

    problem = _device_problem(torch.cuda.current_device() if device.index is None else device.index)
    if problem is None and primitive.startswith("linear_logprob_stored"):
        from rlk_cuda import logprob

        problem = logprob.stored_problem(device)
    if problem is None and primitive.startswith("fused_linear_kl_"):
        from rlk_cuda import distill

        problem = distill.problem(device)
    return problem


def backend():
    """The ``rlk.Backend`` of this package (entry-point factory)."""
    from rlk.core.abi import collect_primitives
    from rlk.core.backend import Backend
    from rlk.core.version import __version__ as rlk_version

    mismatch = version_problem(rlk_version)
    if mismatch is not None:
        return Backend(
            name="cuda",
            version=__version__,
            abi_version=ABI_VERSION,
            primitives={},
            probe=lambda: mismatch,
            device_types=lambda: (),
        )

    from rlk_cuda import distill, logprob, norm

    return Backend(
        name="cuda",
        version=__version__,
        abi_version=ABI_VERSION,
        primitives=collect_primitives(logprob, norm, distill),
        probe=_probe,
        device_types=_device_types,
        supports=_supports,
        batch_invariant=True,
    )
