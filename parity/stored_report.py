"""Reports of the stored-outputs modes: a save's summary, and ``--against``'s Markdown matrix and JSON record
(cases x backends, in the style of :mod:`parity.report`)."""

from __future__ import annotations

from pathlib import Path

from parity import against as ag
from parity import stored as st
from parity.report import _finite, _table


def save_markdown(saved: list[st.Saved], env: dict, folder: Path, seconds: float, written: bool) -> str:
    """What a ``--save-outputs`` run stored: each case's backend and its worst check against fp64."""
    rows = []
    for s in saved:
        if s.reason is not None:
            rows.append([s.sc.key, "-", f"not saved ({s.reason})"])
        elif s.error is not None:
            rows.append([s.sc.key, s.backend, f"FAIL · error {s.error}"])
        else:
            worst = max(s.deviations, key=lambda d: d.ratio)
            verdict = "PASS" if s.ok else "FAIL"
            rows.append([s.sc.key, s.backend, f"{verdict} · worst {worst.ratio:.3g} ({worst.name})"])
    failed = [s for s in saved if s.record is not None and not s.ok or s.error is not None]
    if written:
        size = (folder / st.OUTPUTS_FILE).stat().st_size
        outcome = f"wrote {folder / st.OUTPUTS_FILE} ({size / 2**20:.2f} MiB) and {folder / st.MANIFEST_FILE}"
    else:
        outcome = f"wrote nothing: {len(failed)} case(s) fail the contract against fp64 here (see the table)"
    lines = [
        "# rlk stored outputs: save",
        "",
        f"- device: {env['device']} ({env['device_name']})",
        f"- versions: rlk {env['rlk']} (ABI {env['abi']}), torch {env['torch']}, triton {env['triton']}",
        f"- command: `{env['command']}`; {seconds:.0f} s",
        f"- {outcome}",
        "",
    ]
    lines += _table(["case", "backend", "vs fp64 here (contract)"], rows)
    return "\n".join(lines) + "\n"


def _stored_text(outcome: ag.Outcome) -> str:
    if outcome.error is not None:
        return f"FAIL · error {outcome.error}"
    worst = max((c.deviation.ratio for c in outcome.stored_checks), default=0.0)
    return f"{'PASS' if outcome.stored_ok else 'FAIL'} · {worst:.3g}"


def _failures(outcomes: list[ag.Outcome]) -> list[str]:
    lines = []
    for o in outcomes:
        if o.error is not None:
            lines.append(f"- {o.sc.key}: error {o.error}")
            continue
        bad = [c for c in o.stored_checks if not c.deviation.ok]
        if bad:
            lines.append(f"- {o.sc.key}: the stored side ({o.stored_backend}) is off: " + _deviations(bad))
        for cell in (c for c in o.cells if c.status == ag.FAIL):
            if cell.error is not None:
                lines.append(f"- {cell.backend} {o.sc.key}: error {cell.error}")
                continue
            off = [c for c in cell.checks if not c.deviation.ok]
            lines.append(f"- {cell.backend} {o.sc.key} (side off: {o.sides_off(cell)}): " + _deviations(off))
    return lines


def _deviations(checks: list[ag.Check]) -> str:
    return ", ".join(
        f"{c.deviation.name} {c.side} {c.deviation.worst:.3g} > {c.deviation.allowed:.3g} "
        f"(ratio {c.deviation.ratio:.3g})"
        for c in checks
    )


def against_markdown(
    outcomes: list[ag.Outcome], manifest: dict, env: dict, backends: list[str], not_run: dict, seconds: float
) -> str:
    """The matrix (stored cases x this machine's backends), failures saying which side is off, and what did not
    run."""
    stored_by = ", ".join(f"{name} {version}" for name, version in manifest["backends"].items())
    dirty = " (uncommitted changes)" if manifest.get("dirty") else ""
    versions = manifest["versions"]
    lines = [
        "# rlk stored-outputs parity report",
        "",
        f"- stored: {stored_by} on {manifest['device']} ({manifest['device_name']}); rlk {versions['rlk']}, "
        f"torch {versions['torch']}, triton {versions['triton']}; commit {manifest['commit']}{dirty}; "
        f"`{manifest['command']}` ({manifest['created']})",
        f"- here: {env['device']} ({env['device_name']}); rlk {env['rlk']} (ABI {env['abi']}), torch {env['torch']}, "
        f"triton {env['triton']}; backends {', '.join(backends)}",
        f"- command: `{env['command']}`; {seconds:.0f} s",
        "",
        "## Matrix",
        "",
    ]
    header = ["case", f"stored ({', '.join(manifest['backends'])}) vs fp64", *backends]
    rows = [[o.sc.key, _stored_text(o)] + [ag.cell_text(c) for c in o.cells] for o in outcomes]
    lines += _table(header, rows)
    lines += [
        "",
        "Every output and gradient is checked three ways under the numerical contract (`rlk/core/contract.json`), "
        "against the reference backend run here in fp64 on the same inputs: the stored outputs against fp64, this "
        "machine's backend against fp64, and this backend against the stored outputs within both sides' allowances "
        "(twice the contract's bound). Numbers are the worst deviation / allowed (a check passes at <= 1). Large "
        "gradients are stored as a sample (`[sample]`) and their L2 norm (`[norm]`), checked with the whole "
        "tensor's bound.",
        "",
        "## Failures",
        "",
    ]
    lines += _failures(outcomes) or ["none"]
    notes = [f"- {name}: not run ({reason})" for name, reason in not_run.items()]
    notes += [f"- not stored: {item['key']} ({item['reason']})" for item in manifest.get("not_saved", [])]
    lines += ["", "## Not run", ""] + (notes or ["none"])
    return "\n".join(lines) + "\n"


def _check_json(check: ag.Check) -> dict:
    d = check.deviation
    return {
        "name": d.name,
        "side": check.side,
        "worst": _finite(d.worst),
        "allowed": _finite(d.allowed),
        "ratio": _finite(d.ratio),
        "ok": d.ok,
    }


def _cell_json(outcome: ag.Outcome, cell: ag.Cell) -> dict:
    out = {"backend": cell.backend, "status": cell.status}
    if cell.status == ag.NA:
        return out | {"reason": cell.na_reason}
    side = outcome.sides_off(cell) if cell.status == ag.FAIL else None
    checks = [_check_json(c) for c in cell.checks]
    return out | {"error": cell.error, "side_off": side, "seconds": round(cell.seconds, 3), "checks": checks}


def against_json(
    outcomes: list[ag.Outcome], manifest: dict, env: dict, backends: list[str], not_run: dict, seconds: float
) -> dict:
    """The full record of an ``--against`` run."""
    return {
        "environment": env,
        "stored": manifest,
        "backends": backends,
        "backends_not_run": not_run,
        "failed": ag.exit_code(outcomes) != 0,
        "seconds": round(seconds, 1),
        "cases": [
            {
                "key": o.sc.key,
                "op": o.sc.op,
                "dtype": o.sc.dtype,
                "label": o.sc.case.label(),
                "stored_backend": o.stored_backend,
                "stored_ok": o.stored_ok,
                "error": o.error,
                "stored_checks": [_check_json(c) for c in o.stored_checks],
                "cells": [_cell_json(o, c) for c in o.cells],
            }
            for o in outcomes
        ],
    }
