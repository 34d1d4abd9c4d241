"""``rlk info``: versions, device, discovered backends and who serves each op."""

from __future__ import annotations

import platform

import torch

from rlk import abi, dispatch


def _versions() -> list[str]:
    import rlk

    lines = [f"rlk {rlk.__version__} (op ABI {abi.ABI_VERSION})"]
    accel = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
    if torch.version.hip:
        accel = f"HIP {torch.version.hip}"
    lines.append(f"python {platform.python_version()}, torch {torch.__version__} ({accel})")
    try:
        import triton

        lines.append(f"triton {triton.__version__}")
    except Exception as exc:  # triton is optional
        lines.append(f"triton not importable ({type(exc).__name__})")
    return lines


def default_device() -> torch.device:
    """The device ``rlk info`` and ``rlk demo`` describe: the current GPU if any, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _device_line(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (f"device: {device} {props.name} (compute capability {props.major}.{props.minor}, "
                f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)")
    return f"device: cpu ({platform.processor() or platform.machine()})"


def info() -> str:
    """A readable report of rlk's environment (what ``rlk info`` prints)."""
    device = default_device()
    lines = _versions()
    lines.append(_device_line(device))
    pinned = dispatch._pinned()
    if pinned:
        lines.append(f"pinned backend: {pinned} ({dispatch._pin_source()})")
    lines.append("backends:")
    for name, status in dispatch.discover().items():
        version = status.backend.version if status.backend else "?"
        if status.available:
            devices = status.backend.device_types()
            served = "any device" if "*" in devices else ", ".join(devices)
            invariant = "yes" if status.backend.batch_invariant else "no"
            state = f"available (serves {served}; batch-invariant: {invariant})"
        else:
            state = f"unavailable: {status.reason}"
        lines.append(f"  {name:<10} {version:<8} [{status.source}] {state}")
    lines.append(f"ops on {device} (chain {' -> '.join(dispatch.chain_for(device))}):")
    width = max(len(name) for name in abi.OPS) + 1
    for op in abi.OPS.values():
        served = []
        for dtype_name in op.dtypes:
            decision = dispatch.decide(op.name, device, getattr(torch, dtype_name))
            served.append(f"{dtype_name}: {decision.backend or 'NONE'}")
        lines.append(f"  {op.name:<{width}} " + ", ".join(served))
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
