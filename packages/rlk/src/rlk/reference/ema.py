"""Reference ema primitive: the readable specification.

An exponential moving average step of a list of tensors (the weights of a reference / target model), in
place::

    decay == 1: nothing is written (t keeps its bits, whatever s holds: lerp's 0 * (s - t) is NaN for an inf s)
    decay == 0: t[...] = s, a bitwise copy (whatever t holds: lerp's s - (s - t) * 0 is NaN for a NaN or inf t)
    otherwise:
    w = round_fp32(1 - decay)              # 1 - decay taken in double, rounded once (fp64 inputs: kept)
    for t, s in zip(targets, sources):
        d = float32(s) - float32(t)
        if |w| < 0.5:
            out = float32(t) + w * d       # decay > 0.5, the usual case
        else:
            out = float32(s) - d * (1 - w)
        t[...] = round(out)                # to t.dtype, round to nearest even

Between the endpoints this is ``torch.lerp(t, s, w)`` (``target.lerp_(source, 1 - decay)``,
``torch._foreach_lerp_``) with its two-sided formula, computed in fp32 (fp64 for fp64 tensors) and rounded once.
Elementwise: an element's result depends on its own target and source values and ``decay`` only, never on the
other elements or tensors of the call.
Whether a backend contracts ``t + w * d`` into one fused multiply-add is not specified (the result may differ by
one rounding of the fp32 value: at most 1 ulp of fp32, and at most 1 ulp of the target's dtype).
"""

from __future__ import annotations

import torch

from rlk.core.checks import compute_dtype


def ema_fwd(targets: list[torch.Tensor], sources: list[torch.Tensor], decay: float) -> None:
    """``targets[i] <- lerp(targets[i], sources[i], 1 - decay)`` in place (module docstring).

    Args:
        targets: float tensors of one dtype, updated in place (no autograd: the op layer passes detached views).
        sources: tensors of the targets' shapes and dtype.
        decay: in ``[0, 1]``; 1 and 0 exact (module docstring).
    """
    if decay == 1.0:
        return
    for target, source in zip(targets, sources):
        if decay == 0.0:
            target.copy_(source)
            continue
        cdt = compute_dtype(target.dtype)
        weight = torch.tensor(1.0 - decay, dtype=torch.float64).to(cdt)  # one rounding of 1 - decay
        t = target.to(cdt)
        s = source.to(cdt)
        d = s - t
        out = t + weight * d if bool(weight.abs() < 0.5) else s - d * (1 - weight)
        target.copy_(out)
