"""Pack / unpack primitives: the spec (:mod:`rlk.reference.pack`) as it is: bitwise copies by slot, no arithmetic."""

from rlk.reference.pack import pack_bwd, pack_fwd

__all__ = ["pack_bwd", "pack_fwd"]
