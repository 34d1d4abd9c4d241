"""Embedding primitives: the spec (:mod:`rlk.reference.embedding`) as it is. The forward is a gather (a bitwise
copy); the backward adds each id's rows one by one in position order (single IEEE additions, no library reduction),
the order the spec fixes."""

from rlk.reference.embedding import embedding_bwd, embedding_fwd

__all__ = ["embedding_bwd", "embedding_fwd"]
