"""``rlk info``: versions, device, discovered backends and who serves each op."""

from __future__ import annotations

import platform

import torch

from rlk.core import abi, dispatch
from rlk.core.version import __version__


def _triton_version() -> tuple[str | None, str | None]:
    """``(version, None)``, or ``(None, the import error's type)`` when triton does not import (it is optional)."""
    try:
        import triton

        return triton.__version__, None
    except Exception as exc:
        return None, type(exc).__name__


def _versions(report: dict) -> list[str]:
    lines = [f"rlk {report['rlk']} (op ABI {report['abi_version']})"]
    accel = f"CUDA {report['cuda']}" if report["cuda"] else "no CUDA"
    if report["hip"]:
        accel = f"HIP {report['hip']}"
    lines.append(f"python {report['python']}, torch {report['torch']} ({accel})")
    triton = f"triton {report['triton']}" if report["triton"] else f"triton not importable ({report['triton_error']})"
    lines.append(triton)
    return lines


def default_device() -> torch.device:
    """The device ``rlk info`` and ``rlk demo`` describe: the current GPU if any, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _device_report(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "device": str(device),
            "name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
        }
    return {"device": "cpu", "name": platform.processor() or platform.machine()}


def _device_line(d: dict) -> str:
    if d["device"] == "cpu":
        return f"device: cpu ({d['name']})"
    return (
        f"device: {d['device']} {d['name']} (compute capability {d['compute_capability']}, {d['sms']} SMs, "
        f"{d['memory_gib']:.0f} GiB)"
    )


def report() -> dict:
    """rlk's environment as plain data (what ``rlk info --json`` prints): versions, the device, the pinned backend,
    every discovered backend with its state, and the backend each op gets per dtype on the device."""
    device = default_device()
    pinned = dispatch._pinned()
    triton_version, triton_error = _triton_version()
    backends = []
    for name, status in dispatch.discover().items():
        entry = {
            "name": name,
            "version": status.backend.version if status.backend else None,
            "source": status.source,
            "available": status.available,
            "reason": status.reason,
        }
        if status.available:
            entry["device_types"] = list(status.backend.device_types())
            entry["batch_invariant"] = bool(status.backend.batch_invariant)
        backends.append(entry)
    ops = {
        op.name: {dtype: dispatch.decide(op.name, device, getattr(torch, dtype)).backend for dtype in op.dtypes}
        for op in abi.OPS.values()
    }
    return {
        "rlk": __version__,
        "abi_version": abi.ABI_VERSION,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "triton": triton_version,
        "triton_error": triton_error,
        "device": _device_report(device),
        "pinned_backend": pinned,
        "pinned_by": dispatch._pin_source() if pinned else None,
        "backends": backends,
        "chain": list(dispatch.chain_for(device)),
        "ops": ops,
    }


def info() -> str:
    """A readable report of rlk's environment (what ``rlk info`` prints): :func:`report` as text."""
    r = report()
    lines = _versions(r)
    lines.append(_device_line(r["device"]))
    if r["pinned_backend"]:
        lines.append(f"pinned backend: {r['pinned_backend']} ({r['pinned_by']})")
    lines.append("backends:")
    for b in r["backends"]:
        if b["available"]:
            served = "any device" if "*" in b["device_types"] else ", ".join(b["device_types"])
            state = f"available (serves {served}; batch-invariant: {'yes' if b['batch_invariant'] else 'no'})"
        else:
            state = f"unavailable: {b['reason']}"
        lines.append(f"  {b['name']:<10} {b['version'] or '?':<8} [{b['source']}] {state}")
    lines.append(f"ops on {r['device']['device']} (chain {' -> '.join(r['chain'])}):")
    width = max(len(name) for name in r["ops"]) + 1
    for name, by_dtype in r["ops"].items():
        served = ", ".join(f"{dtype}: {backend or 'NONE'}" for dtype, backend in by_dtype.items())
        lines.append(f"  {name:<{width}} {served}")
    return "\n".join(lines)


def selfcheck(device: torch.device | None = None) -> tuple[list[str], bool]:
    """Each available backend's ``selfcheck`` on ``device`` (default: :func:`default_device`): report lines and
    whether every check held (what ``rlk info --selfcheck`` prints)."""
    device = default_device() if device is None else device
    lines, ok = [f"selfcheck on {device}:"], True
    for name, status in dispatch.discover().items():
        if not status.available:
            continue
        problems = status.backend.selfcheck(device)
        ok = ok and not problems
        lines.append(f"  {name:<10} " + ("ok" if not problems else f"FAILED ({len(problems)})"))
        lines += [f"    {p}" for p in problems]
    return lines, ok
