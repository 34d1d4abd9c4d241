"""``python -m parity``: run the parity matrix, print it, optionally write it to a folder."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import warnings
from pathlib import Path

import torch

from parity import report, stored_cli
from parity.rl import RL_OPS
from parity.run import ALL_OPS as OPS
from parity.run import FAIL, Config, run_matrix, runnable_backends

DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m parity",
        description="Compare every available rlk backend with the reference run in fp64, under the numerical "
        "contract, and check batch invariance. Exit code 1 if anything fails.",
    )
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device, help=f"torch device (default: {default_device})")
    parser.add_argument("--backends", help="comma-separated backends (default: every one that serves the device)")
    parser.add_argument(
        "--dtypes",
        default="bf16,fp16,fp32",
        help="comma-separated dtypes (default: bf16,fp16,fp32; the RL-objective ops run fp32 only)",
    )
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated ops (default: {','.join(OPS)})")
    parser.add_argument("--quick", action="store_true", help="a small subset of the cases (CI smoke)")
    parser.add_argument("--out", type=Path, help="write parity.md and parity.json into this folder")
    parser.add_argument(
        "--seed", type=int, help="seed of the generated inputs (default: 0; --against uses the stored one)"
    )
    stored = parser.add_mutually_exclusive_group()
    stored.add_argument(
        "--save-outputs",
        type=Path,
        metavar="DIR",
        help="run the fixed stored case set (parity/stored.py) on --backends, each case on the first that serves it, "
        "and write DIR/outputs.pt and DIR/manifest.json",
    )
    stored.add_argument(
        "--against",
        type=Path,
        metavar="DIR",
        help="compare this machine's backends with the outputs stored in DIR by --save-outputs, under the contract",
    )
    args = parser.parse_args(argv)
    _check_stored_mode(parser, args)
    args.seed = 0 if args.seed is None else args.seed
    try:
        args.dtypes = list(dict.fromkeys(DTYPE_ALIASES[d] for d in _split(args.dtypes)))
    except KeyError as exc:
        parser.error(f"unknown dtype {exc.args[0]!r}; use bf16, fp16 or fp32")
    args.ops = _split(args.ops)
    unknown = [op for op in args.ops if op not in OPS]
    if unknown:
        parser.error(f"unknown op(s) {', '.join(unknown)}; ops: {', '.join(OPS)}")
    if "float32" not in args.dtypes and all(op in RL_OPS for op in args.ops):
        parser.error(f"{', '.join(args.ops)}: float32 only; add fp32 to --dtypes")
    args.device = torch.device(args.device)
    runnable, not_run = runnable_backends(args.device)
    if args.backends:
        wanted = _split(args.backends)
        refused = [f"{b}: {not_run.get(b, 'not installed')}" for b in wanted if b not in runnable]
        if refused:
            parser.error(f"cannot run on {args.device}: " + "; ".join(refused))
        runnable = wanted
    args.backends, args.not_run = runnable, not_run
    return args


def _check_stored_mode(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors of --save-outputs / --against (parity/stored_cli.py)."""
    mode = "--save-outputs" if args.save_outputs is not None else "--against" if args.against is not None else None
    if mode is not None and args.quick:
        parser.error(f"--quick does not apply to {mode}: it runs the fixed stored case set")
    if args.save_outputs is not None and not args.backends:
        parser.error("--save-outputs needs --backends: the backend(s) whose outputs are stored, in order of preference")
    if args.against is not None and args.seed is not None:
        parser.error("--seed does not apply to --against: the inputs are regenerated from the seed stored in DIR")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "parity", *argv])
    # The Triton interpreter evaluates both sides of tl.where on masked lanes (log(0), 0 * -inf); numpy warns.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
    if args.save_outputs is not None:
        return stored_cli.save(args, command)
    if args.against is not None:
        return stored_cli.against(args, command)
    config = Config(args.device, args.backends, args.dtypes, args.ops, args.quick, args.seed)
    env = report.environment(config.device, command)
    start = time.perf_counter()
    cells = run_matrix(config)
    seconds = time.perf_counter() - start
    markdown = report.to_markdown(config, cells, args.not_run, env, seconds)
    print(markdown, flush=True)
    if args.out is not None:
        report.write(args.out, markdown, report.to_json(config, cells, args.not_run, env, seconds))
    return 1 if any(c.status == FAIL for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
