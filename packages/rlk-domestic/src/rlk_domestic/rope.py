"""Rope primitives: the spec (:mod:`rlk.reference.rope`) as it is. Every output element is two products and one sum
of its own token's values (correctly rounded IEEE operations, no reduction), so it is batch-invariant on any
device."""

from rlk.reference.rope import rope_bwd, rope_fwd

__all__ = ["rope_bwd", "rope_fwd"]
