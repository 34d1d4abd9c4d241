"""Shared by the op tests: ``torch.compile(fullgraph=True)`` of a loss over rlk ops equals eager."""

from __future__ import annotations

import torch


def assert_compiled_matches_eager(loss_fn, inputs, backend: str | None = None) -> None:
    """Run ``loss_fn(*leaves)`` and its backward eagerly and compiled (``fullgraph=True``; ``backend`` as
    ``torch.compile`` takes it, None: inductor). The gradients, which the rlk ops produce, must be equal bit
    for bit; the loss only close (its final reduction may be the compiler's own)."""
    compiled = torch.compile(loss_fn, fullgraph=True, **({} if backend is None else {"backend": backend}))
    results = []
    for fn in (loss_fn, compiled):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        loss = fn(*leaves)
        loss.backward()
        results.append((loss.detach(), [t.grad for t in leaves]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss)
    for eager, got in zip(eager_grads, compiled_grads):
        assert torch.equal(eager, got)
