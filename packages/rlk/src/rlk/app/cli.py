"""The ``rlk`` command line: ``rlk info``, ``rlk consistency``, ``rlk demo``, ``rlk multimodal-parity`` and
``rlk multimodal-smoke`` (and ``rlk --version``).

Exit codes: 0 success; 1 a failed verdict (a consistency claim, a selfcheck); 2 a usage error, reported in one
line without a traceback (bad arguments, no GPU for ``--device cuda``, a missing optional dependency, an input the
run rejects). Every command's ``--device`` goes through :func:`add_device_argument`; the optional dependencies a
command imports (:func:`requirements`) are imported before it runs, and one that does not import is reported with
the extra that installs it (:mod:`rlk.integrations.extras`).

On the CPU rlk's batch-invariant chain runs through the Triton interpreter, which reads ``TRITON_INTERPRET=1``
when triton is first imported. ``main`` therefore sets the variable before anything imports triton when the
command will run on the CPU; if triton is already imported without it (``main`` called from a process that
imported it), the command is re-run as ``python -m rlk ...`` in a child process with the variable set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from rlk.app.consistency import MODELS as MODEL_NAMES  # any existing directory is a local checkpoint
from rlk.integrations import extras

DTYPES = ("float32", "bfloat16", "float16")
#: What the multimodal commands import beyond torch: transformers' Qwen2-VL image processor (Pillow) and model, and
#: a ``tokenizers`` tokenizer (all in ``rlk[hf]``).
MULTIMODAL_REQUIREMENTS = ("transformers", "tokenizers", "PIL")
DEVICE_HELP = "torch device: cpu, cuda or cuda:N (default: the GPU if any, else cpu)"


def _model_arg(value: str) -> str:
    if value in MODEL_NAMES or os.path.isdir(value):
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r} is neither a built-in model ({', '.join(MODEL_NAMES)}) nor an existing checkpoint directory"
    )


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def device_arg(value: str) -> str:
    """``--device`` of every command: a torch device of type cpu or cuda that torch sees here."""
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{value!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{value!r}: the rlk commands run on cpu or cuda devices")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(
                f"{value!r}: torch sees no CUDA GPU here (torch {torch.__version__}, "
                "torch.cuda.is_available() is False); use --device cpu"
            )
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{value!r}: torch sees {count} GPU(s) (cuda:0 to cuda:{count - 1})")
    return value


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--device`` option, checked by :func:`device_arg` (the same for every command)."""
    parser.add_argument("--device", type=device_arg, default=None, help=DEVICE_HELP)


def _check_out(parser: argparse.ArgumentParser, out: str) -> None:
    """``--out`` names a folder that exists or can be made, and can be written: checked before a long run."""
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        parser.error(f"--out {out}: cannot write there ({exc.strerror or exc})")


def build_parser() -> argparse.ArgumentParser:
    from rlk.core.version import __version__

    parser = argparse.ArgumentParser(prog="rlk", description="rlk (RL-Kernel) command line")
    parser.add_argument("--version", action="version", version=f"rlk {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, device, backends and which backend serves each op")
    info.add_argument(
        "--json",
        action="store_true",
        help="the same report as JSON (with --selfcheck: its lines and verdict under 'selfcheck')",
    )
    info.add_argument(
        "--selfcheck",
        action="store_true",
        help="also run each available backend's checks of what its invariance rests on, on this "
        "device (e.g. that the matmul's tiles per M range give the same bits); exit code 1 "
        "when one fails",
    )

    cons = sub.add_parser(
        "consistency",
        help="rollout vs training log-probs with rlk's batch-invariant chain off and on",
        description="Sample responses with a rollout-style path (padded, chunked prefill, KV-cache decode, shrinking "
        "batch) and score the same tokens with a training-style path (packed micro-batches, two "
        "splits, backward), with stock kernels and with rlk's batch-invariant chain; report the drift, "
        "where it starts (layer, op), and whether the rlk-on claims hold bit for bit. Exit code 1 when "
        "a gating verdict fails (an rlk-on bitwise claim; on a GPU also: stock kernels must drift).",
    )
    cons.add_argument(
        "--model",
        type=_model_arg,
        default="tiny",
        help=f"{' | '.join(MODEL_NAMES)} | PATH (a local Hugging Face checkpoint directory); default: tiny",
    )
    add_device_argument(cons)
    cons.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="model dtype (default: bfloat16 on a GPU, float32 on the CPU, the only one the CPU interpreter serves)",
    )
    cons.add_argument("--prompts", type=_positive, default=8, help="number of prompts (default 8)")
    cons.add_argument(
        "--max-new-tokens", type=_positive, default=16, help="sampled tokens per prompt at most (default 16)"
    )
    cons.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and sampling (default 0)")
    cons.add_argument(
        "--out", default=None, help="folder for report.json, drift.html and drift.png (default: ./rlk-consistency)"
    )
    cons.add_argument("--no-timing", action="store_true", help="skip the timed forward passes")
    cons.add_argument("--no-progress", action="store_true", help="no progress bar")
    cons.add_argument(
        "--rollout",
        choices=("hf", "vllm"),
        default="hf",
        help="who rolls out: hf (rlk's transformers rollout path, default) or vllm (a real vLLM engine, stock and "
        "with the rlk plugin, scored by transformers; CPU: float32 or float16; needs rlk[vllm])",
    )
    cons.add_argument(
        "--plant",
        choices=("padding-side", "weight"),
        default=None,
        help="with --rollout vllm: plant a mismatch (the trainer's padding on the other side of its mask, or one "
        "weight moved by one ulp) to see the prechecks catch it (exit code 1)",
    )

    demo = sub.add_parser(
        "demo", help="the consistency check on the built-in model, then linear_logprob's memory vs the PyTorch baseline"
    )
    add_device_argument(demo)
    demo.add_argument("--out", default=None, help="folder for the consistency report (default: ./rlk-demo)")
    demo.add_argument("--skip-consistency", action="store_true", help="only the linear_logprob memory showcase")
    from rlk.app import multimodal_parity, multimodal_smoke

    multimodal_parity.add_parser(sub)
    multimodal_smoke.add_parser(sub)
    return parser


def _device_of(args) -> str:
    device = getattr(args, "device", None)
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def requirements(args) -> tuple[str, ...]:
    """The optional modules (:data:`rlk.integrations.extras.OPTIONAL`) the command ``args`` asks for imports."""
    if args.command == "consistency" and args.rollout == "vllm":
        return ("transformers", "vllm")
    if args.command == "consistency" or (args.command == "demo" and not args.skip_consistency):
        return ("transformers",)
    if args.command == "multimodal-smoke" or (args.command == "multimodal-parity" and args.offline_processor):
        return MULTIMODAL_REQUIREMENTS
    return ()


def _needs_interpreter(args) -> bool:
    if args.command in ("info", "multimodal-parity", "multimodal-smoke"):
        return False
    if args.command == "demo" and args.skip_consistency:
        return False
    return _device_of(args).startswith("cpu")


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else list(argv)) == ["--version"]:
        # answered before the parser is built: the multimodal commands' parsers import torch
        from rlk.core.version import __version__

        print(f"rlk {__version__}")
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "consistency" and args.rollout == "vllm":
        if args.dtype not in (None, "float32", "float16") or not _device_of(args).startswith("cpu"):
            parser.error("--rollout vllm runs on the CPU (vLLM's CPU build) in float32 or float16")
    elif args.command == "consistency" and args.plant is not None:
        parser.error("--plant needs --rollout vllm")
    elif args.command == "consistency" and _device_of(args).startswith("cpu") and args.dtype not in (None, "float32"):
        parser.error(
            f"--dtype {args.dtype} on the CPU: rlk's chain runs in the Triton interpreter there, "
            "which serves float32 only"
        )
    if args.command == "consistency":
        args.out = args.out or "rlk-consistency"
    elif args.command == "demo":
        args.out = args.out or "rlk-demo"
    if args.command in ("consistency", "demo") and not (args.command == "demo" and args.skip_consistency):
        _check_out(parser, args.out)
    if _needs_interpreter(args) and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            # too late to switch triton to its interpreter in this process: run the command in a child
            env = dict(os.environ, TRITON_INTERPRET="1")
            argv = sys.argv[1:] if argv is None else list(argv)
            return subprocess.run([sys.executable, "-m", "rlk", *argv], env=env).returncode
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        extras.require(*requirements(args), needed_by=f"rlk {args.command}")
        return _run(args, parser)
    except ModuleNotFoundError as exc:  # also a module of rlk[hf] etc. imported deeper down
        hint = extras.hint(exc)
        if hint is None:
            raise
        print(f"rlk {args.command}: error: {hint}", file=sys.stderr)
        return 2


def _run(args, parser: argparse.ArgumentParser) -> int:
    if args.command == "multimodal-smoke":
        from rlk.app import multimodal_smoke

        return multimodal_smoke.run(args, parser)
    if args.command == "multimodal-parity":
        from rlk.app import multimodal_parity

        return multimodal_parity.run(args, parser)
    if args.command == "info":
        from rlk.app.info import info, report, selfcheck

        checked = selfcheck() if args.selfcheck else None
        if args.json:
            data = report()
            if checked is not None:
                data["selfcheck"] = {"ok": checked[1], "lines": checked[0]}
            print(json.dumps(data, indent=2))
        else:
            print(info())
            if checked is not None:
                print("\n".join(checked[0]))
        return 0 if checked is None or checked[1] else 1
    if args.command == "consistency" and args.rollout == "vllm":
        from rlk.app.consistency.vllm_rollout import run_vllm_consistency
        from rlk.core.dispatch import BackendError

        try:
            result = run_vllm_consistency(
                args.model,
                dtype=args.dtype,
                prompts=args.prompts,
                max_new_tokens=args.max_new_tokens,
                seed=args.seed,
                out=args.out,
                plant=args.plant,
            )
        except (ValueError, RuntimeError, BackendError) as exc:  # NotServed: ValueError; UnsupportedVLLM: RuntimeError
            print(f"rlk consistency: error: {exc}", file=sys.stderr)
            return 2
        return 0 if result["passed"] else 1
    if args.command == "consistency":
        from rlk.app.consistency.run import run_consistency
        from rlk.core.dispatch import BackendError

        try:
            result = run_consistency(
                args.model,
                device=args.device,
                dtype=args.dtype,
                prompts=args.prompts,
                max_new_tokens=args.max_new_tokens,
                seed=args.seed,
                out=args.out,
                progress=not args.no_progress,
                timing=not args.no_timing,
            )
        except (ValueError, BackendError) as exc:
            print(f"rlk consistency: error: {exc}", file=sys.stderr)
            return 2
        return 0 if result["passed"] else 1
    from rlk.app.demo import run_demo

    return run_demo(args.device, out=args.out, consistency=not args.skip_consistency)
