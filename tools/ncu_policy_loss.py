"""One ``rlk.policy_loss_and_grad`` step (the benchmark's PPO step, [512, 8192] fp32) inside a CUDA profiler range,
for Nsight Compute: what limits the token pass and the count kernel (throughput, occupancy, stall reasons).

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis --print-details all \\
        python3 tools/ncu_policy_loss.py [--shape 512,8192] [--set BLOCK_T=1024 NUM_WARPS=4]
"""

from __future__ import annotations

import argparse

import torch
from profile_policy_loss import fused_step, ppo_inputs  # tools/, next to this script

import rlk
from rlk_triton import policy_loss as tk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="512,8192")
    parser.add_argument("--set", nargs="*", default=[], help="NAME=value for constants of rlk_triton.policy_loss")
    args = parser.parse_args()
    for spec in args.set:
        name, value = spec.split("=", 1)
        setattr(tk, name, int(value) if value.isdigit() else value)
    b, t = (int(x) for x in args.shape.split(","))
    logprob, old, adv, mask = ppo_inputs(b, t, seed=0)
    with rlk.use_backend("triton"):
        for _ in range(3):
            fused_step(logprob, old, adv, mask)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fused_step(logprob, old, adv, mask)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
