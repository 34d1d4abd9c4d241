"""The native module ``rlk_rocm._C``, imported once, and what every primitive needs to call it.

The import may fail (no ROCm runtime: ``libamdhip64`` not loadable; a wheel for another platform); the error
is kept, not raised, so the backend's probe can report it. ``C`` is None then.
"""

from __future__ import annotations

try:
    from rlk_rocm import _C as C

    IMPORT_ERROR: str | None = None
except Exception as exc:  # reported by the probe, never raised at import
    C = None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def stream_of(tensor) -> int:
    """The ``hipStream_t`` (an integer) of torch's current stream on ``tensor``'s device (a ROCm torch keeps
    the ``torch.cuda`` names for HIP)."""
    import torch

    return torch.cuda.current_stream(tensor.device).cuda_stream


def on_device(tensor):
    """A context that makes ``tensor``'s device current for the native call (torch exports a GPU tensor through
    DLPack only from its own device)."""
    import torch

    return torch.cuda.device(tensor.device)


def array(tensor):
    """``tensor`` as the native layer takes it: detached (DLPack refuses tensors that require grad), or None."""
    return None if tensor is None else tensor.detach()


def target_of(gcn_arch_name: str) -> str:
    """``"gfx90a:sramecc+:xnack-"`` -> ``"gfx90a"`` (the target a code object is built for)."""
    return gcn_arch_name.split(":", 1)[0].strip()
