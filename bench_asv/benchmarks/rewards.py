"""Benchmarks of ``rlk.scatter_rewards``: sequence rewards to ``[B, T]`` token rewards / advantages.

Implementations (the ``impl`` parameter), not differentiable:

* ``rlk``: ``rlk.scatter_rewards`` on the backend rlk selects;
* ``torch_eager``: the composition frameworks write: ``(rewards * weights).nansum(1)`` (TRL), the overlong penalty
  from ``mask.sum(1)`` (verl's DAPO reward manager), ``view(-1, G)`` group statistics (TRL / verl) and the
  placement (``torch.where(mask, adv[:, None], 0)``, or a scatter at the last masked position, OpenRLHF's
  ``eos_indices``);
* ``torch_compile``: the same through ``torch.compile(dynamic=False)``.

Options: ``grpo/broadcast`` (GRPO's token advantages: 3 reward columns, NaN entries, overlong penalty, groups of
``GROUP``, mean / unbiased std, broadcast) and ``none/last`` (verl's reward tensor: the score plus the overlong
penalty at the last token). Bytes credited per step: the mask read (1 per token) and the output written (4 per token),
what any implementation must move; the per-sequence inputs are negligible.

GPU shape: B = 512 sequences of T = 8192 tokens, groups of 8. Quick mode (``RLK_BENCH_QUICK=1`` or no GPU): tiny
shapes.
"""

from __future__ import annotations

import torch
from torch import Tensor

import rlk

from .common import DEVICE, QUICK, SEED, CaseBase, _CaseSetup

GROUP, EPS = 8, 1e-6
WEIGHTS = (1.0, 0.5, 0.25)
OVERLONG_PENALTY = 1.0
SHAPES = [(16, 64)] if QUICK else [(512, 8192)]
OPTIONS = ("grpo/broadcast", "none/last")


def overlong(length: int) -> tuple[int, int, float]:
    """``(max_len, cache, penalty)`` of the benchmark: the last quarter of the length is the buffer."""
    return length, length // 4, OVERLONG_PENALTY


def torch_scatter_rewards(rewards: Tensor, weights: Tensor, mask: Tensor, option: str) -> Tensor:
    """The framework composition of the module docstring, as eager PyTorch."""
    max_len, cache, penalty = overlong(mask.shape[1])
    lengths = mask.sum(1)
    scores = (rewards * weights).nansum(1)
    excess = (lengths - (max_len - cache)).clamp(0, cache)
    scores = scores - penalty * torch.where(lengths > max_len, 1.0, excess / cache)
    if option == "grpo/broadcast":
        grouped = scores.view(-1, GROUP)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + EPS)).view(-1)
        return torch.where(mask, adv[:, None], 0.0)
    last = mask.shape[1] - 1 - mask.flip(1).int().argmax(1)
    return torch.zeros(mask.shape, device=mask.device).scatter_(1, last[:, None], scores[:, None])


def rlk_scatter_rewards(rewards: Tensor, weights: Tensor, mask: Tensor, option: str) -> Tensor:
    mode, placement = option.split("/")
    groups = {"group_mode": mode, "group_size": GROUP} if mode != "none" else {}
    return rlk.scatter_rewards(
        rewards,
        mask,
        reward_weights=weights,
        overlong=overlong(mask.shape[1]),
        placement=placement,
        eps=EPS,
        **groups,
    )


def make_inputs(batch: int, length: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Verifier-like reward columns (NaN entries in the second), device weights, right-padded responses whose
    lengths spread over the overlong buffer (none empty)."""
    rewards = (torch.rand(batch, len(WEIGHTS), generator=gen, device=DEVICE) < 0.5).float()
    rewards[::3, 1] = float("nan")
    weights = torch.tensor(WEIGHTS, device=DEVICE)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen, device=DEVICE)
    mask = torch.arange(length, device=DEVICE)[None, :] < lengths[:, None]
    return rewards, weights, mask


class ScatterRewardsCase(CaseBase):
    """``scatter_rewards`` on ``[B, T]`` (not differentiable)."""

    def __init__(self, op: str, impl: str, option: str, shape: tuple[int, int]):
        if option not in OPTIONS:
            raise ValueError(f"unknown option {option!r}")
        gen = torch.Generator(DEVICE).manual_seed(SEED)
        self.rewards, self.weights, self.mask = make_inputs(*shape, gen)
        self.option = option
        self.work, self.unit = shape[0] * shape[1] * (1 + 4), "GB/s"
        fn = rlk_scatter_rewards if impl == "rlk" else torch_scatter_rewards
        if impl == "torch_compile":
            torch.compiler.reset()
            fn = torch.compile(fn, dynamic=False)
        elif impl not in ("rlk", "torch_eager"):
            raise ValueError(f"unknown impl {impl!r}")
        self.fn = fn
        self.decision = rlk.explain("scatter_rewards", self.rewards) if impl == "rlk" else None
        self.step()

    def step(self) -> object:
        return self.fn(self.rewards, self.weights, self.mask, self.option)


class ScatterRewards(_CaseSetup):
    """``scatter_rewards``: ms and GB/s (5 bytes per token)."""

    op, case_type, shape_names = "scatter_rewards", ScatterRewardsCase, "BT"
    baselines = ("torch_eager", "torch_compile")
    param_names = ["impl", "option", "shape"]
    params = [["rlk", "torch_eager", "torch_compile"], list(OPTIONS), SHAPES]

    def track_ms(self, impl: str, option: str, shape: tuple[int, int]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_gbps(self, impl: str, option: str, shape: tuple[int, int]) -> float:
        return self.case.rate()

    track_gbps.unit = "GB/s"
