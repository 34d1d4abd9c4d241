"""What a backend hands to rlk: its primitive table, ABI version and probes.

A backend package registers a zero-argument factory in the entry-point group
``rlk.backends``::

    [project.entry-points."rlk.backends"]
    triton = "rlk_triton:backend"

The factory returns a :class:`Backend`. Importing the backend module or
calling the factory may fail (a missing dependency): rlk then lists the
backend as unavailable with the exception as the reason. ``probe`` must never
raise; it returns ``None`` when the backend can run here, else the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from rlk.core import checks


def _no_reason(primitive: str, device: torch.device, dtype: torch.dtype) -> str | None:
    return None


def _no_problems(device: torch.device) -> list[str]:
    return []


@dataclass(frozen=True)
class Backend:
    """A table of ABI primitives plus the probes rlk needs to choose it.

    Attributes:
        name: short name used by ``RLK_BACKEND`` and in messages (``"triton"``).
        version: the backend distribution's version string.
        abi_version: the ``rlk.core.abi.ABI_VERSION`` the backend was written for.
        primitives: primitive name -> callable with the ABI signature.
        probe: returns ``None`` if the backend can run on this machine, else a
            one-line reason ("no GPU", "triton not importable: ..."). Never raises.
        device_types: returns the torch device types (``"cuda"``, ``"cpu"``...)
            the backend can serve in this process (empty when unavailable).
        supports: per-call check ``(primitive, device, dtype) -> reason | None``
            for dtypes or devices the backend declines.
        batch_invariant: whether the backend promises that a row's outputs (and
            per-row gradients) are bitwise independent of the other rows.
        limits: primitive name -> {size feature: the largest value served}, e.g.
            ``{"attention_fwd": {"head_dim": 256}}``; a call above a limit is declined
            with its reason and falls to the next backend of the chain.
        selfcheck: ``device -> problems``: runs the backend's checks of what its invariance rests on
            on this device (e.g. that tile configurations chosen by size give the same bits) and
            returns one line per failed check (empty: all hold). ``rlk info --selfcheck`` runs it.
    """

    name: str
    version: str
    abi_version: int
    primitives: Mapping[str, Callable[..., None]]
    probe: Callable[[], str | None]
    device_types: Callable[[], tuple[str, ...]]
    supports: Callable[[str, torch.device, torch.dtype], str | None] = field(default=_no_reason)
    batch_invariant: bool = False
    limits: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    selfcheck: Callable[[torch.device], list[str]] = field(default=_no_problems)

    def __post_init__(self) -> None:
        checks.flag("batch_invariant", self.batch_invariant)
