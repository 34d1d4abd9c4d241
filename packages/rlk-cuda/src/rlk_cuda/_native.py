"""The native module ``rlk_cuda._C``, imported once, and what every primitive needs to call it.

The import may fail (a wheel for another platform, a broken build); the error is kept, not raised,
so the backend's probe can report it. ``C`` is None then.
"""

from __future__ import annotations

try:
    from rlk_cuda import _C as C

    IMPORT_ERROR: str | None = None
except Exception as exc:  # reported by the probe, never raised at import
    C = None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def stream_of(tensor) -> int:
    """The ``cudaStream_t`` (an integer) of torch's current stream on ``tensor``'s device."""
    import torch

    return torch.cuda.current_stream(tensor.device).cuda_stream


def on_device(tensor):
    """A context that makes ``tensor``'s CUDA device current for the native call.

    Needed before any tensor reaches the native layer, not only for the launch: torch refuses to export a
    CUDA tensor through DLPack unless its device is the current one (``BufferError: Can't export tensors on
    a different CUDA device index``), and nanobind exports the arguments before the C++ device guard runs.
    """
    import torch

    return torch.cuda.device(tensor.device)


def array(tensor):
    """``tensor`` as the native layer takes it: detached (DLPack refuses tensors that require grad), or None."""
    return None if tensor is None else tensor.detach()


def compute_capability_served(architectures: list[str], capability: tuple[int, int]) -> bool:
    """Whether a GPU of compute capability ``(major, minor)`` can run a module built for ``architectures``.

    ``architectures`` as CMake writes them (``"80-real"``, ``"90a-real"``, ``"120-virtual"``):

    * machine code ``XY-real`` runs on ``X.z`` for ``z >= Y`` (binary compatibility inside a major version);
    * arch-specific machine code ``XYa-real`` / ``XYf-real`` runs on ``X.Y`` only (``f``: the family, ``X.z``,
      ``z >= Y``);
    * PTX ``XY-virtual`` is JIT-compiled by the driver for any ``>= X.Y`` (``a`` PTX: ``X.Y`` only).
    """
    major, minor = capability
    for arch in architectures:
        code, _, kind = arch.partition("-")
        suffix = code[-1] if code[-1].isalpha() else ""
        digits = code[: len(code) - len(suffix)]
        if not digits.isdigit() or len(digits) < 2:
            continue
        a_major, a_minor = int(digits[:-1]), int(digits[-1])
        if suffix == "a":
            if (major, minor) == (a_major, a_minor):
                return True
        elif kind == "virtual" and suffix == "":
            if (major, minor) >= (a_major, a_minor):
                return True
        elif major == a_major and minor >= a_minor:
            return True
    return False
