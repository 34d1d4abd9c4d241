"""The parity report: a Markdown matrix (ops x dtypes by backends) and a JSON record.

The JSON keeps every case's deviations and the environment (versions, device,
command line), so a GPU run can be archived and compared later.
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

import torch

import rlk
from parity import cases as cs
from parity import chain, distill, rl
from parity.run import FAIL, NA, Cell, Config
from rlk.core import dispatch


def environment(device: torch.device, command: str) -> dict:
    """Versions, device and command line of this run."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception as exc:  # triton is optional
        triton_version = f"not importable ({type(exc).__name__})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        memory = props.total_memory / 2**30
        device_name = f"{props.name} (compute capability {props.major}.{props.minor}, {memory:.0f} GiB)"
    else:
        device_name = platform.processor() or platform.machine()
    return {
        "command": command,
        "rlk": rlk.__version__,
        "abi": rlk.ABI_VERSION,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "triton": triton_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": device_name,
        "cpu_threads": torch.get_num_threads(),
        "backend_versions": {
            name: status.backend.version for name, status in dispatch.discover().items() if status.backend
        },
        "env": {k: os.environ[k] for k in ("TRITON_INTERPRET", "RLK_BACKEND") if k in os.environ},
    }


def _finite(x: float) -> float | str:
    """JSON has no inf/nan: spell them as strings."""
    return x if math.isfinite(x) else str(x)


def _case_json(case: cs.Case | rl.RLCase | chain.ChainCase) -> dict:
    if isinstance(case, chain.ChainCase):
        return {
            "label": case.label(),
            "size": list(map(str, case.size)),
            "variant": case.variant,
            "params": dict(case.params),
        }
    if isinstance(case, rl.RLCase):
        params = {k: v for k, v in case.params if not isinstance(v, torch.Tensor)}
        return {
            "label": case.label(),
            "rows": case.rows,
            "cols": case.cols,
            "variant": case.variant,
            "params": {k: _finite(v) if isinstance(v, float) else v for k, v in params.items()},
        }
    f = case.features
    return {
        "label": case.label(),
        "vocab": case.vocab,
        "rows": case.rows,
        "hidden": case.hidden,
        "features": {
            "ignore": f.ignore,
            "extreme": f.extreme,
            "neg_inf": f.neg_inf,
            "temperature": f.temperature,
            "entropy": f.entropy,
        },
    }


def _plan_json(plan) -> dict:
    if isinstance(plan, cs.InvariancePlan):
        return {"vocab": plan.vocab, "hidden": plan.hidden}
    if isinstance(plan, chain.ChainInvariancePlan):
        return {"probe": plan.case.label(), "batches": list(plan.batches)}
    return {"cols": plan.cols, "variants": [label for label, _ in plan.variants]}


def _cell_json(cell: Cell) -> dict:
    out = {"op": cell.op, "dtype": cell.dtype, "backend": cell.backend, "status": cell.status}
    if cell.status == NA:
        out["reason"] = cell.na_reason
        return out
    worst = cell.worst
    out["worst"] = (
        None
        if worst is None
        else {"ratio": _finite(worst[1].ratio), "check": worst[1].name, "case": worst[0].case.label()}
    )
    out["cases"] = [
        {
            **_case_json(r.case),
            "ok": r.ok,
            "error": r.error,
            "seconds": round(r.seconds, 3),
            "deviations": [
                {"name": d.name, "worst": _finite(d.worst), "allowed": d.allowed, "ratio": _finite(d.ratio), "ok": d.ok}
                for d in r.deviations
            ],
        }
        for r in cell.results
    ]
    out["skipped_cases"] = [{"case": case.label(), "reason": reason} for case, reason in cell.skipped]
    inv = cell.invariance
    if inv is not None:
        out["invariance"] = {
            "claimed": inv.claimed,
            "bitwise": inv.bitwise,
            "verdict": inv.verdict,
            "details": inv.details,
            **_plan_json(inv.plan),
            "error": inv.error,
            "checks": [{"batch": c.batch, "position": c.position, "differs": c.differs} for c in inv.checks],
        }
    return out


def to_json(config: Config, cells: list[Cell], not_run: dict[str, str], env: dict, seconds: float) -> dict:
    """The full record of a run."""
    return {
        "environment": env,
        "config": {
            "device": str(config.device),
            "backends": config.backends,
            "dtypes": config.dtypes,
            "ops": config.ops,
            "quick": config.quick,
            "seed": config.seed,
        },
        "backends_not_run": not_run,
        "failed": any(c.status == FAIL for c in cells),
        "seconds": round(seconds, 1),
        "cells": [_cell_json(c) for c in cells],
    }


def _cell_text(cell: Cell) -> str:
    if cell.status == NA:
        return f"n/a ({cell.na_reason})"
    parts = [cell.status]
    worst = cell.worst
    if worst is not None:
        parts.append(f"worst {worst[1].ratio:.3g}")
    errors = sum(r.error is not None for r in cell.results)
    if errors:
        parts.append(f"{errors} error{'s' if errors > 1 else ''}")
    if cell.invariance is not None:
        parts.append(f"invariance: {cell.invariance.verdict}")
    return " · ".join(parts)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def to_markdown(config: Config, cells: list[Cell], not_run: dict[str, str], env: dict, seconds: float) -> str:
    """The human-readable report: matrix, worst cases, failures, n/a reasons, skips and the case list."""
    by_key = {(c.op, c.dtype, c.backend): c for c in cells}
    versions = env["backend_versions"]
    lines = [
        "# rlk parity report",
        "",
        f"- device: {env['device']} ({env['device_name']})",
        f"- versions: rlk {env['rlk']} (ABI {env['abi']}), torch {env['torch']}, triton {env['triton']}, "
        f"python {env['python']}",
        "- backends: "
        + ", ".join(
            f"{b} {versions.get(b, '?')}" + (" (Triton CPU interpreter)" if cs.interpreted(b, config.device) else "")
            for b in config.backends
        ),
        f"- command: `{env['command']}` (seed {config.seed}{', quick' if config.quick else ''}); {seconds:.0f} s",
        "",
        "## Matrix",
        "",
    ]
    rows = [
        [op, dtype] + [_cell_text(by_key[op, dtype, b]) for b in config.backends]
        for op in config.ops
        for dtype in config.dtypes
        if all((op, dtype, b) in by_key for b in config.backends)
    ]
    lines += _table(["op", "dtype"] + config.backends, rows)
    lines += [
        "",
        "PASS: every case is within the numerical contract (`rlk/core/contract.json`) on every output and gradient, "
        "against the reference backend run in fp64 on the same input values, and a backend that declares batch "
        "invariance gives the probe row the same bits alone and in every batch. worst: the largest "
        "deviation / allowed over all cases and checks (a check passes at <= 1). n/a: the backend declines the "
        "op/dtype on this device (its reason).",
        "",
        "## Worst check per cell",
        "",
    ]
    worst_rows = []
    for cell in cells:
        worst = cell.worst
        if worst is None:
            continue
        result, dev = worst
        worst_rows.append(
            [
                cell.op,
                cell.dtype,
                cell.backend,
                f"{dev.ratio:.3g}",
                dev.name,
                f"{dev.worst:.3g} / {dev.allowed:.3g}",
                result.case.label(),
                str(len(cell.results)),
            ]
        )
    lines += _table(["op", "dtype", "backend", "ratio", "check", "deviation / allowed", "case", "cases"], worst_rows)
    failures = [
        f"- {c.backend} {c.op} {c.dtype} {r.case.label()}: "
        + (
            f"error {r.error}"
            if r.error
            else ", ".join(
                f"{d.name} {d.worst:.3g} > {d.allowed:.3g} (ratio {d.ratio:.3g})" for d in r.deviations if not d.ok
            )
        )
        for c in cells
        for r in c.results
        if not r.ok
    ]
    failures += [
        f"- {c.backend} {c.op} {c.dtype} invariance: {c.invariance.verdict}: {c.invariance.details}"
        for c in cells
        if c.invariance is not None and not c.invariance.ok
    ]
    lines += ["", "## Failures", ""] + (failures or ["none"])
    skipped: dict[tuple[str, str, str], list[str]] = {}
    for c in cells:
        for case, reason in c.skipped:
            labels = skipped.setdefault((c.backend, c.op, reason), [])
            if case.label() not in labels:
                labels.append(case.label())
    skips = [
        f"- {backend} {op}: {len(labels)} cases skipped ({reason}): {'; '.join(labels)}"
        for (backend, op, reason), labels in skipped.items()
    ]
    notes = [f"- {name}: not run ({reason})" for name, reason in not_run.items()]
    lines += ["", "## Skipped", ""] + (notes + skips or ["none"])
    lines += ["", "## Cases", ""]
    for op in config.ops:
        if op in rl.RL_OPS:
            labels = [case.label() for case in rl.value_cases(op, config.device.type, config.quick)]
            lines.append(f"- {op} (float32): " + "; ".join(labels))
            rl_plan = rl.invariance_plan(op, config.device.type, config.quick)
            if rl_plan is not None:
                lines.append(
                    f"- {op} invariance: probe row alone vs in batches of "
                    f"{', '.join(map(str, rl_plan.batches))} rows (first/middle/last), {rl_plan.describe()}"
                )
            continue
        if op in chain.CHAIN_OPS or op in distill.DISTILL_OPS:
            module = chain if op in chain.CHAIN_OPS else distill
            labels = [case.label() for case in module.value_cases(op, config.device.type, config.quick)]
            lines.append(f"- {op}: " + "; ".join(labels))
            chain_plan = module.invariance_plan(op, config.device.type, config.quick)
            lines.append(
                f"- {op} invariance: probe alone vs in batches of {', '.join(map(str, chain_plan.batches))} "
                f"(first/middle/last), {chain_plan.describe()}"
            )
            continue
        plan = cs.invariance_plan(op, config.device.type, config.quick)
        labels = [case.label() for case in cs.value_cases(op, config.device.type, config.quick)]
        lines.append(f"- {op}: " + "; ".join(labels))
        size = f"V={plan.vocab}" + (f" H={plan.hidden}" if plan.hidden else "")
        lines.append(
            f"- {op} invariance: probe row alone vs in batches of {', '.join(map(str, plan.batches))} rows "
            f"(first/middle/last), {size}, per-row temperature, entropy on"
        )
    return "\n".join(lines) + "\n"


def write(out_dir: Path, markdown: str, record: dict) -> None:
    """``parity.md`` and ``parity.json`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "parity.md").write_text(markdown)
    (out_dir / "parity.json").write_text(json.dumps(record, indent=2) + "\n")
