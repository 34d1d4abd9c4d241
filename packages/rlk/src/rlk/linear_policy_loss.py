"""``fused_linear_policy_loss``: hidden states -> log-prob -> policy loss, never materializing logits.

A composition of two rlk ops, each one fused: :func:`rlk.linear_logprob` (log-prob and entropy
straight from the last hidden states and the LM head, extra memory O(N + tile)) and
:func:`rlk.policy_loss` (one pass over the tokens for the loss, its gradient and the
metrics). Its memory is ``linear_logprob``'s plus a few ``[B, T]`` fp32 tensors; the only
``[N, V]``-sized object of the plain PyTorch path, the logits, never exists.
"""

from __future__ import annotations

from torch import Tensor

from rlk.logprob import linear_logprob
from rlk.policy_loss import policy_loss


def fused_linear_policy_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    old_logprob: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    temperature: float | Tensor = 1.0,
    ignore_index: int = -100,
    ref_logprob: Tensor | None = None,
    return_entropy: bool = False,
    **policy_loss_kwargs,
) -> tuple[Tensor, dict[str, Tensor]] | tuple[Tensor, dict[str, Tensor], Tensor]:
    """Policy loss of ``hidden @ weight.T`` without materializing the logits.

    ``loss, metrics = policy_loss(linear_logprob(hidden, weight, targets, ...), old_logprob,
    advantages, mask & (targets != ignore_index), ref_logprob=ref_logprob, entropy=..., **kwargs)``.

    Args:
        hidden: ``[B, T, H]`` (or ``[T, H]``, one sequence) bf16 / fp16 / fp32 hidden states.
        weight: ``[V, H]`` LM head of the same dtype.
        targets: ``[B, T]`` (``[T]``) int32 / int64 next tokens; ``ignore_index`` positions are
            left out of the loss whatever ``mask`` says.
        old_logprob, advantages, mask: as in :func:`rlk.policy_loss` (``[B, T]``, or ``[T]``).
        temperature, ignore_index: as in :func:`rlk.linear_logprob`.
        ref_logprob: reference-model log-probs for the KL term (``kl``, ``kl_coef`` in kwargs).
        return_entropy: also return the per-token entropy (detached). The entropy is computed
            whenever this is set or ``entropy_coef`` is non-zero (then it is differentiable
            through the loss).
        **policy_loss_kwargs: every keyword of :func:`rlk.policy_loss` (``loss``, ``clip_low``,
            ``agg``, ``global_tokens``, ``entropy_coef``...), except ``entropy``.

    Returns:
        ``(loss, metrics)``, or ``(loss, metrics, entropy)`` with ``return_entropy``. Gradients
        flow to ``hidden`` and ``weight``.
    """
    if "entropy" in policy_loss_kwargs:
        raise TypeError("entropy: computed here from hidden and weight; pass entropy_coef instead")
    with_entropy = return_entropy or policy_loss_kwargs.get("entropy_coef", 0.0) != 0.0
    out = linear_logprob(hidden, weight, targets, temperature=temperature, ignore_index=ignore_index,
                         return_entropy=with_entropy)
    logprob, entropy = out if with_entropy else (out, None)
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != targets.shape:
        raise ValueError(f"mask: expected the shape of targets {tuple(targets.shape)}, got {tuple(mask.shape)}")
    valid = (mask != 0) & (targets != ignore_index)
    one_sequence = targets.dim() == 1

    def rows(x: Tensor | None) -> Tensor | None:
        return x.unsqueeze(0) if one_sequence and x is not None and x.dim() == 1 else x

    loss, metrics = policy_loss(
        rows(logprob), rows(old_logprob), rows(advantages), rows(valid), ref_logprob=rows(ref_logprob),
        entropy=rows(entropy), **policy_loss_kwargs,
    )
    if return_entropy:
        return loss, metrics, entropy.detach()
    return loss, metrics
