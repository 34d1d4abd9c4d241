"""Ema primitive: the spec (:mod:`rlk.reference.ema`) as it is: per element one subtraction, one multiplication and
one addition (correctly rounded, no reduction, no fused multiply-add in eager PyTorch), independent of the other
elements and tensors; decay 1 and 0 write nothing and copy the source (exact whatever the values)."""

from rlk.reference.ema import ema_fwd

__all__ = ["ema_fwd"]
