"""rlk-rocm: the native ROCm (HIP) backend of rlk (distribution ``rlk-rocm6``, importing ``rlk_rocm``).

rlk finds it through the entry point ``rlk.backends: rocm = rlk_rocm:backend``. The kernel bodies are rlk-cuda's
(``common.cuh``, ``logprob.cuh``, ``norm.cuh``, ``linear_logprob.cuh`` over the portability layer ``portable.cuh``;
``linear_logprob.cuh``'s GEMMs on the MFMA core ``mma_amd.cuh``), compiled for wavefront-64 AMD GPUs (gfx90a,
gfx942) behind a thin nanobind layer (``rlk_rocm._C``): DLPack tensors, caller-allocated outputs, torch's current
stream as an integer, no libtorch. Batch-invariant by construction.

Implemented primitives: ``selected_logprob_fwd/bwd`` and ``linear_logprob_fwd/bwd`` (``logprob.py``;
``linear_logprob`` in float16 / bfloat16 only: ``supports`` declines float32, which falls through to triton) and
``rms_norm_fwd/bwd`` (``norm.py``), in float32 / float16 / bfloat16. Every other op (``linear_logprob_stored``
among them) falls through to triton, reference.

Importing this package never fails for a missing runtime or GPU: the probe says why the backend is unavailable
(no ROCm runtime, no AMD GPU, no code object for the GPU's target, torch not a ROCm build, version mismatch).
"""

from __future__ import annotations

import functools

__version__ = "0.1.0"

#: The rlk op ABI this backend implements (rlk.core.abi.ABI_VERSION it was written for).
ABI_VERSION = 3

_DTYPE_NAMES = ("float32", "float16", "bfloat16")
#: Primitives with a matrix-core path only (MFMA on 16-bit inputs): float32 falls through.
_HALF_ONLY = ("linear_logprob_",)


def _hip_version(version: int) -> str:
    """``HIP_VERSION`` (``50221153``) -> ``"5.2"``."""
    return f"{version // 10_000_000}.{version // 100_000 % 100}"


def version_problem(rlk_version: str) -> str | None:
    """None if this backend may run under rlk ``rlk_version``, else why not (the extras pin them exactly)."""
    if rlk_version == __version__:
        return None
    return (
        f"rlk-rocm {__version__} needs rlk {__version__}, found rlk {rlk_version}: install matching versions "
        f"(pip install 'rlk[rocm62]=={rlk_version}' pins both)"
    )


def _native_problem() -> str | None:
    """Why the native module cannot run anything here (runtime, build, GPU, target), or None."""
    from rlk_rocm import _native

    if _native.C is None:
        error = _native.IMPORT_ERROR or ""
        if "libamdhip64" in error or "libhsa-runtime64" in error:
            return f"no ROCm runtime: libamdhip64 is not loadable ({error}); install ROCm or a ROCm build of torch"
        return f"native module rlk_rocm._C failed to import: {error}"
    c = _native.C
    if c.__version__ != __version__:
        return f"native module is version {c.__version__}, the Python package {__version__}: a stale build, reinstall"
    if c.device_count() == 0:
        return (
            f"no AMD GPU: the HIP runtime (ROCm {_hip_version(c.runtime_version())}) sees no device "
            "(none installed, no access to /dev/kfd, or HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES hide them)"
        )
    problems = [_arch_problem(i) for i in range(c.device_count())]
    if all(problems):
        return problems[0]
    return None


def _arch_problem(index: int) -> str | None:
    """Why the kernels cannot run on HIP device ``index`` (its target not compiled in), or None."""
    from rlk_rocm import _native

    archs = _native.C.compiled_architectures()
    name = _native.C.device_arch(index)
    if _native.target_of(name) in archs:
        return None
    return (
        f"GPU {index} is {name or 'of an unknown target'}; this build has code objects for {', '.join(archs)} "
        f"only (rebuild with RLK_ROCM_ARCHS={_native.target_of(name) or '<its gfx target>'})"
    )


def _torch_problem() -> str | None:
    """Why torch cannot hand this backend AMD GPU tensors, or None."""
    import torch

    if torch.version.hip is None:
        flavour = f"a CUDA build (CUDA {torch.version.cuda})" if torch.version.cuda else "a CPU-only build"
        return (
            f"torch {torch.__version__} is not a ROCm build of torch ({flavour}): rlk-rocm serves AMD GPUs "
            "through torch for ROCm"
        )
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (ROCm {torch.version.hip}) sees no GPU"
    return None


@functools.cache
def _probe_cached() -> str | None:
    problems = [p for p in (_native_problem(), _torch_problem()) if p is not None]
    return "; ".join(problems) if problems else None


def _probe() -> str | None:
    try:
        return _probe_cached()
    except Exception as exc:  # the probe must never raise
        return f"probe failed: {type(exc).__name__}: {exc}"


def _device_types() -> tuple[str, ...]:
    # a ROCm torch names its GPU device type "cuda"
    return ("cuda",) if _probe() is None else ()


@functools.cache
def _device_problem(index: int) -> str | None:
    return _arch_problem(index)


def _supports(primitive: str, device, dtype) -> str | None:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        return f"dtype {name} not supported (bfloat16, float16, float32)"
    if device.type != "cuda":
        return f"device type {device.type} not served (AMD GPUs, device type cuda on a ROCm torch)"
    if name == "float32" and primitive.startswith(_HALF_ONLY):
        return f"{primitive}: float32 not implemented in rlk-rocm (MFMA path for bfloat16 / float16 only)"
    import torch

    return _device_problem(torch.cuda.current_device() if device.index is None else device.index)


def backend():
    """The ``rlk.Backend`` of this package (entry-point factory)."""
    from rlk.core.abi import collect_primitives
    from rlk.core.backend import Backend
    from rlk.core.version import __version__ as rlk_version

    mismatch = version_problem(rlk_version)
    if mismatch is not None:
        return Backend(
            name="rocm",
            version=__version__,
            abi_version=ABI_VERSION,
            primitives={},
            probe=lambda: mismatch,
            device_types=lambda: (),
        )

    from rlk_rocm import logprob, norm

    return Backend(
        name="rocm",
        version=__version__,
        abi_version=ABI_VERSION,
        primitives=collect_primitives(logprob, norm),
        probe=_probe,
        device_types=_device_types,
        supports=_supports,
        batch_invariant=True,
    )
