"""TRL drop-ins (written for trl 1.16.0), each with rlk computing the log-probs from the last hidden states and the
LM head (:func:`rlk.integrations.hf.apply`: :func:`rlk.linear_logprob`, no logits) and the loss with rlk:

* :class:`RLKGRPOTrainer` is ``trl.GRPOTrainer`` with the loss :func:`rlk.policy_loss`, for every ``loss_type``;
  :func:`policy_loss_kwargs` maps TRL's configuration, :func:`compute_loss` replaces ``GRPOTrainer._compute_loss``;
* :class:`RLKDPOTrainer` is ``trl.DPOTrainer`` with the sequence log-probs of the policy and the reference model
  summed from rlk's per-token log-probs and the loss :func:`rlk.dpo_loss` (:data:`DPO_LOSS_TYPES`).

What TRL computes that rlk cannot express exactly is refused at construction (:func:`check_supported`,
:func:`check_dpo_supported`), naming the option. Guide and the exact argument mappings: ``docs/migration.md``.
Importing this module imports trl; without it (or accelerate) the import raises
:class:`~rlk.integrations.extras.MissingDependency` (an ImportError): ``pip install 'rlk[trl]'``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

import rlk
import rlk.integrations.hf
from rlk.integrations.extras import MissingDependency

try:
    from accelerate.utils import is_peft_model
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import use_adapter
except ModuleNotFoundError as exc:  # trl, or a package trl needs, is not installed
    raise MissingDependency(exc.name or "trl", "rlk.integrations.trl", extra="trl") from exc

#: TRL's loss types of the clipped-ratio (PPO) family.
PPO_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
LOSS_TYPES = (*PPO_FAMILY, "cispo", "sapo", "vespo")
#: The multimodal inputs TRL's loss forwards to the model (rlk's log-prob path is text-only).
_MULTIMODAL = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def _f32(x: float) -> float:
    """``x`` rounded to float32: TRL builds its per-token SAPO temperatures and VESPO shape parameters with
    ``torch.where`` on Python floats, which makes float32 tensors whatever the log-probs' dtype."""
    return float(torch.tensor(x, dtype=torch.float32))


# ---------------------------------------------------------------------------
# what rlk computes exactly
# ---------------------------------------------------------------------------


def check_supported(trainer) -> None:
    """Raise ``ValueError`` (naming the TRL option) for a configuration rlk cannot compute exactly.

    ``trainer`` is a ``GRPOTrainer`` (or anything with the attributes TRL's ``_compute_loss`` reads).
    """
    loss_type, level, args = trainer.loss_type, trainer.importance_sampling_level, trainer.args
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of {', '.join(map(repr, LOSS_TYPES))}, got {loss_type!r}")
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level: expected 'token' or 'sequence', got {level!r}")
    if level == "sequence" and loss_type in ("cispo", "sapo"):
        raise ValueError(
            f"importance_sampling_level='sequence' with loss_type={loss_type!r}: TRL caps / gates the "
            f"sequence ratio, rlk's {loss_type} uses the token ratio; use importance_sampling_level="
            "'token' or trl.GRPOTrainer"
        )
    if args.delta is not None:
        if level == "sequence":
            raise ValueError(
                "delta with importance_sampling_level='sequence': rlk's sequence-level loss (gspo) has "
                "no two-sided clip; set delta=None or use trl.GRPOTrainer"
            )
        if loss_type in PPO_FAMILY and not args.delta > 1.0 + trainer.epsilon_high:
            raise ValueError(
                f"delta={args.delta}: rlk's dual clip equals TRL's two-sided clip only for delta > 1 + "
                f"epsilon_high = {1.0 + trainer.epsilon_high:g} (TRL's recommendation)"
            )
    if trainer.beta != 0.0 and args.use_bias_correction_kl and level == "sequence":
        raise ValueError(
            "use_bias_correction_kl=True with importance_sampling_level='sequence' and beta != 0: TRL "
            "weights each token's KL by the sequence ratio with its gradient, which rlk has no form of; "
            "set use_bias_correction_kl=False (or importance_sampling_level='token')"
        )
    if (
        loss_type == "vespo"
        and trainer.use_vllm
        and trainer.vllm_importance_sampling_correction
        and not trainer.vllm_importance_sampling_mode.startswith("token")
    ):
        raise ValueError(
            "vespo with a sequence-level vllm_importance_sampling_mode: TRL refuses it too; use "
            "'token_truncate' or 'token_mask'"
        )
    if trainer.aux_loss_enabled:
        raise ValueError(
            "the MoE router auxiliary loss (output_router_logits): not on rlk's log-prob path; use trl.GRPOTrainer"
        )


# ---------------------------------------------------------------------------
# the mapping TRL -> rlk
# ---------------------------------------------------------------------------


def policy_loss_kwargs(trainer, mask: Tensor, num_items_in_batch: Tensor | float | None = None) -> dict:
    """The :func:`rlk.policy_loss` keyword arguments of TRL's policy and KL terms for one micro-batch.

    ``mask`` the ``[B, T]`` loss mask (``completion_mask``, times ``tool_mask``), ``num_items_in_batch`` the
    input TRL passes (needed by dapo, cispo and vespo). With ``G`` TRL's gradient-accumulation steps in
    training (1 in eval), ``B`` the rows of the micro-batch (empty rows included, as TRL's means count them)
    and ``P`` the processes, ``r = exp(logprob - old)`` (no log-ratio clamp):

    * grpo / bnpo / dr_grpo / dapo / luspo: ``loss="ppo"`` (``"gspo"`` at ``importance_sampling_level=
      "sequence"``), ``clip_low=epsilon``, ``clip_high=epsilon_high``, ``dual_clip=delta``;
    * cispo: ``loss="cispo", cispo_form="upper", clip_high=epsilon_high`` (the cap itself);
    * sapo: ``loss="sapo", sapo_tau=(sapo_temperature_pos, sapo_temperature_neg)``;
    * vespo: ``loss="vespo", clamp_log_ratio=20, vespo_k=(vespo_k_pos, vespo_k_neg),
      vespo_lambda=(max(vespo_lambda_pos, 1e-4), max(vespo_lambda_neg, 1e-4))``;
    * ``beta != 0``: ``kl_coef=beta``, k3 unclamped; with ``use_bias_correction_kl`` (token level)
      ``kl="k3+", kl_unbiased=True``: TRL's ``k3 * r`` with the gradient through ``r`` has the value
      ``k3 * sg(r)`` and the gradient ``sg(r) * (k3' + k3) = sg(r) * (logprob - ref)``, rlk's straight-through
      k3 weighted by the detached ratio;
    * aggregation: grpo, sapo ``seq-mean-token-mean`` over ``B G`` sequences; bnpo ``token-mean`` over
      ``max(sum(mask), 1) G`` tokens; dr_grpo ``seq-mean-token-sum-norm`` over ``B G`` sequences and
      ``loss_scale=max_completion_length``; dapo, cispo, vespo ``token-mean`` over
      ``max(num_items_in_batch, 1) / P * G / steps_per_generation`` tokens (``/ P`` only in eval); luspo
      ``seq-mean-token-sum`` over ``B G`` sequences.
    """
    loss_type, level, args = trainer.loss_type, trainer.importance_sampling_level, trainer.args
    training = trainer.model.training
    g = trainer.current_gradient_accumulation_steps if training else 1
    b = mask.shape[0]
    kw: dict = {"clip_low": trainer.epsilon_low, "clip_high": trainer.epsilon_high, "clamp_log_ratio": None}
    if loss_type == "cispo":
        kw.update(loss="cispo", cispo_form="upper")
    elif loss_type == "sapo":
        kw.update(loss="sapo", sapo_tau=(_f32(args.sapo_temperature_pos), _f32(args.sapo_temperature_neg)))
    elif loss_type == "vespo":
        kw.update(
            loss="vespo",
            clamp_log_ratio=20.0,
            vespo_k=(_f32(args.vespo_k_pos), _f32(args.vespo_k_neg)),
            vespo_lambda=(max(_f32(args.vespo_lambda_pos), _f32(1e-4)), max(_f32(args.vespo_lambda_neg), _f32(1e-4))),
        )
    else:
        kw["loss"] = "gspo" if level == "sequence" else "ppo"
        if args.delta is not None:
            kw["dual_clip"] = args.delta
    if trainer.beta != 0.0:
        kw.update(kl_coef=trainer.beta, kl="k3", kl_k3_clamp=False)
        if args.use_bias_correction_kl:
            kw.update(kl="k3+", kl_unbiased=True)
    if loss_type in ("grpo", "sapo"):
        kw.update(agg="seq-mean-token-mean", global_seqs=b * g)
    elif loss_type == "bnpo":
        kw.update(agg="token-mean", global_tokens=mask.sum().clamp(min=1) * g)
    elif loss_type == "dr_grpo":
        kw.update(agg="seq-mean-token-sum-norm", global_seqs=b * g, loss_scale=trainer.max_completion_length)
    elif loss_type in ("dapo", "cispo", "vespo"):
        if num_items_in_batch is None:
            raise ValueError(f"num_items_in_batch: loss_type={loss_type!r} normalizes by it (TRL's inputs carry it)")
        n = torch.as_tensor(num_items_in_batch).clamp(min=1.0) / trainer.accelerator.num_processes
        kw.update(agg="token-mean", global_tokens=n * g / args.steps_per_generation if training else n)
    else:  # luspo
        kw.update(agg="seq-mean-token-sum", global_seqs=b * g)
    return kw


# ---------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------


def _global_mean(trainer, mean: Tensor, count: Tensor) -> float:
    """A token mean over every process (TRL's ``global_masked_mean``): sums and counts reduced, then divided."""
    totals = trainer.accelerator.reduce(torch.stack([mean.double() * count, count.double()]), reduction="sum")
    return float(totals[0] / totals[1].clamp(min=1.0))


def _entropy_coefficient(trainer) -> float:
    """The coefficient of this micro-batch's entropy bonus (adaptive control: applied only while the entropy of the
    previous optimizer step was at or below the target)."""
    if trainer.use_adaptive_entropy and not trainer._last_world_entropy <= trainer.args.entropy_target:
        return 0.0
    return trainer.entropy_coef


def _adaptive_entropy_update(trainer, entropies: Tensor, mask: Tensor) -> None:
    """Adaptive entropy control (Skywork-OR1), TRL's: add this micro-batch's entropy sum and token count to the
    window; at an optimizer-step boundary take the mean over the window and every process, and move the
    coefficient by ``entropy_coef_delta`` towards more entropy (mean <= target: up) or less (down), within
    ``[entropy_coef_min, entropy_coef_max]``."""
    args = trainer.args
    stats = torch.stack([(entropies.detach() * mask).sum(), mask.sum().to(entropies.dtype)])
    window = trainer._entropy_window_stats
    trainer._entropy_window_stats = stats if window is None else window + stats
    if not trainer.accelerator.sync_gradients:
        return
    total = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
    mean = float(total[0] / total[1].clamp(min=1.0))
    if mean <= args.entropy_target:
        trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
    else:
        trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
    trainer._last_world_entropy = mean
    trainer._entropy_window_stats = None


def rollout_weights(trainer, inputs: dict, mask: Tensor) -> Tensor | None:
    """TRL's vLLM importance-sampling correction (``vllm_importance_sampling_correction``) as
    :func:`rlk.rollout_correction` of the old (training-engine) and the sampling (vLLM) log-probs: the mode
    ``"<level>_<mode>"`` (``token`` / ``sequence`` x ``truncate`` / ``mask``) is ``level=, mode=``,
    ``vllm_importance_sampling_clip_max`` / ``_min`` are ``upper`` / ``lower``, no log-ratio clamp; ``[B, T]``
    weights equal to TRL's ``importance_sampling_ratio`` on the mask (0 off it), or None when the correction is
    off."""
    if not (trainer.use_vllm and trainer.vllm_importance_sampling_correction):
        return None
    level, mode = trainer.vllm_importance_sampling_mode.split("_")
    old = inputs["old_per_token_logps"]
    sampling = inputs["sampling_per_token_logps"].to(old.dtype)  # vLLM's come in float32 (TRL promotes them too)
    weights, _ = rlk.rollout_correction(
        old,
        sampling,
        mask,
        level=level,
        mode=mode,
        upper=trainer.vllm_importance_sampling_clip_max,
        lower=trainer.vllm_importance_sampling_clip_min,
        clamp_log_ratio=None,
    )
    return weights


def compute_loss(trainer, model, inputs: dict) -> Tensor:
    """``GRPOTrainer._compute_loss`` on rlk: the same loss, gradient and logged metrics (those whose definitions
    rlk shares, under TRL's names; rlk's own under ``rlk/``).

    Per micro-batch: the log-probs and entropies from ``trainer._get_per_token_logps_and_entropies`` (rlk's in
    :class:`RLKGRPOTrainer`), then one :func:`rlk.policy_loss` call with :func:`policy_loss_kwargs` for the
    policy and KL terms. TRL's policy-term factors (the high-entropy token mask of ``top_entropy_quantile``, the
    off-policy sequence mask of ``off_policy_mask_threshold``, both by TRL's own selection methods, and the vLLM
    importance-sampling ratio, :func:`rollout_weights`) are rlk's ``importance_weights``; for vespo the ratio enters
    the sequence weight
    (``importance_weights``, as TRL does: rlk sums its logs over the loss mask, TRL over every position, where
    its ratio is 1 unless ``vllm_importance_sampling_clip_min > 1``) and the masks zero the advantages instead
    (its loss is linear in ``A``). The entropy bonus ``- coef * token-mean(entropy) / G`` (over the entropy-masked
    tokens) is a second call (``loss="gpg"``, zero advantages).
    """
    check_supported(trainer)
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    logprob, entropy, _ = trainer._get_per_token_logps_and_entropies(
        model,
        input_ids,
        attention_mask,
        completion_ids.size(1),
        compute_entropy=True,
        compute_aux_loss=trainer.aux_loss_enabled,
        **{name: inputs.get(name) for name in _MULTIMODAL},
    )
    training = trainer.model.training
    mode = "train" if training else "eval"
    accum = trainer.current_gradient_accumulation_steps if training else 1
    loss_type = trainer.loss_type
    # rlk takes float64 for all of a call's inputs or none; TRL's advantages come in float32 whatever the model's dtype
    # (its torch code promotes them), as may the stored log-probs: in the log-probs' dtype, as TRL computes with them
    advantages = inputs["advantages"].to(logprob.dtype)
    if advantages.dim() == 2 and advantages.shape[1] > 1 and trainer.importance_sampling_level == "sequence":
        raise ValueError(
            "advantages: per-token advantages with importance_sampling_level='sequence' (rlk's gspo "
            "equals TRL's sequence ratio for one advantage per sequence)"
        )
    old = inputs.get("old_per_token_logps")  # None: on-policy, old = logprob.detach() (rlk's and TRL's convention)
    old = None if old is None else old.to(logprob.dtype)

    # TRL's policy-term factors: token and sequence masks (its own selection rules) and the vLLM IS ratio
    keep = None
    entropy_mask = None
    if trainer.top_entropy_quantile < 1.0:
        entropy_mask = trainer.get_high_entropy_mask(entropy, mask, 1 - trainer.top_entropy_quantile)
        keep = entropy_mask.to(logprob.dtype)
    if trainer.off_policy_mask_threshold is not None:
        behaviour = logprob.detach() if old is None else old
        off_policy = trainer.get_off_policy_mask(
            advantages=advantages if advantages.dim() == 2 else advantages[:, None],
            per_token_logps=logprob,
            sampling_per_token_logps=inputs.get("sampling_per_token_logps", behaviour),
            mask=mask,
            off_policy_threshold=trainer.off_policy_mask_threshold,
        ).to(logprob.dtype)
        keep = off_policy.expand_as(logprob) if keep is None else keep * off_policy
    is_ratio = rollout_weights(trainer, inputs, mask)
    is_ratio = None if is_ratio is None else is_ratio.to(logprob.dtype)
    if loss_type == "vespo":
        weights = is_ratio
        if keep is not None:
            advantages = (advantages if advantages.dim() == 2 else advantages[:, None]) * keep
    else:
        weights = keep if is_ratio is None else (is_ratio if keep is None else keep * is_ratio)

    kwargs = policy_loss_kwargs(trainer, mask, inputs.get("num_items_in_batch"))
    ref = inputs["ref_per_token_logps"].to(logprob.dtype) if trainer.beta != 0.0 else None
    loss, metrics = rlk.policy_loss(
        logprob, old, advantages, mask, importance_weights=weights, ref_logprob=ref, entropy=entropy, **kwargs
    )
    log = trainer._metrics[mode]
    if trainer._entropy_bonus_enabled:
        policy_loss = loss.detach() if loss_type in ("dapo", "cispo", "vespo") else loss.detach() * accum
        effective = mask.bool() if entropy_mask is None else mask.bool() & entropy_mask.bool()
        coef = _entropy_coefficient(trainer)
        if coef != 0.0:
            bonus, _ = rlk.policy_loss(
                logprob,
                None,
                torch.zeros_like(logprob[:, 0]),
                effective,
                loss="gpg",
                agg="token-mean",
                global_tokens=effective.sum().clamp(min=1) * accum,
                entropy=entropy,
                entropy_coef=coef,
            )
            loss = loss + bonus
        log["policy_loss"].append(trainer.accelerator.gather(policy_loss).nanmean().item())
        if trainer.use_adaptive_entropy and mode == "train":
            _adaptive_entropy_update(trainer, entropy, effective)
        if mode == "train" and trainer.accelerator.sync_gradients:
            log["entropy_coef"].append(trainer.entropy_coef)

    tokens = mask.sum()
    if trainer.beta != 0.0:
        log["kl"].append(_global_mean(trainer, metrics["kl_mean"], tokens))
    log["entropy"].append(_global_mean(trainer, metrics["entropy_mean"], tokens))
    if loss_type in PPO_FAMILY and trainer.importance_sampling_level == "token":
        log["clip_ratio/region_mean"].append(_global_mean(trainer, metrics["clip_fraction"], tokens))
    for name in ("clip_fraction", "approx_kl", "ratio_mean"):
        log[f"rlk/{name}"].append(_global_mean(trainer, metrics[name], tokens))
    log["rlk/ratio_max"].append(trainer.accelerator.gather(metrics["ratio_max"].reshape(1)).max().item())
    return loss


# ---------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------


class RLKGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with rlk's log-probs, entropies and loss; same constructor, same config, same logs.

    * log-probs and entropies (the policy's, the old and the reference model's): ``rlk.integrations.hf.apply`` on
      the model (and the reference model), then ``model(..., logits_to_keep=K + 1, logprob_targets=completion tokens)``:
      the decoder's last hidden states and the LM head's weight (read at each call) go through
      :func:`rlk.linear_logprob`, never materializing the logits, at TRL's ``temperature``;
    * the loss and its metrics: :func:`compute_loss`.

    Configurations rlk cannot compute exactly raise ``ValueError`` here (:func:`check_supported`), as do
    ``cast_lm_head_to_fp32=True`` (rlk accumulates the head in fp32 from the model's dtype) and multimodal inputs.
    Needs no hub download (``use_liger_kernel`` / hub kernels are not involved).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_supported(self)
        if self.args.cast_lm_head_to_fp32:
            raise ValueError(
                "cast_lm_head_to_fp32=True: not with RLKGRPOTrainer (rlk.linear_logprob takes the head "
                "in the model's dtype and accumulates in fp32); set it to False"
            )
        policy = self.model.get_base_model() if callable(getattr(self.model, "get_base_model", None)) else self.model
        for model in (policy, self.ref_model):
            if model is not None:
                rlk.integrations.hf.apply(model, temperature=self.temperature, return_entropy=True)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's method on rlk: ``[B, K]`` log-probs of the last ``K = logits_to_keep`` tokens (0 at padding), their
        entropies when asked (else None), and None for the auxiliary loss; in chunks of ``batch_size`` rows."""
        given = sorted(name for name, value in multimodal.items() if value is not None)
        if given:
            raise ValueError(
                f"{', '.join(given)}: multimodal inputs are not on rlk's log-prob path; use trl.GRPOTrainer"
            )
        if compute_aux_loss:
            raise ValueError("compute_aux_loss: the MoE router auxiliary loss is not on rlk's log-prob path")
        k = logits_to_keep
        batch_size = batch_size or input_ids.size(0)
        logprobs, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, att = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            # position L - K - 1 + j predicts token L - K + j; the last position predicts nothing
            targets = torch.nn.functional.pad(ids[:, -k:].masked_fill(att[:, -k:] == 0, -100), (0, 1), value=-100)
            with self.accelerator.autocast():
                out = model(
                    input_ids=ids,
                    attention_mask=att,
                    logits_to_keep=k + 1,
                    use_cache=False,
                    logprob_targets=targets,
                    return_entropy=compute_entropy,
                )
            logprobs.append(out.logprobs[:, :-1])
            if compute_entropy:
                entropies.append(out.entropy[:, :-1])
        return torch.cat(logprobs), torch.cat(entropies) if compute_entropy else None, None

    def _compute_loss(self, model, inputs):
        return compute_loss(self, model, inputs)


# ---------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------

#: TRL's DPO loss types and the :func:`rlk.dpo_loss` ``loss`` that computes each (``sigmoid_norm``: ``sigmoid`` of
#: the length-normalized sequence log-probs).
DPO_LOSS_TYPES = {"sigmoid": "sigmoid", "hinge": "hinge", "ipo": "ipo", "robust": "robust", "sigmoid_norm": "sigmoid"}
#: Batch keys of TRL's preference collator that are not model inputs.
_DPO_NON_MODEL = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")


def check_dpo_supported(args) -> None:
    """Raise ``ValueError`` (naming the option) for a ``DPOConfig`` whose loss rlk cannot compute exactly."""
    others = [t for t in args.loss_type if t not in DPO_LOSS_TYPES]
    if others:
        raise ValueError(
            f"loss_type: {', '.join(map(repr, others))} not served by rlk.dpo_loss (RLKDPOTrainer serves "
            f"{', '.join(map(repr, DPO_LOSS_TYPES))}); use trl.DPOTrainer"
        )
    if not args.beta > 0.0:
        raise ValueError(f"beta: rlk.dpo_loss needs beta > 0, got {args.beta}")
    alpha_one = args.f_divergence_type == "alpha_divergence" and abs(args.f_alpha_divergence_coef - 1.0) < 1e-6
    if args.f_divergence_type != "reverse_kl" and not alpha_one:  # TRL computes alpha = 1 as reverse_kl
        raise ValueError(
            f"f_divergence_type={args.f_divergence_type!r}: rlk.dpo_loss takes the log-ratios "
            "themselves (reverse_kl); use trl.DPOTrainer"
        )
    if args.use_weighting:
        raise ValueError(
            "use_weighting=True: WPO's weights need log(sum_v p_v^2) per token, which rlk's log-prob op "
            "does not compute; use trl.DPOTrainer"
        )
    if "robust" in args.loss_type and not 0.0 <= args.label_smoothing < 0.5:
        raise ValueError(
            f"label_smoothing={args.label_smoothing} with loss_type 'robust': rlk's robust loss needs "
            "[0, 0.5) (TRL only warns)"
        )


def dpo_loss(
    trainer, chosen: Tensor, rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, completion_mask: Tensor
) -> Tensor:
    """TRL's DPO loss ``sum_k loss_weights[k] * mean over pairs(loss_type[k])`` by :func:`rlk.dpo_loss`, from the
    ``[P]`` sequence log-probs; ``completion_mask`` ``[2P, L]`` (chosen rows first) gives the lengths of ipo and
    sigmoid_norm (at least 1). Only robust reads ``label_smoothing`` (TRL 1.16's sigmoid has no smoothing)."""
    n_chosen, n_rejected = completion_mask.sum(1).clamp(min=1).to(chosen.dtype).chunk(2)
    # precomputed reference log-probs come in float32 (TRL promotes them): rlk takes one dtype for the four
    ref_chosen, ref_rejected = ref_chosen.to(chosen.dtype), ref_rejected.to(chosen.dtype)
    loss = 0.0
    for loss_type, weight in zip(trainer.loss_types, trainer.loss_weights, strict=True):
        logps, kw = (chosen, rejected, ref_chosen, ref_rejected), {}
        if loss_type == "sigmoid_norm":
            logps = (chosen / n_chosen, rejected / n_rejected, ref_chosen / n_chosen, ref_rejected / n_rejected)
        elif loss_type == "ipo":
            kw = {"chosen_length": n_chosen, "rejected_length": n_rejected}
        elif loss_type == "robust":
            kw = {"label_smoothing": trainer.label_smoothing}
        value, _ = rlk.dpo_loss(*logps, beta=trainer.beta, loss=DPO_LOSS_TYPES[loss_type], **kw)
        loss = loss + value * weight
    return loss


class RLKDPOTrainer(DPOTrainer):
    """``trl.DPOTrainer`` with rlk's sequence log-probs and :func:`rlk.dpo_loss`; same constructor and config.

    * sequence log-probs (policy, reference model or PEFT adapter, ``precompute_ref_log_probs``):
      ``rlk.integrations.hf.apply``
      on the model, then ``model(..., logits_to_keep=k, logprob_targets=next completion tokens)`` from the first
      position that predicts a completion token: :func:`rlk.linear_logprob` on the last hidden states and the LM
      head, no logits; summed over the completion (``ld_alpha``: the tokens past the shorter completion of the pair
      weighted by ``ld_alpha``);
    * the loss: :func:`dpo_loss`, for the ``loss_type`` list (with ``loss_weights``) of :data:`DPO_LOSS_TYPES`.

    Logs TRL's ``rewards/*``, ``logps/*``, ``entropy`` and ``num_tokens``; not ``logits/*`` nor
    ``mean_token_accuracy`` (rlk's op computes neither the mean logit nor the argmax). Configurations rlk cannot
    compute exactly raise ``ValueError`` (:func:`check_dpo_supported`), as do the MoE router auxiliary loss and
    vision datasets.
    """

    def __init__(self, *args, **kwargs):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None:  # before TRL's __init__, which precomputes the reference log-probs
            check_dpo_supported(config)
        super().__init__(*args, **kwargs)
        check_dpo_supported(self.args)
        if self.aux_loss_enabled:
            raise ValueError(
                "router_aux_loss_coef: the MoE router auxiliary loss is not on rlk's log-prob path; set "
                "router_aux_loss_coef=0.0 or use trl.DPOTrainer"
            )
        if self._is_vision_dataset:
            raise ValueError("train_dataset: images are not on rlk's log-prob path (text-only); use trl.DPOTrainer")
        for model in (self.model, self.ref_model):
            if model is not None:
                self._rlk_model(model)

    def _rlk_model(self, model):
        """``model`` with ``rlk.integrations.hf.apply`` on the causal LM inside its wrappers (idempotent)."""
        inner = self.accelerator.unwrap_model(model)
        rlk.integrations.hf.apply(inner.get_base_model() if is_peft_model(inner) else inner)
        return model

    def _sequence_logps(self, model, inputs: dict, entropy: bool = False):
        """``(chosen [P], rejected [P], entropy [2P, k] or None, completion-token mask [2P, k])`` of one batch."""
        ids, mask = inputs["input_ids"], inputs["completion_mask"]
        # position t predicts token t + 1; the last position predicts nothing
        predicts = torch.nn.functional.pad(mask[:, 1:], (0, 1))
        used = predicts.any(0).nonzero()
        k = ids.size(1) - int(used[0, 0]) if used.numel() else 1
        targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))[:, -k:].masked_fill(predicts[:, -k:] == 0, -100)
        kwargs = {name: value for name, value in inputs.items() if name not in _DPO_NON_MODEL}
        out = self._rlk_model(model)(
            **kwargs, use_cache=False, logits_to_keep=k, logprob_targets=targets, return_entropy=entropy
        )
        token_logps, predicts = out.logprobs, predicts[:, -k:]
        if self.ld_alpha is not None:
            position = predicts.cumsum(1)
            shared = predicts.sum(1).chunk(2)
            shared = torch.minimum(*shared).repeat(2)[:, None]
            token_logps = torch.where(position > shared, self.ld_alpha * token_logps, token_logps)
        chosen, rejected = token_logps.sum(1).chunk(2)
        return chosen, rejected, out.entropy, predicts

    def _reference_logps(self, model, inputs: dict):
        """The reference model's (or, with PEFT and no reference model, the reference adapter's) sequence log-probs."""
        adapter = contextlib.nullcontext()
        if self.ref_model is None and is_peft_model(self.model):
            inner = self.accelerator.unwrap_model(self.model)
            adapter = use_adapter(inner, adapter_name="ref" if "ref" in inner.peft_config else None)
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
            adapter,
        ):
            chosen, rejected, _, _ = self._sequence_logps(model, inputs)
        return chosen, rejected

    def compute_ref_log_probs(self, model, inputs):
        with self.accelerator.autocast():
            return self._reference_logps(model, inputs)

    def _compute_loss(self, model, inputs, return_outputs):
        mode = "train" if self.model.training else "eval"
        chosen, rejected, entropy, mask = self._sequence_logps(model, inputs, entropy=True)
        if self.precompute_ref_logps:
            ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:
            reference = self.model if self.ref_model is None else self.ref_model  # None: PEFT (adapter off)
            ref_chosen, ref_rejected = self._reference_logps(reference, inputs)
        loss = dpo_loss(self, chosen, rejected, ref_chosen, ref_rejected, inputs["completion_mask"])

        gather, log = self.accelerator.gather_for_metrics, self._metrics[mode]
        totals = gather(torch.stack([(entropy.detach() * mask).sum(), mask.sum().to(entropy.dtype)])[None]).sum(0)
        log["entropy"].append(float(totals[0] / totals[1]) if totals[1] > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += int(gather(inputs["attention_mask"].sum()).sum()) // self._tp_size
        log["num_tokens"] = [self._total_train_tokens]
        rewards_chosen = self.beta * (chosen.detach() - ref_chosen)
        rewards_rejected = self.beta * (rejected.detach() - ref_rejected)
        for name, value in (
            ("rewards/chosen", rewards_chosen),
            ("rewards/rejected", rewards_rejected),
            ("rewards/accuracies", (rewards_chosen > rewards_rejected).float()),
            ("rewards/margins", rewards_chosen - rewards_rejected),
            ("logps/chosen", chosen.detach()),
            ("logps/rejected", rejected.detach()),
        ):
            log[name].append(self.accelerator.gather(value).mean().item())
        if not return_outputs:
            return loss
        with torch.no_grad():  # TRL's deprecated logits for compute_metrics: the stock forward
            outputs = model(**{name: value for name, value in inputs.items() if name not in _DPO_NON_MODEL})
        return loss, outputs
