"""Reference value-loss and DPO primitives: the readable specification and ground truth.

Value loss (PPO critic)
-----------------------
For values ``v``, old (rollout) values ``v_old``, returns ``R`` and mask ``m``, all ``[B, T]``,
a clip range ``eps`` (or none) and per-row aggregation weights ``c[B]``
(:mod:`rlk.reference.aggregation`)::

    L1 = (v - R)^2
    L2 = (clamp(v, v_old - eps, v_old + eps) - R)^2
    L  = max(L1, L2)                      (L = L1 without a clip range)
    loss = 0.5 * sum_i c_i * sum_t m L

Gradient with respect to ``v`` (``g`` the gradient of ``loss``)::

    d loss / d v = g * c_i * (v - R)      where m and not (L2 > L1)
                 = 0                      elsewhere

(where ``L2 > L1`` the value lies outside the clip range and the clipped branch is
constant in ``v``; inside the range ``L1 == L2`` exactly and both branches agree.)

Metrics over the masked tokens of the call (``n = sum m``, 0 when ``n = 0``):
``vf_clip_fraction = #{m and L2 > L1} / n`` and ``values_mean = sum m v / n``.

DPO family
----------
Per pair, sequence log-probs ``lc``, ``lr`` of the chosen and rejected completions under the
policy and ``lc_ref``, ``lr_ref`` under the reference model; for ``ipo`` all four are first
divided by the completion lengths ``n_c`` / ``n_r`` (at least 1). With ``x = (lc - lr) -
(lc_ref - lr_ref)``, ``u = beta x`` and ``eps`` the label smoothing::

    sigmoid: l = -(1 - eps) logsigmoid(u) - eps logsigmoid(-u)        (eps = 0: plain DPO)
    hinge:   l = relu(1 - u)
    ipo:     l = (x - 1 / (2 beta))^2
    robust:  l = (-(1 - eps) logsigmoid(u) + eps logsigmoid(-u)) / (1 - 2 eps)

and ``d l / d lc = dl/dx * d x / d lc`` with ``dl/dx = beta dl/du``::

    sigmoid: dl/du = -(1 - eps) sigmoid(-u) + eps sigmoid(u)
    hinge:   dl/du = -[u < 1]
    robust:  dl/du = (-(1 - eps) sigmoid(-u) - eps sigmoid(u)) / (1 - 2 eps)
    ipo:     dl/dx = 2 (x - 1 / (2 beta))

``d x / d lc = 1`` (``1 / n_c`` for ipo), ``d x / d lr = -1`` (``-1 / n_r``). Metrics, means
over the pairs: ``rewards_chosen = beta (lc - lc_ref)``, ``rewards_rejected = beta (lr -
lr_ref)``, ``reward_margin = rewards_chosen - rewards_rejected``, ``reward_accuracy =
[rewards_chosen > rewards_rejected]``.

Math runs in the inputs' dtype: fp32, or fp64 for ground truth. The reference is
deterministic; it does not promise batch invariance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------
# value loss
# ---------------------------------------------------------------------------


def _value_terms(values, old_values, returns, mask, clip):
    """Per-token ``L``, ``clipped = L2 > L1`` and ``v - R`` (masked-out tokens read 0)."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(mask, values, zero)
    ret = torch.where(mask, returns, zero)
    diff = v - ret
    l1 = diff * diff
    if clip is None:
        return l1, torch.zeros_like(mask), diff
    v_old = torch.where(mask, old_values, zero)
    v_clipped = torch.minimum(torch.maximum(v, v_old - clip), v_old + clip)
    diff2 = v_clipped - ret
    l2 = diff2 * diff2
    clipped = l2 > l1
    return torch.where(clipped, l2, l1), clipped & mask, diff


def value_loss_fwd(values, old_values, returns, mask, row_weight, clip, loss_out, metrics_out):
    loss, clipped, _ = _value_terms(values, old_values, returns, mask, clip)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    per_row = torch.where(mask, loss, zero).sum(dim=1)
    loss_out.copy_(0.5 * (row_weight * per_row).sum())
    n = mask.sum().clamp(min=1).to(values.dtype)
    metrics_out[0] = clipped.sum().to(values.dtype) / n
    metrics_out[1] = torch.where(mask, values, zero).sum() / n


def value_loss_bwd(values, old_values, returns, mask, row_weight, clip, grad_loss, grad_values_out):
    _, clipped, diff = _value_terms(values, old_values, returns, mask, clip)
    scale = (grad_loss * row_weight)[:, None]
    grad_values_out.copy_(torch.where(mask & ~clipped, scale * diff, 0.0))


# ---------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------


def _dpo_inputs(chosen, rejected, ref_chosen, ref_rejected, len_chosen, len_rejected, loss_type):
    if loss_type == "ipo":
        n_c, n_r = len_chosen.clamp(min=1), len_rejected.clamp(min=1)
        return chosen / n_c, rejected / n_r, ref_chosen / n_c, ref_rejected / n_r
    return chosen, rejected, ref_chosen, ref_rejected


def _dpo_terms(chosen, rejected, ref_chosen, ref_rejected, len_chosen, len_rejected, beta, loss_type, eps):
    """Per-pair loss, dl/dx, d x / d lc, d x / d lr and the rewards."""
    lc, lr, lc_ref, lr_ref = _dpo_inputs(
        chosen, rejected, ref_chosen, ref_rejected, len_chosen, len_rejected, loss_type
    )
    x = (lc - lr) - (lc_ref - lr_ref)
    u = beta * x
    if loss_type == "sigmoid":
        loss = -(1 - eps) * F.logsigmoid(u) - eps * F.logsigmoid(-u)
        dl_dx = beta * (-(1 - eps) * torch.sigmoid(-u) + eps * torch.sigmoid(u))
    elif loss_type == "hinge":
        loss = torch.relu(1 - u)
        dl_dx = -beta * (u < 1).to(x.dtype)
    elif loss_type == "ipo":
        loss = (x - 1 / (2 * beta)) ** 2
        dl_dx = 2 * (x - 1 / (2 * beta))
    elif loss_type == "robust":
        loss = (-(1 - eps) * F.logsigmoid(u) + eps * F.logsigmoid(-u)) / (1 - 2 * eps)
        dl_dx = beta * (-(1 - eps) * torch.sigmoid(-u) - eps * torch.sigmoid(u)) / (1 - 2 * eps)
    else:
        raise ValueError(f"unknown DPO loss {loss_type!r}")
    if loss_type == "ipo":
        dx_dc, dx_dr = 1 / len_chosen.clamp(min=1), -1 / len_rejected.clamp(min=1)
    else:
        dx_dc, dx_dr = 1.0, -1.0
    return loss, dl_dx, dx_dc, dx_dr, beta * (lc - lc_ref), beta * (lr - lr_ref)


def dpo_loss_fwd(
    chosen,
    rejected,
    ref_chosen,
    ref_rejected,
    len_chosen,
    len_rejected,
    beta,
    loss_type,
    label_smoothing,
    mean,
    losses_out,
    loss_out,
    metrics_out,
):
    loss, _, _, _, r_c, r_r = _dpo_terms(
        chosen, rejected, ref_chosen, ref_rejected, len_chosen, len_rejected, beta, loss_type, label_smoothing
    )
    losses_out.copy_(loss)
    loss_out.copy_(loss.mean() if mean else loss.sum())
    metrics_out[0] = r_c.mean()
    metrics_out[1] = r_r.mean()
    metrics_out[2] = (r_c - r_r).mean()
    metrics_out[3] = (r_c > r_r).to(chosen.dtype).mean()


def dpo_loss_bwd(
    chosen,
    rejected,
    ref_chosen,
    ref_rejected,
    len_chosen,
    len_rejected,
    beta,
    loss_type,
    label_smoothing,
    mean,
    grad_losses,
    grad_loss,
    grad_chosen_out,
    grad_rejected_out,
):
    _, dl_dx, dx_dc, dx_dr, _, _ = _dpo_terms(
        chosen, rejected, ref_chosen, ref_rejected, len_chosen, len_rejected, beta, loss_type, label_smoothing
    )
    g = torch.zeros_like(chosen)
    if grad_losses is not None:
        g = g + grad_losses
    if grad_loss is not None:
        g = g + (grad_loss / chosen.shape[0] if mean else grad_loss)
    grad_x = g * dl_dx
    grad_chosen_out.copy_(grad_x * dx_dc)
    grad_rejected_out.copy_(grad_x * dx_dr)
