"""Public op ``ema_``: the in-place exponential moving average of a list of tensors (a reference / target model's
weights following the trained model's), ``target[i] <- decay * target[i] + (1 - decay) * source[i]``.

Not a ``custom_op.declare`` op: that helper makes functional custom ops (``mutates_args=()``, outputs allocated
by the op and described by fakes, an autograd formula), while ``ema_`` writes its inputs in place, has no output
and no gradient, and takes lists of any length. So the public function checks its arguments, groups the
non-empty tensors by dtype (in list order) and calls the ``ema_fwd`` primitive of the backend
``rlk.core.dispatch.select("ema", device, dtype)`` chooses, once per dtype (one launch per dtype on the Triton
backend). ``torch.compile`` runs it eagerly (``torch.compiler.disable``: a graph break). The math is specified
in :mod:`rlk.reference.ema`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rlk.core import checks, dispatch
from rlk.core.checks import INPUT_DTYPES


def _tensor_list(name: str, value) -> list[Tensor]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name}: expected a list or tuple of tensors, got {type(value).__name__}")
    for i, t in enumerate(value):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}[{i}]: expected a torch.Tensor, got {type(t).__name__}")
    return list(value)


@torch.compiler.disable
def ema_(target: Sequence[Tensor], source: Sequence[Tensor], decay: float) -> None:
    """Exponential moving average step, in place: ``target[i] <- decay * target[i] + (1 - decay) * source[i]``.

    Computed as ``torch.lerp(target[i], source[i], 1 - decay)`` (what ``torch._foreach_lerp_(target, source,
    1 - decay)`` does): in fp32 (fp64 for fp64 tensors, reference backend only) with lerp's two-sided formula,
    rounded once to the target's dtype (:mod:`rlk.reference.ema`). On the Triton backend one kernel launch per
    dtype present updates every tensor of that dtype; no copy of the weights is made.

    Args:
        target: list or tuple of tensors (bfloat16, float16 or float32; float64 on the reference backend), each
            contiguous, all on one device; updated in place. Parameters that require grad are fine (they are
            updated like ``torch.no_grad()`` updates them; their version counters are bumped). Tensors of several
            dtypes may be mixed; no tensor may appear twice.
        source: list or tuple of the same length; ``source[i]`` has ``target[i]``'s shape, dtype and device and is
            contiguous. Only read.
        decay: a number in ``[0, 1]``: 1 leaves ``target`` as it is, 0 copies ``source``.

    Returns:
        None (like ``torch._foreach_lerp_``).

    Numerics: elementwise and deterministic, an element's result depends only on its own two values and
    ``decay`` (never on the other tensors of the list). Against ``torch._foreach_lerp_``: at most 1 ulp of the
    target's dtype (whether ``t + w (s - t)`` is one fused multiply-add may differ between implementations).
    """
    targets = _tensor_list("target", target)
    sources = _tensor_list("source", source)
    if len(sources) != len(targets):
        raise ValueError(f"source: expected {len(targets)} tensors (the length of target), got {len(sources)}")
    decay = checks.number("decay", decay, minimum=0.0, maximum=1.0)
    if not targets:
        return None
    device = targets[0].device
    groups: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
    seen: dict[int, int] = {}
    for i, (t, s) in enumerate(zip(targets, sources)):
        if t.dtype not in INPUT_DTYPES:
            raise TypeError(
                f"target[{i}]: expected dtype bfloat16, float16 or float32 (float64 for reference runs), got {t.dtype}"
            )
        if t.device != device:
            raise ValueError(f"target[{i}]: expected device {device} (the device of target[0]), got {t.device}")
        if s.dtype != t.dtype:
            raise TypeError(f"source[{i}]: expected dtype {t.dtype} (the dtype of target[{i}]), got {s.dtype}")
        if s.shape != t.shape:
            raise ValueError(
                f"source[{i}]: expected shape {tuple(t.shape)} (the shape of target[{i}]), got {tuple(s.shape)}"
            )
        if s.device != device:
            raise ValueError(f"source[{i}]: expected device {device} (the device of target), got {s.device}")
        if not t.is_contiguous():
            raise ValueError(
                f"target[{i}]: expected a contiguous tensor (updated in place), got strides "
                f"{t.stride()} for shape {tuple(t.shape)}"
            )
        if not s.is_contiguous():
            raise ValueError(
                f"source[{i}]: expected a contiguous tensor, got strides {s.stride()} for shape {tuple(s.shape)}"
            )
        if t.numel() == 0:
            continue
        if t.data_ptr() in seen:
            raise ValueError(
                f"target[{i}]: the same memory as target[{seen[t.data_ptr()]}] (each tensor is updated once)"
            )
        seen[t.data_ptr()] = i
        ts, ss = groups.setdefault(t.dtype, ([], []))
        ts.append(t.detach().view(-1))
        ss.append(s.detach().view(-1))
    for dtype, (ts, ss) in groups.items():
        dispatch.select("ema", device, dtype).primitives["ema_fwd"](ts, ss, decay)
    updated = [t for t in targets if t.numel()]
    if updated:
        torch.autograd.graph.increment_version(updated)
    return None
