"""fused_linear_policy_loss equals linear_logprob followed by policy_loss, and masks ignored targets."""

from __future__ import annotations

import pytest
import torch

import rlk
from rlk import contract


def _inputs(seed=0, b=3, t=7, h=16, v=300):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g)
    weight = torch.randn(v, h, generator=g) / 4
    targets = torch.randint(0, v, (b, t), generator=g)
    targets[0, :2] = -100
    old = -torch.rand(b, t, generator=g) * 5
    advantages = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    return hidden, weight, targets, old, advantages, mask


@pytest.mark.parametrize("kwargs", [
    dict(loss="ppo", dual_clip=3.0, agg="token-mean"),
    dict(loss="gspo", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean"),
    dict(loss="ppo", agg="token-sum", entropy_coef=0.01),
])
def test_equals_the_composition(kwargs):
    hidden, weight, targets, old, advantages, mask = _inputs()
    results = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if fused:
            loss, metrics = rlk.fused_linear_policy_loss(h, w, targets, old, advantages, mask, temperature=0.8,
                                                         **kwargs)
        else:
            lp, ent = rlk.linear_logprob(h, w, targets, temperature=0.8, return_entropy=True)
            valid = mask & (targets != -100)
            entropy = ent if kwargs.get("entropy_coef") else None
            loss, metrics = rlk.policy_loss(lp, old, advantages, valid, entropy=entropy, **kwargs)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad, metrics))
    (loss_f, gh_f, gw_f, m_f), (loss_c, gh_c, gw_c, m_c) = results
    assert torch.equal(loss_f, loss_c) and torch.equal(gh_f, gh_c) and torch.equal(gw_f, gw_c)
    assert set(m_f) == set(m_c) and all(torch.equal(m_f[k], m_c[k]) for k in m_f)


def test_ignored_targets_never_enter_the_loss_and_one_sequence_works():
    hidden, weight, targets, old, advantages, mask = _inputs(b=1)
    mask[:] = True
    loss, _, entropy = rlk.fused_linear_policy_loss(hidden[0], weight, targets[0], old[0], advantages[0], mask[0],
                                                    agg="token-sum", return_entropy=True)
    keep = targets[0] != -100
    lp = rlk.linear_logprob(hidden[0], weight, targets[0])
    expected, _ = rlk.policy_loss(lp[None], old, advantages, keep[None], agg="token-sum")
    assert torch.equal(loss, expected)
    assert entropy.shape == targets[0].shape and not entropy.requires_grad


def test_gradients_match_materialized_logits_under_the_contract():
    hidden, weight, targets, old, advantages, mask = _inputs(seed=1)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, _ = rlk.fused_linear_policy_loss(h, w, targets, old, advantages, mask, agg="token-sum")
    loss.backward()
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    logp = torch.log_softmax(h64 @ w64.T, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    valid = mask & (targets != -100)
    ratio = torch.exp(logp - old.double())
    adv = advantages.double()
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    ref = torch.where(valid, per_token, 0.0).sum()
    ref.backward()
    e = contract.entry("linear_logprob", torch.float32)
    assert contract.compare_grad(e, "grad_hidden", h.grad, h64.grad, 20.0).ok
    assert contract.compare_grad(e, "grad_weight", w.grad, w64.grad, 20.0).ok


def test_bad_arguments():
    hidden, weight, targets, old, advantages, mask = _inputs()
    with pytest.raises(TypeError, match="entropy: computed here"):
        rlk.fused_linear_policy_loss(hidden, weight, targets, old, advantages, mask, entropy=old)
    with pytest.raises(ValueError, match="mask: expected the shape of targets"):
        rlk.fused_linear_policy_loss(hidden, weight, targets, old, advantages, mask[:, :3])
