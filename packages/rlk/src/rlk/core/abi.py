"""The rlk op ABI: the primitives every backend implements, declared once.

A *primitive* is a pure function on tensors with caller-allocated outputs
(destination passing), no autograd and no Python-side allocation of results.
Autograd, validation, shape handling and torch.library registration live in
``rlk`` once for all backends; a backend only fills output tensors.

Conventions shared by every primitive (the op layer guarantees them, so
backends need not re-check):

* all tensors are on one device and contiguous;
* ``N`` rows (``N >= 1``; empty batches never reach a backend), ``V`` vocab
  entries (``V >= 1``), ``H`` hidden size;
* ``targets`` is int64 ``[N]``; a row whose target equals ``ignore_index`` is
  *ignored*: its log-prob and entropy outputs are 0 and its gradients are 0;
  every other target lies in ``[0, V)``;
* ``inv_temperature`` is fp32 ``[N]``, the per-row ``1 / T`` (``T > 0``);
  logits are scaled as ``z = x * inv_temperature`` (one fp32 multiply, the
  same in every backend);
* log-prob, entropy and ``lse`` are fp32 ``[N]`` (fp64, like ``inv_temperature``,
  when the inputs are fp64: a reference-only mode for ground truth); ``lse = logsumexp_v z_v``
  is the per-row state the forward saves for the backward (its value on
  ignored rows is unspecified);
* gradients are written in the dtype of the tensor they belong to;
  accumulation is fp32 (fp64 when the inputs are fp64, reference only).

The math is in ``rlk.reference.logprob``, which is the readable spec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlk.core.checks import compute_dtype

#: Bumped on any incompatible change of a primitive's signature or meaning.
ABI_VERSION = 3


@dataclass(frozen=True)
class Primitive:
    """One ABI entry: a name, the public op it belongs to, and its signature."""

    name: str
    op: str
    signature: str


@dataclass(frozen=True)
class Op:
    """A public op: its forward and backward primitives and supported dtypes.

    ``backward`` is None for ops that are not differentiable (advantages, returns).
    """

    name: str
    forward: str
    backward: str | None
    dtypes: tuple[str, ...]

    @property
    def primitives(self) -> tuple[str, ...]:
        return (self.forward,) if self.backward is None else (self.forward, self.backward)


PRIMITIVES: dict[str, Primitive] = {
    p.name: p
    for p in (
        Primitive(
            "selected_logprob_fwd",
            "selected_logprob",
            "(logits[N,V] float, targets[N] int64, inv_temperature[N] fp32, ignore_index: int, "
            "logprob_out[N] fp32, entropy_out[N] fp32 | None, lse_out[N] fp32) -> None",
        ),
        Primitive(
            "selected_logprob_bwd",
            "selected_logprob",
            "(logits[N,V], targets[N], inv_temperature[N], lse[N], entropy[N] | None, "
            "grad_logprob[N] fp32, grad_entropy[N] fp32 | None, ignore_index: int, "
            "grad_logits_out[N,V] logits.dtype) -> None",
        ),
        Primitive(
            "linear_logprob_fwd",
            "linear_logprob",
            "(hidden[N,H] float, weight[V,H] hidden.dtype, targets[N] int64, "
            "inv_temperature[N] fp32, ignore_index: int, logprob_out[N] fp32, "
            "entropy_out[N] fp32 | None, lse_out[N] fp32) -> None",
        ),
        Primitive(
            "linear_logprob_bwd",
            "linear_logprob",
            "(hidden[N,H], weight[V,H], targets[N], inv_temperature[N], lse[N], "
            "entropy[N] | None, grad_logprob[N] fp32, grad_entropy[N] fp32 | None, "
            "ignore_index: int, grad_hidden_out[N,H] hidden.dtype | None, "
            "grad_weight_out[V,H] weight.dtype | None) -> None",
        ),
        # Distillation divergence (spec: rlk.reference.distill): student and teacher logits from their hidden states
        # and LM heads, never materialized. q = softmax(z_student), p = softmax(z_teacher), z = x * inv_temperature;
        # 'forward_kl' KL(p || q), 'reverse_kl' KL(q || p), 'jsd' beta KL(p || m) + (1 - beta) KL(q || m) with
        # m = beta p + (1 - beta) q (0 < beta < 1: the op layer maps beta 0 / 1 to forward / reverse KL). targets
        # only mark ignored rows (None: none is). stats = (lse_student, lse_teacher, the gradient's row constant:
        # KL(q || p) for reverse_kl, KL(q || m) for jsd, 0 for forward_kl; 0 on ignored rows). The teacher gets no
        # gradient. With grad_coef the forward also writes the gradients of sum_i grad_coef_i loss_i (one call for
        # a scalar loss); the backward writes those of sum_i grad_loss_i loss_i from the forward's stats.
        Primitive(
            "fused_linear_kl_fwd",
            "fused_linear_kl",
            "(student_hidden[N,Hs] float, student_weight[V,Hs] student_hidden.dtype, teacher_hidden[N,Ht] "
            "student_hidden.dtype, teacher_weight[V,Ht] student_hidden.dtype, targets[N] int64 | None, "
            "inv_temperature[N] fp32, ignore_index: int, divergence: str, beta: float, loss_out[N] fp32, "
            "stats_out[3,N] fp32, grad_coef[N] fp32 | None, grad_hidden_out[N,Hs] student_hidden.dtype | None, "
            "grad_weight_out[V,Hs] student_weight.dtype | None) -> None",
        ),
        Primitive(
            "fused_linear_kl_bwd",
            "fused_linear_kl",
            "(student_hidden[N,Hs], student_weight[V,Hs], teacher_hidden[N,Ht], teacher_weight[V,Ht], "
            "targets[N] | None, inv_temperature[N], stats[3,N] fp32 (the forward's), grad_loss[N] fp32, "
            "ignore_index: int, divergence: str, beta: float, grad_hidden_out[N,Hs] | None, "
            "grad_weight_out[V,Hs] | None) -> None",
        ),
        # linear_logprob with stored logits (spec: rlk.reference.logprob): the forward also writes the scaled
        # logits it reduces (its log-prob, entropy and lse are linear_logprob_fwd's bits on the same backend); the
        # backward reads them instead of recomputing them. A chunk of rows at a time: fused_linear_policy_loss's
        # one-pass mode.
        Primitive(
            "linear_logprob_stored_fwd",
            "linear_logprob_stored",
            "(hidden[N,H] float, weight[V,H] hidden.dtype, targets[N] int64, inv_temperature[N] fp32, "
            "ignore_index: int, logprob_out[N] fp32, entropy_out[N] fp32 | None, lse_out[N] fp32, "
            "logits_out[N,V] fp32 (unit column stride; z = x * inv_temperature)) -> None",
        ),
        Primitive(
            "linear_logprob_stored_bwd",
            "linear_logprob_stored",
            "(hidden[N,H], weight[V,H], targets[N], inv_temperature[N], lse[N], entropy[N] | None, "
            "grad_logprob[N] fp32, grad_entropy[N] fp32 | None, ignore_index: int, "
            "logits[N,V] fp32 (the forward's logits_out; spent: the backend may overwrite it), "
            "grad_hidden_out[N,H] hidden.dtype | None, grad_weight_out[V,H] fp32 | weight.dtype | None, "
            "accumulate: bool (grad_weight_out += G.T @ hidden; fp32 only)) -> None",
        ),
        # Value loss (spec: rlk.reference.losses): [B, T] fp32 tensors (fp64: reference only), bool mask,
        # per-row aggregation weights from rlk.reference.aggregation; old_values is not read when clip is None.
        Primitive(
            "value_loss_fwd",
            "value_loss",
            "(values[B,T] fp32, old_values[B,T] fp32, returns[B,T] fp32, mask[B,T] bool, row_weight[B] fp32, "
            "clip: float | None, loss_out[] fp32, metrics_out[2] fp32 (vf_clip_fraction, values_mean)) -> None",
        ),
        Primitive(
            "value_loss_bwd",
            "value_loss",
            "(values[B,T], old_values[B,T], returns[B,T], mask[B,T], row_weight[B], clip: float | None, "
            "grad_loss[] fp32, grad_values_out[B,T] fp32) -> None",
        ),
        # DPO family (spec: rlk.reference.losses): [P] fp32 sequence log-probs; lengths only for 'ipo'.
        Primitive(
            "dpo_loss_fwd",
            "dpo_loss",
            "(chosen[P] fp32, rejected[P] fp32, ref_chosen[P] fp32, ref_rejected[P] fp32, "
            "len_chosen[P] fp32 | None, len_rejected[P] fp32 | None, beta: float, loss_type: str, "
            "label_smoothing: float, mean: bool, losses_out[P] fp32, loss_out[] fp32, "
            "metrics_out[4] fp32 (rewards_chosen, rewards_rejected, reward_margin, reward_accuracy)) -> None",
        ),
        Primitive(
            "dpo_loss_bwd",
            "dpo_loss",
            "(chosen[P], rejected[P], ref_chosen[P], ref_rejected[P], len_chosen[P] | None, "
            "len_rejected[P] | None, beta: float, loss_type: str, label_smoothing: float, mean: bool, "
            "grad_losses[P] fp32 | None, grad_loss[] fp32 | None, grad_chosen_out[P] fp32, "
            "grad_rejected_out[P] fp32) -> None",
        ),
        # Advantages and returns (spec: rlk.reference.advantages); not differentiable: no _bwd primitives.
        # fp32 (fp64: reference only); masks are bool; modes are strings validated by the op layer.
        Primitive(
            "group_advantages_fwd",
            "group_advantages",
            "(scores[B] fp32, group_index[B] int64 | None, group_size: int (used when group_index is None; "
            "divides B), lengths[B] fp32 | None (mode 'opo' only), mode: str, eps: float, out[B] fp32) -> None",
        ),
        Primitive(
            "masked_whiten_fwd",
            "masked_whiten",
            "(x[N] fp32, mask[N] bool, unbiased: bool, eps: float, eps_mode: str ('add' | 'clamp'), "
            "shift_mean: bool, out[N] fp32) -> None",
        ),
        Primitive(
            "discounted_returns_fwd",
            "discounted_returns",
            "(rewards[B,T] fp32, mask[B,T] bool, gamma: float (rounded to fp32 by the op layer), "
            "mask_mode: str ('carry' | 'reset' | 'zero'), out[B,T] fp32) -> None",
        ),
        # Rewards to tokens (spec: rlk.reference.rewards); not differentiable. Per sequence a score (the weighted
        # reward columns, NaN skipped, plus the overlong penalty of its length when overlong_max_len is not None), an
        # optional cost; per region (seq, start, end) a value; each normalized over its group by group_advantages' math
        # (mode None: as is), then placed on the sequence's / region's last masked token or on all of them.
        Primitive(
            "scatter_rewards_fwd",
            "scatter_rewards",
            "(rewards[B,R] fp32, reward_weights[R] fp32, mask[B,T] bool, costs[B] fp32 | None (iff costs_out), "
            "region_values[S] fp32 | None (S >= 1), region_spans[S,3] int64 | None (seq, start, end: 0 <= seq < B, "
            "0 <= start <= end <= T), cost_region_values[S2] fp32 | None, cost_region_spans[S2,3] int64 | None, "
            "group_index[B] int64 | None, group_size: int (used when group_index is None; divides B), "
            "mode: str | None (REWARD_GROUP_MODES; None: no normalization), eps: float, placement: str (PLACEMENTS), "
            "overlong_max_len: int | None, overlong_cache: int, overlong_penalty: float, rewards_out[B,T] fp32, "
            "costs_out[B,T] fp32 | None) -> None",
        ),
        Primitive(
            "gae_fwd",
            "gae",
            "(rewards[B,T] fp32, values[B,T] fp32, mask[B,T] bool, gamma: float, gamma_lam: float (= gamma * lam; "
            "both rounded to fp32 by the op layer), advantages_out[B,T] fp32, returns_out[B,T] fp32) -> None",
        ),
        # Policy losses and KL (spec: rlk.reference.policy_loss): fp32 (fp64: reference only), bool mask; the
        # forward computes the aggregation weights c (rlk.reference.aggregation) and the loss's own gradient
        # (upstream 1) in one pass; the backward scales it by the upstream gradient. Scalar attributes keyword-only.
        Primitive(
            "policy_loss_fwd",
            "policy_loss",
            "(logprob[B,T] fp32, old_logprob[B,T] fp32, advantages[B,T] | [B,1] fp32, mask[B,T] bool, "
            "importance_weights[B,T] fp32 | None, ref_logprob[B,T] fp32 | None, entropy[B,T] fp32 | None, "
            "global_tokens, global_seqs, loss_scale: float | [] fp32 tensor | None, loss_out[] fp32, "
            "grad_logprob_out[B,T] fp32 (d loss / d logprob: coef of the row sum * c), "
            "grad_entropy_out[B,T] fp32 | None, "
            "row_weight_out[B] fp32 (c), row_stats_out[B,9] fp32, metrics_out[8] fp32, *, agg: str, "
            "loss: str, cispo_upper: bool, clip_low: float, clip_high: float, dual_clip: float (0: off), "
            "clamp_low: float, clamp_high: float (+-inf: off), tau_pos: float, tau_neg: float, kl: str, "
            "kl_coef: float, kl_k3_clamp: bool, kl_clamp: float (inf: off), kl_straight_through: bool, "
            "kl_unbiased: bool, entropy_coef: float) -> None",
        ),
        Primitive(
            "policy_loss_bwd",
            "policy_loss",
            "(grad_loss[] fp32, grad_logprob[B,T] fp32 (the forward's), grad_entropy[B,T] fp32 | None, "
            "grad_logprob_out[B,T] fp32 (grad_logprob * grad_loss), grad_entropy_out[B,T] fp32 | None) -> None",
        ),
        Primitive(
            "kl_penalty_fwd",
            "kl_penalty",
            "(logprob[N] fp32, ref_logprob[N] fp32, old_logprob[N] fp32 | None, kl_out[N] fp32, coef_out[N] fp32, "
            "*, estimator: str, straight_through: bool, k3_clamp: bool, clamp: float (inf: off)) -> None",
        ),
        Primitive(
            "kl_penalty_bwd",
            "kl_penalty",
            "(grad_kl[N] fp32, coef[N] fp32, grad_logprob_out[N] fp32) -> None",
        ),
        # Rollout correction (spec: rlk.reference.rollout_correction): importance weights of the training engine's
        # log-probs against the rollout engine's, and their metrics; not differentiable (no _bwd primitive).
        Primitive(
            "rollout_correction_fwd",
            "rollout_correction",
            "(old_logprob[B,T] fp32, rollout_logprob[B,T] fp32, mask[B,T] bool, weights_out[B,T] fp32, "
            "metrics_out[M] fp32 (rlk.reference.rollout_correction.METRICS), *, level: str ('token' | 'sequence'), "
            "mode: str ('truncate' | 'mask'), upper: float (inf: none), lower: float (0: none), "
            "clamp: float (inf: none)) -> None",
        ),
        # ---- the batch-invariant forward chain (specs: rlk.reference.norm, .matmul, .attention, .rope,
        # .embedding). Float dtypes float32 / float16 / bfloat16 (float64: reference only); accumulation
        # fp32; outputs in the input dtype unless stated. Batch invariance: a row's (token's) outputs are
        # bitwise independent of the other rows; sums over rows (weight gradients) use a fixed row
        # partition reduced in a fixed order (deterministic run to run, no atomics).
        Primitive(
            "rms_norm_fwd",
            "rms_norm",
            "(x[N,H] float, weight[H] x.dtype | fp32, residual[N,H] x.dtype | None, eps: float, gemma: bool, "
            "out[N,H] (x.dtype; fp32 for an fp32 weight in the Llama form, as torch promotes weight * n), "
            "residual_out[N,H] x.dtype | None (s = x + residual, rounded to x.dtype), rstd_out[N] fp32) -> None",
        ),
        Primitive(
            "rms_norm_bwd",
            "rms_norm",
            "(grad_out[N,H] out.dtype, s[N,H] x.dtype (the normalized input: x, or x + residual), weight[H], "
            "rstd[N] fp32, gemma: bool, grad_residual[N,H] x.dtype | None (upstream gradient of residual_out), "
            "grad_input_out[N,H] x.dtype (gradient of s: of x, and of residual when fused), "
            "grad_weight_out[H] weight.dtype | None) -> None",
        ),
        # matmul: the one exception to 'contiguous': a and b may be row-major or column-major views (one unit
        # stride each), so linear's weight and the transposed operands of the backward need no copy.
        Primitive(
            "matmul_fwd",
            "matmul",
            "(a[M,K] float, b[K,N] a.dtype, bias[N] a.dtype | None, out[M,N] a.dtype contiguous) -> None",
        ),
        Primitive(
            "matmul_bwd",
            "matmul",
            "(grad_out[M,N] a.dtype, a[M,K], b[K,N], grad_a_out[M,K] | None, grad_b_out[K,N] | None, "
            "grad_bias_out[N] | None; the gradient outputs may be row- or column-major, written through their "
            "strides) -> None",
        ),
        Primitive(
            "attention_fwd",
            "attention",
            "(q[Tq,Hq,D] float, k[Tk,Hkv,D] q.dtype, v[Tk,Hkv,D] q.dtype, cu_seqlens_q[B+1] int32, "
            "cu_seqlens_k[B+1] int32, max_seqlen_q: int, max_seqlen_k: int, causal: bool (bottom-right aligned), "
            "softmax_scale: float, out[Tq,Hq,D] q.dtype, lse_out[Hq,Tq] fp32) -> None",
        ),
        Primitive(
            "attention_bwd",
            "attention",
            "(grad_out[Tq,Hq,D], q, k, v, out[Tq,Hq,D], lse[Hq,Tq] fp32, grad_lse[Hq,Tq] fp32 | None, "
            "cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float, "
            "grad_q_out[Tq,Hq,D] q.dtype, grad_k_out[Tk,Hkv,D] q.dtype, grad_v_out[Tk,Hkv,D] q.dtype) -> None",
        ),
        # prefix_attention (spec: rlk.reference.attention): attention whose sequence b, where prefix_index[b] = a >= 0,
        # reads the keys of sequence a (all of them) before its own: logical keys [keys of a; keys of b] of length
        # P_b + Lk_b (P_b = Lk_a), the causal mask bottom-right aligned over that length. prefix_index[b] = -1: an
        # ordinary sequence. One level deep (a referenced sequence has -1; the op layer checks the values).
        # max_seqlen_k bounds each sequence's own keys. dk / dv of a referenced sequence's keys sum its own queries'
        # contributions, then each referencing sequence's, in ascending sequence order.
        Primitive(
            "prefix_attention_fwd",
            "prefix_attention",
            "(q[Tq,Hq,D] float, k[Tk,Hkv,D] q.dtype, v[Tk,Hkv,D] q.dtype, cu_seqlens_q[B+1] int32, "
            "cu_seqlens_k[B+1] int32, max_seqlen_q: int, max_seqlen_k: int (own keys), prefix_index[B] int32 "
            "(-1 or the index of a sequence whose prefix_index is -1), causal: bool (bottom-right aligned over "
            "the logical keys), softmax_scale: float, out[Tq,Hq,D] q.dtype, lse_out[Hq,Tq] fp32) -> None",
        ),
        Primitive(
            "prefix_attention_bwd",
            "prefix_attention",
            "(grad_out[Tq,Hq,D], q, k, v, out[Tq,Hq,D], lse[Hq,Tq] fp32, grad_lse[Hq,Tq] fp32 | None, "
            "cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, prefix_index[B] int32, causal: bool, "
            "softmax_scale: float, grad_q_out[Tq,Hq,D] q.dtype, grad_k_out[Tk,Hkv,D] q.dtype, "
            "grad_v_out[Tk,Hkv,D] q.dtype) -> None",
        ),
        # softmax / log_softmax over the last dim of [N, V] rows: fp32 math, one rounding to x.dtype.
        Primitive(
            "softmax_fwd",
            "softmax",
            "(x[N,V] float, log: bool, out[N,V] x.dtype) -> None",
        ),
        Primitive(
            "softmax_bwd",
            "softmax",
            "(grad_out[N,V] x.dtype, out[N,V] x.dtype (the forward's output), log: bool, grad_x_out[N,V] x.dtype) "
            "-> None",
        ),
        # rope: one tensor at a time; the backward is the inverse rotation (sin negated).
        Primitive(
            "rope_fwd",
            "rope",
            "(x[T,H,D] float, cos[T,R] fp32 | x.dtype (R even, R <= D: partial rotary, features past R copied), "
            "sin[T,R] like cos, interleaved: bool, out[T,H,D] x.dtype) -> None",
        ),
        Primitive(
            "rope_bwd",
            "rope",
            "(grad_out[T,H,D], cos[T,R], sin[T,R], interleaved: bool, grad_x_out[T,H,D] grad_out.dtype) -> None",
        ),
        Primitive(
            "embedding_fwd",
            "embedding",
            "(weight[V,H] float, ids[N] int64 (in [0, V)), out[N,H] weight.dtype) -> None",
        ),
        Primitive(
            "embedding_bwd",
            "embedding",
            "(grad_out[N,H] weight.dtype, ids[N] int64, padding_idx: int (-1: none), "
            "grad_weight_out[V,H] weight.dtype (row v: fp32 sum of the grad_out rows with id v in position "
            "order, 0 for padding_idx and unused ids)) -> None",
        ),
        # pack (spec: rlk.reference.pack): padded [B, T, *] rows (N = B * T rows of F elements) to packed varlen
        # rows [M, F] and back, by slot[N] int64 (the packed row of each valid token, -1 at padding; a bijection of
        # the valid tokens onto [0, M)). Bitwise copies of any dtype the backend serves (floats, int32 / int64).
        Primitive(
            "pack_fwd",
            "pack",
            "(x[N,F], slot[N] int64, out[M,F] x.dtype (out[slot[n]] = x[n] for slot[n] >= 0)) -> None",
        ),
        Primitive(
            "pack_bwd",
            "pack",
            "(packed[M,F], slot[N] int64, fill: float, out[N,F] packed.dtype (packed[slot[n]], or fill where "
            "slot[n] < 0)) -> None",
        ),
        # ema (spec: rlk.reference.ema): in-place exponential moving average of a list of tensors (a reference /
        # target model's weights): target[i] <- lerp(target[i], source[i], 1 - decay) in fp32 math, written back in
        # the target's dtype; decay = 1 writes nothing, decay = 0 copies the source's bits. Not differentiable. The
        # op layer hands a backend one dtype at a time, non-empty tensors only, no two targets overlapping.
        Primitive(
            "ema_fwd",
            "ema",
            "(targets: list of [n_i] float (one dtype, updated in place), sources: list of [n_i] targets' dtype, "
            "decay: float in [0, 1]) -> None",
        ),
        # sample (spec: rlk.reference.sampling): one token per row by Gumbel-max over the filtered, temperature-
        # scaled logits; Philox4x32-10 keyed by the row's seed, counter (v // 4, 0, step). Not differentiable.
        Primitive(
            "sample_fwd",
            "sample",
            "(logits[B,V] float (last dim contiguous), seed[B] int64, step[B] int64, inv_temperature: float, "
            "top_k: int (0: off), top_p: float in (0, 1] (1: off), min_p: float in [0, 1] (0: off), greedy: bool, "
            "tokens_out[B] int64, logprob_out[B] fp32 (pre-filter log_softmax of the scaled logits)) -> None",
        ),
    )
}

_FLOAT_DTYPES = ("float32", "float16", "bfloat16")

OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op("selected_logprob", "selected_logprob_fwd", "selected_logprob_bwd", _FLOAT_DTYPES),
        Op("linear_logprob", "linear_logprob_fwd", "linear_logprob_bwd", _FLOAT_DTYPES),
        Op("fused_linear_kl", "fused_linear_kl_fwd", "fused_linear_kl_bwd", _FLOAT_DTYPES),
        Op("linear_logprob_stored", "linear_logprob_stored_fwd", "linear_logprob_stored_bwd", _FLOAT_DTYPES),
        # the op layer upcasts 16-bit inputs: the primitives see float32 only
        Op("value_loss", "value_loss_fwd", "value_loss_bwd", ("float32",)),
        Op("dpo_loss", "dpo_loss_fwd", "dpo_loss_bwd", ("float32",)),
        Op("group_advantages", "group_advantages_fwd", None, ("float32",)),
        Op("masked_whiten", "masked_whiten_fwd", None, ("float32",)),
        Op("discounted_returns", "discounted_returns_fwd", None, ("float32",)),
        Op("gae", "gae_fwd", None, ("float32",)),
        Op("scatter_rewards", "scatter_rewards_fwd", None, ("float32",)),
        Op("policy_loss", "policy_loss_fwd", "policy_loss_bwd", ("float32",)),
        Op("kl_penalty", "kl_penalty_fwd", "kl_penalty_bwd", ("float32",)),
        Op("rollout_correction", "rollout_correction_fwd", None, ("float32",)),
        Op("rms_norm", "rms_norm_fwd", "rms_norm_bwd", _FLOAT_DTYPES),
        Op("matmul", "matmul_fwd", "matmul_bwd", _FLOAT_DTYPES),
        Op("attention", "attention_fwd", "attention_bwd", _FLOAT_DTYPES),
        Op("prefix_attention", "prefix_attention_fwd", "prefix_attention_bwd", _FLOAT_DTYPES),
        Op("softmax", "softmax_fwd", "softmax_bwd", _FLOAT_DTYPES),
        Op("rope", "rope_fwd", "rope_bwd", _FLOAT_DTYPES),
        Op("embedding", "embedding_fwd", "embedding_bwd", _FLOAT_DTYPES),
        Op("pack", "pack_fwd", "pack_bwd", (*_FLOAT_DTYPES, "int32", "int64")),
        Op("ema", "ema_fwd", None, _FLOAT_DTYPES),
        Op("sample", "sample_fwd", None, _FLOAT_DTYPES),
    )
}


def collect_primitives(*modules) -> dict[str, object]:
    """A backend's primitive table: every ABI primitive a module defines under its ABI name.

    Backends keep one module per op family with the same file name everywhere
    (``logprob``, ``policy_loss``...) and name each primitive function after its ABI entry,
    so the table needs no hand-written mapping. A name defined twice is an error.
    """
    table: dict[str, object] = {}
    for module in modules:
        for name in PRIMITIVES:
            if hasattr(module, name):
                if name in table:
                    raise ValueError(f"primitive {name} is defined in two modules")
                table[name] = getattr(module, name)
    return table


# ---------------------------------------------------------------------------
# Vocabulary: the modes, names and constants the primitives' attributes and outputs use. The op layer, the
# reference and every backend read them from here.
# ---------------------------------------------------------------------------

#: Policy-loss variants (the ``loss`` attribute of ``policy_loss_fwd``): the clipped family, the DPPO-Binary
#: trust-region losses (token-local; ``dual_clip`` is their ratio cap) and TRL's VESPO (a detached gamma weight
#: of the sequence ratio).
LOSSES = ("ppo", "gspo", "cispo", "gpg", "sapo", "geo_mean", "dppo_tv", "dppo_kl", "vespo")
#: KL estimators (canonical names; the op layer resolves aliases such as ``low_var_kl``).
KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
#: Columns of ``policy_loss_fwd``'s ``row_stats_out`` (per-row partials, combined in row order into the metrics).
ROW_STATS = ("loss", "tokens", "clipped", "lower_clipped", "neg_log_ratio", "ratio", "ratio_max", "entropy", "kl")
#: Entries of ``policy_loss_fwd``'s ``metrics_out``.
POLICY_METRICS = (
    "clip_fraction",
    "lower_clip_fraction",
    "approx_kl",
    "ratio_mean",
    "ratio_max",
    "entropy_mean",
    "kl_mean",
    "tokens",
)
#: verl's k3 ("low_var_kl") clamps: the log-ratio, then the value.
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0
#: vespo's bounds of ``log w_i`` and of each ``log I_t`` (TRL's: ``ln 1e-8`` and 20).
VESPO_LOG_W_MIN = math.log(1e-8)
VESPO_LOG_W_MAX = 20.0
#: vespo's ``phi`` is 0 above this exponent (``exp`` overflows float32 there), in every dtype.
VESPO_LOG_PHI_MAX = math.log(torch.finfo(torch.float32).max)

#: Loss aggregation modes (the ``agg`` attribute), in the order of ``rlk.reference.aggregation``'s table.
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

#: DPO variants, in the order of their codes in the kernels.
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "robust")

#: Distillation divergences (``fused_linear_kl``'s ``divergence``).
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")

#: Group-relative advantage modes; pass@k modes give only each group's best response an advantage, its margin
#: over the runner-up.
GROUP_MODES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg")
PASSK_MODES = ("grpo_passk", "dr_grpo_passk")
#: What a masked step does to the running return; how ``eps`` enters the std.
RETURN_MASK_MODES = ("carry", "reset", "zero")
EPS_MODES = ("add", "clamp")
#: scatter_rewards: the group normalizations of a sequence's score (group_advantages' modes whose value depends on the
#: group only), and where a sequence's or a region's value lands on its tokens.
REWARD_GROUP_MODES = ("grpo", "dr_grpo", "rloo")
PLACEMENTS = ("last", "broadcast")

#: Rollout correction: levels of the ratio (``level``), what happens outside the thresholds (``mode``) and the
#: entries of ``metrics_out``, in order.
CORRECTION_LEVELS = ("token", "sequence")
CORRECTION_MODES = ("truncate", "mask")
CORRECTION_TOKEN_METRICS = (
    "weight_mean",
    "weight_max",
    "weight_min",
    "weight_std",
    "ess",
    "ratio_max",
    "ratio_min",
    "fraction_high",
    "fraction_low",
    "clipped_fraction",
    "abs_log_ratio_mean",
    "abs_log_ratio_max",
    "kl",
    "k3_kl",
    "chi2_token",
    "tokens",
)
CORRECTION_SEQ_METRICS = (
    "seq_weight_mean",
    "seq_weight_max",
    "seq_weight_min",
    "seq_weight_std",
    "seq_weight_max_deviation",
    "seq_fraction_high",
    "seq_fraction_low",
    "seq_clipped_fraction",
    "chi2_seq",
    "training_ppl",
    "training_log_ppl",
    "rollout_ppl",
    "rollout_log_ppl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
    "sequences",
)
CORRECTION_METRICS = CORRECTION_TOKEN_METRICS + CORRECTION_SEQ_METRICS


def correction_thresholds(upper: float, lower: float) -> tuple[float, float]:
    """``(high, low)``: the thresholds of rollout correction's fraction metrics; ``lower <= 0`` means
    ``1 / upper`` (0 for an infinite ``upper``)."""
    low = lower if lower > 0 else (1.0 / upper if math.isfinite(upper) else 0.0)
    return upper, low


def recurrence_constants(gamma: float, lam: float, dtype: torch.dtype) -> tuple[float, float]:
    """``gamma`` and ``gamma * lam`` (the product taken in double) rounded to ``dtype``'s compute dtype:
    the constants the returns / GAE primitives receive for inputs of ``dtype``."""
    cdt = compute_dtype(dtype)
    return (
        float(torch.tensor(gamma, dtype=torch.float64).to(cdt)),
        float(torch.tensor(gamma * lam, dtype=torch.float64).to(cdt)),
    )
