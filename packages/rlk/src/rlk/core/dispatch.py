"""Backend discovery and selection.

Discovery: the reference backend is built in; every other backend comes from
the entry-point group ``rlk.backends``. A backend that fails to load, reports
another ABI version, or whose probe returns a reason is *unavailable*, and
the reason is kept for ``rlk info`` and ``rlk.explain``.

Selection, per op and per call (forward and backward of one call always use
the same backend):

* pinned: ``RLK_BACKEND=<name>`` or ``with rlk.use_backend(name):``. The pinned
  backend must serve the op on the inputs' device and dtype; if it can't, the
  call raises :class:`BackendError` saying why. There is no fallback.
* otherwise the chain of the inputs' device type is walked in order
  (CUDA GPU: cuda, triton, reference; ROCm GPU: rocm, triton, reference;
  NPU/MLU/MUSA: domestic, reference; CPU: reference) and the first backend that
  serves the call runs it. Skipping an installed backend is logged once per
  distinct situation (logger ``rlk``, level WARNING); skipping a backend that
  is simply not installed is logged at DEBUG.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata

import torch

from rlk.core import abi
from rlk.core.backend import Backend

logger = logging.getLogger("rlk")

ENTRY_POINT_GROUP = "rlk.backends"
ENV_BACKEND = "RLK_BACKEND"

_CHAINS = {
    "cuda": ("cuda", "triton", "reference"),
    "rocm": ("rocm", "triton", "reference"),
    "npu": ("domestic", "reference"),
    "mlu": ("domestic", "reference"),
    "musa": ("domestic", "reference"),
}
_DEFAULT_CHAIN = ("reference",)

_pinned_scope: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlk_backend", default=None)
_logged: set[tuple] = set()


class BackendError(RuntimeError):
    """An explicit backend choice that cannot be honoured, or no backend at all."""


@dataclass(frozen=True)
class BackendStatus:
    """A discovered backend: loaded (or not), available (or why not)."""

    name: str
    backend: Backend | None
    reason: str | None  # None when available
    source: str  # "built-in" or the entry point's value

    @property
    def available(self) -> bool:
        return self.reason is None


@dataclass(frozen=True)
class Decision:
    """Which backend runs an op on given inputs, and why."""

    op: str
    device: torch.device
    dtype: torch.dtype
    backend: str | None
    pinned: str | None
    chain: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...] = field(default=())

    def __str__(self) -> str:
        where = f"{self.op} on {self.device} ({str(self.dtype).removeprefix('torch.')})"
        if self.pinned:
            head = f"{where}: backend '{self.pinned}' pinned by {_pin_source()}"
        else:
            head = f"{where}: chain {' -> '.join(self.chain)}"
        lines = [head]
        lines += [f"  skip {name}: {reason}" for name, reason in self.skipped]
        if self.backend is None:
            lines.append("  no backend can run it")
        else:
            lines.append(f"  -> runs on '{self.backend}'")
        return "\n".join(lines)


def _load_reference() -> BackendStatus:
    # The built-in backend is loaded by name, as entry points load the others: dispatch (core) never imports a
    # backend module, so no import runs from the core up to a backend.
    reference = importlib.import_module("rlk.reference")
    return _status_of("reference", reference.backend, "built-in")


def _status_of(name: str, factory, source: str) -> BackendStatus:
    try:
        backend = factory()
    except Exception as exc:  # a backend that cannot even load is unavailable, not fatal
        return BackendStatus(name, None, f"failed to load: {type(exc).__name__}: {exc}", source)
    if not isinstance(backend, Backend):
        return BackendStatus(name, None, f"factory returned {type(backend).__name__}, not rlk.Backend", source)
    if backend.abi_version != abi.ABI_VERSION:
        reason = f"built for rlk ABI {backend.abi_version}, this rlk speaks ABI {abi.ABI_VERSION}"
        return BackendStatus(name, backend, reason, source)
    probed: str | None
    try:
        probed = backend.probe()
    except Exception as exc:  # the probe must not raise; treat a raising probe as a broken backend
        probed = f"probe raised {type(exc).__name__}: {exc}"
    return BackendStatus(name, backend, probed, source)


@functools.cache
def discover() -> dict[str, BackendStatus]:
    """All backends: the built-in reference plus the ``rlk.backends`` entry points."""
    found = {"reference": _load_reference()}
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in found:
            logger.warning("rlk: ignoring a second backend named %r (%s)", ep.name, ep.value)
            continue
        found[ep.name] = _status_of(ep.name, lambda ep=ep: ep.load()(), ep.value)
    return found


def refresh() -> None:
    """Forget discovery results (after installing a backend or changing the environment)."""
    discover.cache_clear()
    _logged.clear()


def chain_for(device: torch.device) -> tuple[str, ...]:
    """The default fallback chain for a device."""
    kind = device.type
    if kind == "cuda" and torch.version.hip is not None:
        kind = "rocm"
    return _CHAINS.get(kind, _DEFAULT_CHAIN)


def _pinned() -> str | None:
    return _pinned_scope.get() or os.environ.get(ENV_BACKEND) or None


def pinned_backend() -> str | None:
    """The backend pinned now (``rlk.use_backend`` or ``RLK_BACKEND``), or None."""
    return _pinned()


def _pin_source() -> str:
    return "rlk.use_backend()" if _pinned_scope.get() else f"{ENV_BACKEND}"


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Pin a backend inside a ``with`` block (``None`` restores automatic selection
    unless ``RLK_BACKEND`` is set). Same rules as ``RLK_BACKEND``: no fallback."""
    token = _pinned_scope.set(name)
    try:
        yield
    finally:
        _pinned_scope.reset(token)


def why_not(
    name: str, op: abi.Op, device: torch.device, dtype: torch.dtype, features: Mapping[str, int] | None = None
) -> str | None:
    """None if backend ``name`` can run ``op`` on this device and dtype (and sizes ``features``, checked
    against :attr:`Backend.limits`), else why not."""
    status = discover().get(name)
    if status is None:
        return "not installed"
    if status.reason is not None:
        return f"unavailable: {status.reason}"
    backend = status.backend
    assert backend is not None  # an available status has its backend
    device_types = backend.device_types()
    if device.type not in device_types and "*" not in device_types:
        served = ", ".join(device_types) or "none"
        return f"does not serve device type '{device.type}' (serves: {served})"
    missing = [p for p in op.primitives if p not in backend.primitives]
    if missing:
        return f"does not implement {', '.join(missing)}"
    for primitive in op.primitives:
        reason = backend.supports(primitive, device, dtype)
        if reason is not None:
            return reason
        for feature, limit in backend.limits.get(primitive, {}).items():
            value = (features or {}).get(feature)
            if value is not None and value > limit:
                return f"{feature} = {value} is above its limit of {limit}"
    return None


def decide(
    op_name: str, device: torch.device, dtype: torch.dtype, features: Mapping[str, int] | None = None
) -> Decision:
    """Choose the backend for one call (see the module docstring); ``features``: sizes that backends may
    limit (:attr:`Backend.limits`), e.g. ``{"head_dim": 128}``."""
    op = abi.OPS[op_name]
    pinned = _pinned()
    if pinned:
        reason = why_not(pinned, op, device, dtype, features)
        refused = () if reason is None else ((pinned, reason),)
        return Decision(op_name, device, dtype, pinned if reason is None else None, pinned, (pinned,), refused)
    chain = chain_for(device)
    skipped: list[tuple[str, str]] = []
    for name in chain:
        reason = why_not(name, op, device, dtype, features)
        if reason is None:
            return Decision(op_name, device, dtype, name, None, chain, tuple(skipped))
        skipped.append((name, reason))
    return Decision(op_name, device, dtype, None, None, chain, tuple(skipped))


def select(
    op_name: str, device: torch.device, dtype: torch.dtype, features: Mapping[str, int] | None = None
) -> Backend:
    """The backend that runs ``op_name`` now; raises :class:`BackendError` if none can."""
    decision = decide(op_name, device, dtype, features)
    if decision.backend is None:
        raise BackendError(str(decision))
    for name, reason in decision.skipped:
        key = (op_name, device.type, dtype, name, reason, decision.backend)
        if key in _logged:
            continue
        _logged.add(key)
        level = logging.DEBUG if reason == "not installed" else logging.WARNING
        logger.log(
            level,
            "rlk: %s on %s falls back from '%s' to '%s': %s",
            op_name,
            device.type,
            name,
            decision.backend,
            reason,
        )
    backend = discover()[decision.backend].backend
    assert backend is not None  # decide() chose an available backend
    return backend


def _first_tensor_meta(tensors) -> tuple[torch.device, torch.dtype]:
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors:
        raise TypeError("rlk.explain needs at least one tensor argument")
    return tensors[0].device, tensors[0].dtype


def explain(op_name: str, *tensors: torch.Tensor) -> Decision:
    """Which backend would run ``op_name`` on these tensors, and why.

    ``str()`` of the result is a readable report; its fields are inspectable.
    The first tensor decides device and dtype (the op's main input:
    ``logits`` or ``hidden``).
    """
    if op_name not in abi.OPS:
        raise ValueError(f"unknown op {op_name!r}; ops: {', '.join(abi.OPS)}")
    device, dtype = _first_tensor_meta(tensors)
    return decide(op_name, device, dtype)


def backend_named(name: str) -> Backend:
    """The loaded, available backend called ``name`` (used by backward primitives,
    which run on the backend that served the forward)."""
    status = discover().get(name)
    if status is None or status.backend is None or status.reason is not None:
        why = "not installed" if status is None else (status.reason or "not loaded")
        raise BackendError(f"backend {name!r} cannot run: {why}")
    return status.backend
