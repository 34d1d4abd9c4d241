"""The ``--save-outputs DIR`` and ``--against DIR`` modes of ``python -m parity`` (:mod:`parity.stored`).

Exit codes: 0 pass; 1 a case fails (or, saving, fails the contract here: nothing is written); 2 bad input, one line on
stderr (missing or corrupt files, another format or case-set version, an unknown case, inputs that regenerate
differently, no stored case selected).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from parity import against as ag
from parity import report
from parity import stored as st
from parity import stored_report as sr


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _bad_input(message: str) -> int:
    print(f"python -m parity: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return 2


def save(args: argparse.Namespace, command: str) -> int:
    """Run the selected cases of the set on ``args.backends`` (the first that serves each case) and write
    ``args.save_outputs``; nothing is written if a case fails the contract against fp64 here."""
    cases = st.select_cases(args.ops, args.dtypes)
    if not cases:
        return _bad_input(f"--ops / --dtypes select no case of the stored set (its ops: {_set_ops()})")
    env = report.environment(args.device, command)
    start = time.perf_counter()
    saved = st.save_all(cases, args.backends, args.device, args.seed, _say)
    kept = [s for s in saved if s.record is not None]
    if not kept and all(s.error is None for s in saved):
        return _bad_input(f"--backends {','.join(args.backends)}: none runs a selected case on {args.device}")
    failed = any(not s.ok for s in saved)
    if not failed:
        st.write(args.save_outputs, st.payload_of(saved, args.seed), st.manifest_of(saved, args.seed, env))
    print(sr.save_markdown(saved, env, args.save_outputs, time.perf_counter() - start, not failed), flush=True)
    return 1 if failed else 0


def _set_ops() -> str:
    return ", ".join(dict.fromkeys(sc.op for sc in st.CASES))


def against(args: argparse.Namespace, command: str) -> int:
    """Compare ``args.backends`` here with the outputs stored in ``args.against`` (the cases of ``--ops`` /
    ``--dtypes`` among them); print the report, write it to ``args.out`` if given."""
    folder: Path = args.against
    try:
        manifest, payload = st.load(folder)
        cases = [st.case_table()[key] for key in payload["cases"]]
        cases = [sc for sc in cases if sc.op in args.ops and sc.dtype in args.dtypes]
        if not cases:
            return _bad_input(f"--against {folder}: --ops / --dtypes select none of its {len(payload['cases'])} cases")
        st.verify_inputs(cases, payload)
    except st.StoredError as exc:
        message = str(exc)
        named = message.startswith(("--against", str(folder)))
        return _bad_input(message if named else f"--against {folder}: {message}")
    env = report.environment(args.device, command)
    start = time.perf_counter()
    outcomes = ag.compare_all(cases, payload, args.backends, args.device, _say)
    seconds = time.perf_counter() - start
    markdown = sr.against_markdown(outcomes, manifest, env, args.backends, args.not_run, seconds)
    print(markdown, flush=True)
    if args.out is not None:
        record = sr.against_json(outcomes, manifest, env, args.backends, args.not_run, seconds)
        report.write(args.out, markdown, record)
    return ag.exit_code(outcomes)
