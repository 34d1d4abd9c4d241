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

import bisect
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


def _check_no_overlap(targets: list[Tensor], sources: list[Tensor]) -> None:
    """No two targets share a byte of memory, and no source shares memory with a target other than its own (which it
    may be, exactly): each element is written once, from values nobody writes. From the addresses alone (the tensors
    are contiguous: each covers ``[data_ptr, data_ptr + nbytes)``), one sort, no synchronization."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes, i) for i, t in enumerate(targets) if t.numel())
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            first, second = sorted((i, j))
            raise ValueError(
                f"target[{second}]: overlaps target[{first}] in memory (each element is updated once: the "
                "targets must not be views of one another)"
            )
    starts = [start for start, _, _ in spans]
    for i, s in enumerate(sources):
        if not s.numel():
            continue
        begin, end = s.data_ptr(), s.data_ptr() + s.nbytes
        k = bisect.bisect_left(starts, end) - 1  # the last target starting below the source's end
        if k < 0 or spans[k][1] <= begin:
            continue
        j = spans[k][2]
        if j != i or (begin, end) != spans[k][:2]:
            raise ValueError(
                f"source[{i}]: overlaps target[{j}] in memory (a source may only be its own target exactly: "
                "the targets are written while the sources are read)"
            )


@torch.compiler.disable
def ema_(target: Sequence[Tensor], source: Sequence[Tensor], decay: float) -> None:
    """Exponential moving average step, in place: ``target[i] <- decay * target[i] + (1 - decay) * source[i]``.

    For ``0 < decay < 1`` computed as ``torch.lerp(target[i], source[i], 1 - decay)`` (what
    ``torch._foreach_lerp_(target, source, 1 - decay)`` does): in fp32 (fp64 for fp64 tensors, reference backend
    only) with lerp's two-sided formula, rounded once to the target's dtype (:mod:`rlk.reference.ema`). On the Triton
    backend one kernel launch per dtype present updates every tensor of that dtype; no copy of the weights is made.

    Args:
        target: list or tuple of tensors (bfloat16, float16 or float32; float64 on the reference backend), each
            contiguous, all on one device; updated in place. Parameters that require grad are fine (they are
            updated like ``torch.no_grad()`` updates them; their version counters are bumped). Tensors of several
            dtypes may be mixed; no two may overlap in memory (a tensor twice, or views sharing elements, as
            ``[a, a[1:3]]``: an error naming ``target``).
        source: list or tuple of the same length; ``source[i]`` has ``target[i]``'s shape, dtype and device and is
            contiguous. Only read; it may be ``target[i]`` itself but must not overlap any other target.
        decay: a number in ``[0, 1]``. The endpoints are exact, whatever the values (NaN and inf included):
            1 leaves ``target`` as it is, bit for bit; 0 copies ``source`` bit for bit.

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
        ts, ss = groups.setdefault(t.dtype, ([], []))
        ts.append(t.detach().view(-1))
        ss.append(s.detach().view(-1))
    if device.type != "meta":
        _check_no_overlap(targets, sources)
    for dtype, (ts, ss) in groups.items():
        dispatch.select("ema", device, dtype).primitives["ema_fwd"](ts, ss, decay)
    updated = [t for t in targets if t.numel()]
    if updated:
        torch.autograd.graph.increment_version(updated)
    return None
