"""The chain switch: a block run with rlk's batch-invariant chain on a Hugging Face model, or with stock kernels
(what rlk's rollout and training paths, and the engine integrations that compare with them, toggle)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def chain(model, enabled: bool) -> Iterator[None]:
    """Run the block with rlk's batch-invariant chain on (``enabled``) or with stock kernels.

    ``enabled=True``: ``rlk.batch_invariant()`` (the aten overrides) plus ``rlk.patch_model(model)`` (RMSNorm and
    the varlen ``"rlk"`` attention, which gets the padding mask), undone on exit (a model patched before the
    block stays patched).
    ``enabled=False``: stock PyTorch / cuBLAS / SDPA; a model patched before the block is unpatched for the
    block and patched again on exit. (The aten overrides are process-wide: a ``batch_invariant`` block or
    ``enable_batch_invariant()`` opened outside keeps them on; that is the caller's business.)
    """
    from rlk.integrations.hf import patch_model, unpatch_model

    was_patched = getattr(model, "_rlk_patch", None) is not None
    if not enabled:
        if was_patched:
            unpatch_model(model)
        try:
            yield
        finally:
            if was_patched:
                patch_model(model)
        return
    from rlk.integrations.batch_invariant import batch_invariant

    with batch_invariant():
        patch_model(model)
        try:
            yield
        finally:
            if not was_patched:
                unpatch_model(model)
