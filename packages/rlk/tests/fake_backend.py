"""Shared by the dispatch tests: a fake backend that runs the reference's math and records what ran."""

from __future__ import annotations

from rlk import reference
from rlk.core import abi
from rlk.core.backend import Backend


def recording_backend(name: str, calls: list, *, without: tuple[str, ...] = (), **overrides) -> Backend:
    """A CPU backend named ``name`` with every ABI primitive but ``without``, each running the reference's and
    appending ``(name, primitive)`` to ``calls``; ``overrides``: other :class:`Backend` fields."""
    ref = reference.backend()

    def wrap(primitive):
        def run(*args):
            calls.append((name, primitive))
            return ref.primitives[primitive](*args)

        return run

    fields = dict(
        name=name,
        version="9.9",
        abi_version=abi.ABI_VERSION,
        primitives={p: wrap(p) for p in abi.PRIMITIVES if p not in without},
        probe=lambda: None,
        device_types=lambda: ("cpu",),
        batch_invariant=True,
    )
    fields.update(overrides)
    return Backend(**fields)
