"""Benchmarks of the RL objectives: ``rlk.policy_loss``, ``rlk.gae``, ``rlk.fused_linear_policy_loss`` and
``rlk.rollout_correction``.

Implementations (the ``impl`` parameter):

* ``policy_loss`` fwd+bwd on ``[B, T]`` fp32 tokens, the PPO loss with verl's defaults (clip 0.2, dual
  clip 3.0, log-ratio clamped to +-20, token-mean) and its metrics (clip fraction, approx KL):
  ``rlk``, ``rlk.policy_loss`` + ``autograd.grad``; ``rlk_loss_and_grad``, ``rlk.policy_loss_and_grad``
  (the same loss, metrics and gradient from one pass, no autograd); ``torch_eager``, the composition RL
  code writes by hand; ``torch_compile``, the same through ``torch.compile(dynamic=False)``. Bytes
  credited per step: ``B*T*(4+4+4+1)`` read (logprob, old logprob, advantages, bool mask) and
  ``B*T*4`` written (the gradient). The ``loss`` parameter: ``ppo``, token-mean over the batch's own tokens
  (counted from the mask in the step); ``ppo/global_tokens``, token-mean over a token count the caller passes
  (``global_tokens``: what a trainer with micro-batches or data-parallel ranks passes, RL_MATH's "global
  normalizers"; here the batch's own count, computed once before timing), in every implementation.
* ``gae`` on ``[B, T]`` fp32 (gamma 0.99, lambda 0.95), not differentiable: ``rlk``; ``python_loop``,
  the reverse loop over time with vectorized ``[B]`` steps that frameworks use; ``compiled_step``,
  the same loop whose body is ``torch.compile``'d (compiling the whole 8192-step loop would unroll it).
  Bytes credited: rewards, values (4 each) and mask (1) read, advantages and returns (4 each) written.
* ``fused_linear_policy_loss`` fwd+bwd from bf16 ``[B, T, H]`` hidden states and a ``[V, H]`` head, the ``option``
  ``grpo_k3``: GRPO's loss as verl runs it (PPO clip 0.2 / 0.28, token-mean, plus ``0.001 *`` the k3 KL against
  reference log-probs with verl's clamps): ``one_pass`` and ``lean``, ``rlk.fused_linear_policy_loss`` in those
  modes on the Triton backend (pinned); ``one_pass_auto`` and ``lean_auto``, the same modes on the backends rlk
  selects (with rlk-cuda installed on a Hopper GPU: its log-prob kernels, the policy loss on Triton);
  ``torch_eager``, the plain formula (logits, ``log_softmax`` in fp32, gather, the loss); ``torch_compile``, the
  same through ``torch.compile(dynamic=False)``, which keeps the logits for the backward. FLOPs credited 6NHV
  (what the plain formula and ``one_pass`` do; ``lean`` does 8NHV).
* ``rollout_correction`` on ``[B, T]`` fp32 log-probs (not differentiable), the ``option`` ``token/truncate``
  (verl's default TIS: log-ratio clamped to +-20, weights capped at 2) or ``sequence/mask`` (IcePop on the row
  sums, ``[0.5, 2]``): ``rlk``; ``torch_eager``, the composition frameworks write (weights, then the masked
  mean / max / min of the weights and the fraction of ratios above the cap, each a separate reduction);
  ``torch_compile``, the same through ``torch.compile(dynamic=False)``. The baselines compute 4 metrics where
  rlk computes all 35 of its own. Bytes credited: the two log-probs (4 each) and the mask (1) read, the
  weights (4) written.

Quick mode (``RLK_BENCH_QUICK=1`` or no GPU): tiny shapes.
"""

from __future__ import annotations

import torch
from torch import Tensor

import rlk

from .common import DEVICE, QUICK, SEED, CaseBase, _CaseSetup, _MemorySetup

CLIP, DUAL_CLIP, CLAMP = 0.2, 3.0, 20.0
GAMMA, LAM = 0.99, 0.95
RC_CLAMP, RC_UPPER, RC_LOWER = 20.0, 2.0, 0.5
TOKEN_SHAPES = [(8, 64)] if QUICK else [(512, 8192)]
LINEAR_SHAPES = [(2, 32, 64, 1000)] if QUICK else [(16, 1024, 4096, 151936)]
LINEAR_DTYPE = torch.float32 if QUICK else torch.bfloat16
GRPO_CLIP_HIGH, GRPO_KL_COEF = 0.28, 0.001


# ---------------------------------------------------------------------------
# PyTorch baselines
# ---------------------------------------------------------------------------


def torch_ppo_loss(
    logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, global_tokens: float | None = None
) -> tuple[Tensor, ...]:
    """verl-style PPO loss, token-mean (over ``global_tokens`` when given), with clip fraction and approx KL (means
    over the batch's tokens, as ``rlk.policy_loss``'s metrics), as eager PyTorch."""
    m = mask.float()
    n = m.sum().clamp(min=1)
    d = (logprob - old_logprob).clamp(-CLAMP, CLAMP)
    ratio = torch.exp(d)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - CLIP, 1 + CLIP)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * DUAL_CLIP
    per_token = torch.where(advantages < 0, torch.minimum(clipped, loss3), clipped)
    loss = (per_token * m).sum() / (n if global_tokens is None else global_tokens)
    clip_fraction = ((loss2 > loss1).float() * m).sum() / n
    approx_kl = (-d * m).sum() / n
    return loss, clip_fraction.detach(), approx_kl.detach()


def rlk_ppo_loss(
    logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, global_tokens: float | None = None
) -> tuple[Tensor, ...]:
    loss, metrics = rlk.policy_loss(
        logprob,
        old_logprob,
        advantages,
        mask,
        loss="ppo",
        clip_low=CLIP,
        dual_clip=DUAL_CLIP,
        clamp_log_ratio=CLAMP,
        agg="token-mean",
        global_tokens=global_tokens,
    )
    return loss, metrics["clip_fraction"], metrics["approx_kl"]


def rlk_ppo_loss_and_grad(
    logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, global_tokens: float | None = None
) -> tuple:
    out = rlk.policy_loss_and_grad(
        logprob,
        old_logprob,
        advantages,
        mask,
        loss="ppo",
        clip_low=CLIP,
        dual_clip=DUAL_CLIP,
        clamp_log_ratio=CLAMP,
        agg="token-mean",
        global_tokens=global_tokens,
    )
    return out.loss, out.grad_logprob, out.metrics["clip_fraction"], out.metrics["approx_kl"]


def torch_grpo_k3_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    old_logprob: Tensor,
    ref_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
) -> Tensor:
    """GRPO's loss from hidden states as plain PyTorch (what ``torch.compile`` is given): the logits, their fp32
    log-softmax at the targets, the clipped PPO loss and ``GRPO_KL_COEF`` times verl's clamped k3 estimator
    (``low_var_kl``), token-mean over the mask."""
    logits = hidden @ weight.T
    logprob = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logprob - old_logprob)
    pg = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP, 1 + GRPO_CLIP_HIGH))
    x = (ref_logprob - logprob).clamp(-20.0, 20.0)
    kl = (torch.exp(x) - x - 1).clamp(-10.0, 10.0)
    m = mask.float()
    return ((pg + GRPO_KL_COEF * kl) * m).sum() / m.sum().clamp(min=1)


def rlk_grpo_k3_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    old_logprob: Tensor,
    ref_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    mode: str,
) -> Tensor:
    loss, _ = rlk.fused_linear_policy_loss(
        hidden,
        weight,
        targets,
        old_logprob,
        advantages,
        mask,
        mode=mode,
        ref_logprob=ref_logprob,
        loss="ppo",
        clip_low=CLIP,
        clip_high=GRPO_CLIP_HIGH,
        kl="k3",
        kl_coef=GRPO_KL_COEF,
        agg="token-mean",
    )
    return loss


def torch_rollout_correction(
    old_logprob: Tensor, rollout_logprob: Tensor, mask: Tensor, option: str
) -> tuple[Tensor, ...]:
    """Importance weights (``option``: ``token/truncate`` or ``sequence/mask``, see the module docstring) and the
    masked mean / max / min of the weights and the fraction of ratios above the upper bound, as eager PyTorch."""
    d = torch.where(mask, old_logprob - rollout_logprob, 0.0)
    if option == "token/truncate":
        ratio = torch.exp(d.clamp(-RC_CLAMP, RC_CLAMP))
        weights = ratio.clamp(max=RC_UPPER)
    else:
        ratio = torch.exp(d.sum(dim=1, keepdim=True).clamp(-RC_CLAMP, RC_CLAMP)).expand_as(d)
        weights = torch.where((ratio >= RC_LOWER) & (ratio <= RC_UPPER), ratio, 0.0)
    weights = torch.where(mask, weights, 0.0)
    n = mask.sum().clamp(min=1)
    mean = weights.sum() / n
    top = torch.where(mask, weights, 0.0).amax()
    low = torch.where(mask, weights, float("inf")).amin()
    high = (mask & (ratio > RC_UPPER)).sum() / n
    return weights, mean, top, low, high


def rlk_rollout_correction(
    old_logprob: Tensor, rollout_logprob: Tensor, mask: Tensor, option: str
) -> tuple[Tensor, ...]:
    level, mode = option.split("/")
    weights, metrics = rlk.rollout_correction(
        old_logprob,
        rollout_logprob,
        mask,
        level=level,
        mode=mode,
        upper=RC_UPPER,
        lower=None if mode == "truncate" else RC_LOWER,
        clamp_log_ratio=RC_CLAMP,
    )
    return weights, metrics["weight_mean"], metrics["weight_max"], metrics["weight_min"], metrics["fraction_high"]


def torch_gae_step(
    rewards_t: Tensor, values_t: Tensor, mask_t: Tensor, next_value: Tensor, last_adv: Tensor
) -> tuple[Tensor, Tensor]:
    """One reverse step of GAE over ``[B]`` vectors, masked positions carrying ``V_next`` and ``a``."""
    delta = rewards_t + GAMMA * next_value - values_t
    adv = delta + GAMMA * LAM * last_adv
    next_value = torch.where(mask_t, values_t, next_value)
    last_adv = torch.where(mask_t, adv, last_adv)
    return next_value, last_adv


def torch_gae_loop(rewards: Tensor, values: Tensor, mask: Tensor, step=torch_gae_step) -> tuple[Tensor, Tensor]:
    """GAE as a Python loop over time (the frameworks' form)."""
    batch, length = rewards.shape
    next_value = torch.zeros(batch, device=rewards.device)
    last_adv = torch.zeros(batch, device=rewards.device)
    advantages = torch.empty_like(rewards)
    for t in reversed(range(length)):
        next_value, last_adv = step(rewards[:, t], values[:, t], mask[:, t], next_value, last_adv)
        advantages[:, t] = last_adv
    return advantages, advantages + values


# ---------------------------------------------------------------------------
# benchmark points
# ---------------------------------------------------------------------------


def _token_inputs(batch: int, length: int, gen: torch.Generator) -> tuple[Tensor, ...]:
    old = -torch.rand(batch, length, generator=gen, device=DEVICE) * 5
    logprob = old + 0.1 * torch.randn(batch, length, generator=gen, device=DEVICE)
    advantages = torch.randn(batch, length, generator=gen, device=DEVICE)
    mask = torch.rand(batch, length, generator=gen, device=DEVICE) < 0.9
    return logprob, old, advantages, mask


class PolicyLossCase(CaseBase):
    """``policy_loss`` fwd+bwd, PPO with verl's defaults, on ``[B, T]`` tokens (``loss``: ``ppo`` or
    ``ppo/global_tokens``)."""

    def __init__(self, op: str, impl: str, loss: str, shape: tuple[int, int]):
        gen = torch.Generator(DEVICE).manual_seed(SEED)
        logprob, self.old, self.advantages, self.mask = _token_inputs(*shape, gen)
        self.logprob = logprob.requires_grad_()
        if loss not in ("ppo", "ppo/global_tokens"):
            raise ValueError(f"unknown loss {loss!r}")
        self.global_tokens = float(self.mask.sum()) if loss == "ppo/global_tokens" else None
        self.work, self.unit = shape[0] * shape[1] * (4 + 4 + 4 + 1 + 4), "GB/s"
        fn = {"rlk": rlk_ppo_loss, "rlk_loss_and_grad": rlk_ppo_loss_and_grad}.get(impl, torch_ppo_loss)
        if impl == "torch_compile":
            torch.compiler.reset()
            fn = torch.compile(fn, dynamic=False)
        elif impl not in ("rlk", "rlk_loss_and_grad", "torch_eager"):
            raise ValueError(f"unknown impl {impl!r}")
        self.fn, self.fused = fn, impl == "rlk_loss_and_grad"
        self.decision = rlk.explain("policy_loss", self.logprob) if impl.startswith("rlk") else None
        self.step()

    def step(self) -> object:
        if self.fused:
            return self.fn(self.logprob, self.old, self.advantages, self.mask, self.global_tokens)[1]
        loss, *_ = self.fn(self.logprob, self.old, self.advantages, self.mask, self.global_tokens)
        return torch.autograd.grad(loss, self.logprob)


class GaeCase(CaseBase):
    """``gae`` (not differentiable) on ``[B, T]`` rewards, values and mask."""

    def __init__(self, op: str, impl: str, gamma_lam: str, shape: tuple[int, int]):
        gen = torch.Generator(DEVICE).manual_seed(SEED)
        batch, length = shape
        self.rewards = torch.randn(batch, length, generator=gen, device=DEVICE)
        self.values = torch.randn(batch, length, generator=gen, device=DEVICE)
        self.mask = torch.rand(batch, length, generator=gen, device=DEVICE) < 0.9
        self.work, self.unit = batch * length * (4 + 4 + 1 + 4 + 4), "GB/s"
        if impl == "rlk":
            self.fn = lambda: rlk.gae(self.rewards, self.values, self.mask, gamma=GAMMA, lam=LAM)
            self.decision = rlk.explain("gae", self.rewards)
        elif impl == "python_loop":
            self.fn = lambda: torch_gae_loop(self.rewards, self.values, self.mask)
        elif impl == "compiled_step":
            torch.compiler.reset()
            step = torch.compile(torch_gae_step, dynamic=False)
            self.fn = lambda: torch_gae_loop(self.rewards, self.values, self.mask, step=step)
        else:
            raise ValueError(f"unknown impl {impl!r}")
        self.step()

    def step(self) -> object:
        return self.fn()


class RolloutCorrectionCase(CaseBase):
    """``rollout_correction`` (not differentiable) on ``[B, T]`` training / rollout log-probs and a mask."""

    def __init__(self, op: str, impl: str, option: str, shape: tuple[int, int]):
        gen = torch.Generator(DEVICE).manual_seed(SEED)
        batch, length = shape
        self.old = -torch.rand(batch, length, generator=gen, device=DEVICE) * 5
        noise = 0.1 if option == "token/truncate" else length**-0.5
        self.rollout = self.old + noise * torch.randn(batch, length, generator=gen, device=DEVICE)
        self.mask = torch.rand(batch, length, generator=gen, device=DEVICE) < 0.9
        self.option = option
        self.work, self.unit = batch * length * (4 + 4 + 1 + 4), "GB/s"
        if option not in ("token/truncate", "sequence/mask"):
            raise ValueError(f"unknown option {option!r}")
        fn = rlk_rollout_correction if impl == "rlk" else torch_rollout_correction
        if impl == "torch_compile":
            torch.compiler.reset()
            fn = torch.compile(fn, dynamic=False)
        elif impl not in ("rlk", "torch_eager"):
            raise ValueError(f"unknown impl {impl!r}")
        self.fn = fn
        self.decision = rlk.explain("rollout_correction", self.old) if impl == "rlk" else None
        self.step()

    def step(self) -> object:
        return self.fn(self.old, self.rollout, self.mask, self.option)


class FusedLinearPolicyLossCase(CaseBase):
    """hidden -> log-prob -> GRPO loss (``grpo_k3``), fwd+bwd: rlk's two modes vs PyTorch eager and compiled."""

    def __init__(self, op: str, impl: str, loss: str, shape: tuple[int, int, int, int]):
        if loss != "grpo_k3":
            raise ValueError(f"unknown loss {loss!r}")
        gen = torch.Generator(DEVICE).manual_seed(SEED)
        b, t, h, v = shape
        self.hidden = torch.randn(b, t, h, generator=gen, device=DEVICE, dtype=LINEAR_DTYPE).requires_grad_()
        self.weight = torch.randn(v, h, generator=gen, device=DEVICE, dtype=LINEAR_DTYPE) * h**-0.5
        self.weight.requires_grad_()
        self.targets = torch.randint(0, v, (b, t), generator=gen, device=DEVICE)
        _, self.old, self.advantages, self.mask = _token_inputs(b, t, gen)
        self.ref = self.old + 0.05 * torch.randn(b, t, generator=gen, device=DEVICE)
        self.work, self.unit = 6 * b * t * h * v, "TFLOP/s"
        # one_pass / lean: rlk pinned to its Triton kernels on the GPU, the reference on the CPU; *_auto: the
        # backends rlk selects
        self.backend = "triton" if DEVICE.type == "cuda" and impl in ("one_pass", "lean") else None
        if impl in ("one_pass", "lean", "one_pass_auto", "lean_auto"):
            self.fn = lambda *args: rlk_grpo_k3_loss(*args, mode=impl.removesuffix("_auto"))
            with rlk.use_backend(self.backend):
                self.decision = rlk.explain("linear_logprob", self.hidden, self.weight, self.targets)
        elif impl == "torch_eager":
            self.fn = torch_grpo_k3_loss
        elif impl == "torch_compile":
            torch.compiler.reset()
            self.fn = torch.compile(torch_grpo_k3_loss, dynamic=False)
        else:
            raise ValueError(f"unknown impl {impl!r}")
        self.step()

    def step(self) -> object:
        with rlk.use_backend(self.backend):
            loss = self.fn(self.hidden, self.weight, self.targets, self.old, self.ref, self.advantages, self.mask)
            return torch.autograd.grad(loss, (self.hidden, self.weight))


# ---------------------------------------------------------------------------
# asv benchmarks
# ---------------------------------------------------------------------------


class PolicyLoss(_CaseSetup):
    """``policy_loss`` fwd+bwd: ms and GB/s (17 bytes per token)."""

    op, case_type, shape_names = "policy_loss", PolicyLossCase, "BT"
    param_names = ["impl", "loss", "shape"]
    params = [["rlk", "rlk_loss_and_grad", "torch_eager", "torch_compile"], ["ppo", "ppo/global_tokens"], TOKEN_SHAPES]

    def track_ms(self, impl: str, loss: str, shape: tuple[int, int]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_gbps(self, impl: str, loss: str, shape: tuple[int, int]) -> float:
        return self.case.rate()

    track_gbps.unit = "GB/s"


class Gae(_CaseSetup):
    """``gae``: ms and GB/s (17 bytes per token)."""

    op, case_type, shape_names = "gae", GaeCase, "BT"
    baselines = ("python_loop", "compiled_step")
    param_names = ["impl", "gamma_lam", "shape"]
    params = [["rlk", "python_loop", "compiled_step"], [f"{GAMMA}/{LAM}"], TOKEN_SHAPES]

    def track_ms(self, impl: str, gamma_lam: str, shape: tuple[int, int]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_gbps(self, impl: str, gamma_lam: str, shape: tuple[int, int]) -> float:
        return self.case.rate()

    track_gbps.unit = "GB/s"


class RolloutCorrection(_CaseSetup):
    """``rollout_correction``: ms and GB/s (13 bytes per token)."""

    op, case_type, shape_names = "rollout_correction", RolloutCorrectionCase, "BT"
    baselines = ("torch_eager", "torch_compile")
    param_names = ["impl", "option", "shape"]
    params = [["rlk", "torch_eager", "torch_compile"], ["token/truncate", "sequence/mask"], TOKEN_SHAPES]

    def track_ms(self, impl: str, option: str, shape: tuple[int, int]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_gbps(self, impl: str, option: str, shape: tuple[int, int]) -> float:
        return self.case.rate()

    track_gbps.unit = "GB/s"


class FusedLinearPolicyLoss(_CaseSetup):
    """``fused_linear_policy_loss`` (one pass, lean) vs PyTorch (compiled, eager), fwd+bwd: ms and TFLOP/s."""

    op, case_type, shape_names = "fused_linear_policy_loss", FusedLinearPolicyLossCase, "BTHV"
    baselines = ("torch_compile", "torch_eager", "lean")
    param_names = ["impl", "loss", "shape"]
    params = [
        ["one_pass", "lean", "one_pass_auto", "lean_auto", "torch_eager", "torch_compile"],
        ["grpo_k3"],
        LINEAR_SHAPES,
    ]

    def track_ms(self, impl: str, loss: str, shape: tuple[int, int, int, int]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_tflops(self, impl: str, loss: str, shape: tuple[int, int, int, int]) -> float:
        return self.case.rate()

    track_tflops.unit = "TFLOP/s"


class FusedLinearPolicyLossMemory(_MemorySetup):
    """Peak extra GPU memory (the gradients included) of each implementation."""

    op, case_type = "fused_linear_policy_loss", FusedLinearPolicyLossCase
    param_names, params = FusedLinearPolicyLoss.param_names, FusedLinearPolicyLoss.params
