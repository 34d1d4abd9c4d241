"""The ``rlk`` command line: ``rlk info`` and ``rlk demo``."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlk", description="rlk (RL-Kernel) command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, device, backends and which backend serves each op")
    demo = sub.add_parser("demo", help="run both log-prob ops on this machine's best backend; show memory saved")
    demo.add_argument("--device", default=None, help="torch device (default: the GPU if any, else cpu)")
    args = parser.parse_args(argv)
    if args.command == "info":
        from rlk.info import info

        print(info())
        return 0
    from rlk.demo import run_demo

    return run_demo(args.device)
