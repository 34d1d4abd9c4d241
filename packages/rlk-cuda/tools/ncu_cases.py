"""One launch of each rlk-cuda kernel family at the issue's benchmark shapes, for Nsight Compute.

    python packages/rlk-cuda/tools/ncu_cases.py selected|norm|linear_fwd|linear_bwd [--n N]

Runs the case once to warm up (outside the profiled range), then once inside
``torch.cuda.profiler.start()`` / ``stop()``, so that ``ncu --profile-from-start off`` profiles exactly the
second run's kernels. Shapes and inputs are bench_cuda.py's (selected_logprob bf16 [16384, 151936], rms_norm
bf16 [16384, 4096], linear_logprob bf16 N x 4096 x 151936 with entropy and both gradients, N=4096 by default to
keep the replays short). ``tools/ncu_profile.sh`` drives it.
"""

from __future__ import annotations

import argparse

import torch
from bench_cuda import linear_case, logprob_case, norm_case

from rlk_cuda import logprob as ck
from rlk_cuda import norm as cn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=("selected", "norm", "linear_fwd", "linear_bwd"))
    parser.add_argument("--n", type=int, default=None, help="rows (default: 16384; linear: 4096)")
    args = parser.parse_args()
    if args.case == "selected":
        _, fwd, bwd, _ = logprob_case(args.n or 16384, 151936)
        run = lambda: (fwd(ck), bwd(ck))  # noqa: E731
    elif args.case == "norm":
        _, fwd, bwd, _ = norm_case(args.n or 16384, 4096)
        run = lambda: (fwd(cn), bwd(cn))  # noqa: E731
    else:
        fwd, bwd, _, _, _ = linear_case(args.n or 4096)
        fwd(ck)  # the backward needs the forward's statistics
        run = (lambda: fwd(ck)) if args.case == "linear_fwd" else (lambda: bwd(ck))
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
