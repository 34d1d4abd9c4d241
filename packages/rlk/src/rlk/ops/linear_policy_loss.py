"""``fused_linear_policy_loss``: hidden states -> log-prob -> policy loss, never materializing all the logits.

Two modes with, on a batch-invariant backend, the same log-probs (``linear_logprob``'s), loss and metrics bit for
bit, and gradients within the numerical contract:

* ``"lean"``: :func:`rlk.linear_logprob` then :func:`rlk.policy_loss`; extra memory O(N + tile), the backward
  recomputes the logits (8 N H V FLOPs in all);
* ``"one_pass"``: chunks of tokens whose scaled fp32 logits are stored by the forward, so that the loss's
  gradient is computed in the forward from them (6 N H V FLOPs, a ``[rows, V]`` fp32 buffer).

``"auto"`` (the default) picks one of them per call: :func:`decide_mode`. The math of the one-pass chunks is in
:func:`fused_linear_policy_loss`'s docstring; its primitives are ``linear_logprob_stored_fwd`` / ``_bwd``
(spec: :mod:`rlk.reference.logprob`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from rlk.core import checks, custom_op, dispatch
from rlk.core.abi import POLICY_METRICS
from rlk.ops import logprob as logprob_ops
from rlk.ops import policy_loss as policy_ops
from rlk.ops import spans
from rlk.ops.policy_loss import PolicyLossConfig, policy_loss, resolve_config

#: The modes of :func:`fused_linear_policy_loss`.
MODES = ("auto", "one_pass", "lean")
#: Default tokens per one-pass chunk: the chunk's fp32 logits buffer is ``chunk_tokens * V * 4`` bytes (1.16 GiB
#: at V = 151936), as large as the bf16 weight gradient, so that the peak extra memory of a bf16 step at that
#: vocabulary and H = 4096 is about 3.6 GiB (docstring of :func:`fused_linear_policy_loss`).
CHUNK_TOKENS = 2048
#: Losses whose per-token gradient needs the log-probs of the whole sequence (a sequence ratio or loss): the
#: one-pass mode cuts their batch into chunks of whole sequences. Every other loss is token-local.
SEQUENCE_LEVEL_LOSSES = ("gspo", "geo_mean", "vespo")
#: The backends on which ``mode="auto"`` picks the one-pass mode: those whose one-pass kernels are written for
#: speed and verified on a GPU. The reference backend implements the same primitives as a readable specification;
#: ``auto`` keeps its lean path, the memory-bounded CPU default. Triton: its one-pass kernels run faster than lean
#: on an H200 (133.7 vs 156.2 ms at B=16, T=1024, H=4096, V=151936 bf16, 3.7 GiB extra; docs/performance.md), and
#: the GPU test suite passed with ``auto`` choosing them. Not rlk-cuda: its one-pass Hopper kernels are slower than
#: its lean mode at that shape (165.3 vs 139.9 ms; the fp32 weight-gradient sums over the row chunks). With
#: ``RLK_TRITON_LM_HEAD=tiled`` the Triton backend's stored primitives take its cuBLAS-tiled path, as its
#: ``linear_logprob`` does: the one-pass log-probs stay the rollout's bits.
ONE_PASS_BACKENDS: tuple[str, ...] = ("triton",)


@dataclass(frozen=True)
class ModeDecision:
    """What :func:`decide_mode` chose: ``mode`` ``"one_pass"`` or ``"lean"``, the backend of the log-probs (None
    when nothing was dispatched) and why."""

    mode: str
    backend: str | None
    reason: str

    def __str__(self) -> str:
        where = f" on '{self.backend}'" if self.backend else ""
        return f"fused_linear_policy_loss: {self.mode}{where}: {self.reason}"


def decide_mode(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    mode: str = "auto",
    loss: str = "ppo",
    chunk_tokens: int = CHUNK_TOKENS,
) -> ModeDecision:
    """The mode :func:`fused_linear_policy_loss` runs for these inputs (``mode`` as given to it), and why.

    * ``"lean"``: always lean.
    * No gradient to compute (grad mode off, or neither ``hidden`` nor ``weight`` requires grad), or no token:
      lean in every mode (the forward of both modes is ``linear_logprob``'s; nothing to store).
    * The backend that runs ``linear_logprob`` must implement ``linear_logprob_stored``: the one-pass log-probs must
      be ``linear_logprob``'s bits (rollout log-probs come from ``linear_logprob``; the first micro-step's ratio is
      exactly 1 only then), so another backend's kernels may not stand in. When it does not (rlk-cuda off Hopper
      or with ``RLK_CUDA_LINEAR_FWD=mma``; the domestic backend): ``auto`` is lean, ``one_pass`` raises
      :class:`rlk.BackendError` (pin ``RLK_BACKEND=triton`` to run the one-pass mode on the Triton kernels).
    * ``auto``: lean unless that backend is in :data:`ONE_PASS_BACKENDS`; lean for a loss of
      :data:`SEQUENCE_LEVEL_LOSSES` whose sequences are longer than ``chunk_tokens`` (a chunk would hold a
      whole sequence: more memory than asked for).
    * Otherwise one pass.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")
    if mode == "lean":
        return ModeDecision("lean", None, "mode='lean'")
    if targets.numel() == 0:
        return ModeDecision("lean", None, "no tokens")
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return ModeDecision("lean", None, "no gradient to compute: the forward is linear_logprob's in both modes")
    lin, stored, explained = _backends(hidden.device, hidden.dtype)
    if lin is None or stored != lin:
        reason = (
            f"linear_logprob runs on '{lin}', which does not implement linear_logprob_stored (the one-pass "
            "log-probs must be linear_logprob's bits)"
        )
        if mode == "one_pass":
            raise dispatch.BackendError(
                f"fused_linear_policy_loss: mode='one_pass': {reason}; pin a backend that "
                f"implements both (RLK_BACKEND=triton) or use mode='lean'\n{explained}"
            )
        return ModeDecision("lean", lin, reason)
    if mode == "auto":
        if lin not in ONE_PASS_BACKENDS:
            where = ", ".join(ONE_PASS_BACKENDS) or "no backend"
            return ModeDecision("lean", lin, f"auto picks one_pass on {where} only")
        length = targets.shape[-1] if targets.dim() else 1
        if loss in SEQUENCE_LEVEL_LOSSES and length > chunk_tokens:
            return ModeDecision(
                "lean",
                lin,
                f"loss={loss!r} needs whole sequences in a chunk, and T = {length} > chunk_tokens = {chunk_tokens}",
            )
    return ModeDecision("one_pass", lin, f"mode={mode!r}")


@torch.compiler.assume_constant_result
def _backends(device: torch.device, dtype: torch.dtype) -> tuple[str | None, str | None, str]:
    """The backends that run ``linear_logprob`` and ``linear_logprob_stored`` here, and the dispatcher's
    explanation of both; a constant to ``torch.compile`` (the dispatcher reads context variables and the
    environment, which it does not trace), like the backend a traced custom op picks when it runs."""
    lin = dispatch.decide("linear_logprob", device, dtype)
    stored = dispatch.decide("linear_logprob_stored", device, dtype)
    return lin.backend, stored.backend, f"{lin}\n{stored}"


# ---------------------------------------------------------------------------
# the one-pass forward: loss, gradients, log-probs and metrics in one custom op
# ---------------------------------------------------------------------------


def _one_pass_outputs(
    hidden: Tensor,
    weight: Tensor,
    targets,
    inv_temperature,
    old_logprob,
    advantages,
    mask: Tensor,
    importance_weights,
    ref_logprob,
    global_tokens,
    global_seqs,
    loss_scale,
    ignore_index,
    chunk_tokens: int,
    agg,
    loss: str,
    kl,
    flags,
    params,
    with_entropy_grad,
    with_entropy: bool,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    *,
    weight_grad_later: bool = False,
) -> tuple[Tensor, ...]:
    """``(loss, grad_hidden, grad_weight, logprob, entropy, metrics)`` of the one-pass op (its arguments).
    ``weight_grad_later``: where the weight gradient is summed over chunks (:func:`_weight_grad_summed`), a
    placeholder in its place, allocated by the body once the logits buffer is freed."""
    shape, cdt = tuple(mask.shape), checks.stat_dtype(hidden)
    later = weight_grad_later and _weight_grad_summed(hidden, weight, mask, chunk_tokens, loss, need_grad_weight)
    loss_out = hidden.new_empty((), dtype=cdt)
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else custom_op.placeholder(hidden)
    grad_weight = torch.empty_like(weight) if need_grad_weight and not later else custom_op.placeholder(weight)
    lp = hidden.new_empty(shape, dtype=cdt)
    entropy = hidden.new_empty(shape if with_entropy else (0,), dtype=cdt)
    metrics = hidden.new_empty((len(POLICY_METRICS),), dtype=cdt)
    return loss_out, grad_hidden, grad_weight, lp, entropy, metrics


def _chunk_tokens(b: int, t: int, chunk_tokens: int, whole_rows: bool) -> int:
    """Tokens per chunk: ``chunk_tokens``, or the whole rows that fit in it (at least one) for ``whole_rows``."""
    return max(1, chunk_tokens // t) * t if whole_rows else min(chunk_tokens, b * t)


def _weight_grad_summed(
    hidden: Tensor, weight: Tensor, mask: Tensor, chunk_tokens: int, loss: str, need_grad_weight: bool
) -> bool:
    """Whether a 16-bit weight gradient is summed over several chunks: in fp32, its rounded copy allocated only
    once the logits buffer is freed (the peak holds one of the two)."""
    b, t = mask.shape
    step = _chunk_tokens(b, t, chunk_tokens, loss in SEQUENCE_LEVEL_LOSSES)
    return need_grad_weight and step < hidden.shape[0] and weight.dtype != checks.stat_dtype(hidden)


def _chunk_normalizers(agg: str, mask: Tensor, given: dict[str, object], cdt: torch.dtype) -> dict[str, object]:
    """Normalizers that give every row of a chunk its aggregation weight in the whole batch: the caller's, else the
    batch's own counts as one-element tensors (no host synchronization), computed as the policy-loss kernels count
    them (:func:`rlk.reference.aggregation.row_weights`), so the weights are the same numbers."""
    norms = dict(given)
    if agg == "token-mean" and norms["global_tokens"] is None:
        norms["global_tokens"] = mask.sum(dtype=torch.int64).clamp(min=1).to(cdt)
    if agg.startswith("seq-") and norms["global_seqs"] is None:
        norms["global_seqs"] = (mask.sum(dim=1, dtype=torch.int64) > 0).sum().clamp(min=1).to(cdt)
    return norms


one_pass_op = custom_op.declare("fused_linear_policy_loss", dispatch_op="linear_logprob_stored")


@one_pass_op.forward(
    outputs=functools.partial(_one_pass_outputs, weight_grad_later=True),
    fake=_one_pass_outputs,
    primitive=("linear_logprob_stored_fwd", "linear_logprob_stored_bwd"),
)
def _one_pass_fwd(
    primitive,
    out,
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    inv_temperature: Tensor,
    old_logprob: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    importance_weights: Tensor | None,
    ref_logprob: Tensor | None,
    global_tokens: Tensor | None,
    global_seqs: Tensor | None,
    loss_scale: Tensor | None,
    ignore_index: int,
    chunk_tokens: int,
    agg: str,
    loss: str,
    kl: str,
    flags: list[bool],
    params: list[float],
    with_entropy_grad: bool,
    with_entropy: bool,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    stored_fwd, stored_bwd = primitive
    loss_out, grad_hidden, grad_weight, lp, entropy, metrics = out
    b, t = mask.shape
    n, vocab = hidden.shape[0], weight.shape[0]
    cdt = checks.stat_dtype(hidden)
    step = _chunk_tokens(b, t, chunk_tokens, loss in SEQUENCE_LEVEL_LOSSES)
    summed = _weight_grad_summed(hidden, weight, mask, chunk_tokens, loss, need_grad_weight)
    logprob_ops.check_target_values(targets, inv_temperature, vocab, ignore_index)
    checks.check_normalizer_values(
        {"global_tokens": global_tokens, "global_seqs": global_seqs, "loss_scale": loss_scale}
    )
    given = policy_ops.normalizers([global_tokens, global_seqs, loss_scale], params)
    chunk_norms = _chunk_normalizers(agg, mask, given, cdt)
    policy_fwd = dispatch.select("policy_loss", hidden.device, cdt).primitives["policy_loss_fwd"]

    def policy(rows: slice, norms: dict[str, object], entropy_in: Tensor | None) -> tuple[Tensor, ...]:
        """The policy-loss forward over the sequences ``rows`` of the batch (fresh outputs)."""
        args = (
            lp[rows],
            lp[rows] if old_logprob is None else old_logprob[rows],
            advantages[rows],
            mask[rows],
            None if importance_weights is None else importance_weights[rows],
            None if ref_logprob is None else ref_logprob[rows],
            entropy_in,
            with_entropy_grad,
        )
        chunk_out = policy_ops._fwd_outputs(*args)
        policy_ops.launch(policy_fwd, chunk_out, *args, norms, agg, loss, kl, flags, params)
        return chunk_out

    # tokens after the current chunk are read (their results discarded) by its policy-loss call: zeros, not garbage
    lp.zero_()
    entropy.zero_()
    lp_flat = lp.view(-1)
    ent_flat = entropy.view(-1) if with_entropy else None
    lse = hidden.new_empty((n,), dtype=cdt)
    valid_target = (targets != ignore_index)[:, None] if need_grad_weight else None
    logits = hidden.new_empty((step, vocab), dtype=cdt)
    # the weight gradient: written by the one chunk (or summed in place in fp32 / fp64), else fp32 sums
    acc = torch.empty(weight.shape, dtype=cdt, device=weight.device) if summed else grad_weight
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        rows = slice(n0, n1)
        z = logits[: n1 - n0]
        stored_fwd(
            hidden[rows],
            weight,
            targets[rows],
            inv_temperature[rows],
            ignore_index,
            lp_flat[rows],
            None if ent_flat is None else ent_flat[rows],
            lse[rows],
            z,
        )
        # the policy loss of the chunk's sequences (whole rows, also the parts of other chunks: their results are
        # not used), with the whole batch's normalizers: each token's gradient as in one call over the batch
        b0, b1 = n0 // t, -(-n1 // t)
        seq = slice(b0, b1)
        _, grad_lp, grad_ent, _, _, _ = policy(seq, chunk_norms, entropy[seq] if with_entropy_grad else None)
        offset = slice(n0 - b0 * t, n1 - b0 * t)
        h = hidden[rows]
        stored_bwd(
            h if valid_target is None else torch.where(valid_target[rows], h, h.new_zeros(())),
            weight,
            targets[rows],
            inv_temperature[rows],
            lse[rows],
            ent_flat[rows] if with_entropy_grad else None,
            grad_lp.view(-1)[offset],
            grad_ent.view(-1)[offset] if with_entropy_grad else None,
            ignore_index,
            z,
            grad_hidden[rows] if need_grad_hidden else None,
            acc if need_grad_weight else None,
            n0 > 0,
        )
    del logits, z
    if summed:  # rounded once
        grad_weight = acc.to(weight.dtype)
        del acc
    # the loss and the metrics: one call over the whole batch, the composition's own (bitwise its values)
    whole = policy(slice(0, b), given, entropy if with_entropy else None)
    loss_out.copy_(whole[0])
    metrics.copy_(whole[5])
    return loss_out, grad_hidden, grad_weight, lp, entropy, metrics


def _save_one_pass(ctx, inputs, output):
    _, grad_hidden, grad_weight, lp, entropy, metrics = output
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.need = (inputs.need_grad_hidden, inputs.need_grad_weight)
    ctx.mark_non_differentiable(grad_hidden, grad_weight, lp, entropy, metrics)
    ctx.set_materialize_grads(False)


def _backward_one_pass(ctx, grad_loss, grad_grad_hidden, grad_grad_weight, grad_lp, grad_entropy, grad_metrics):
    """The gradients were computed in the forward for an upstream gradient of 1: scale them by the upstream one."""
    grad_hidden, grad_weight = ctx.saved_tensors
    if grad_loss is None:
        return {}
    return {
        "hidden": grad_hidden * grad_loss if ctx.need[0] else None,
        "weight": grad_weight * grad_loss if ctx.need[1] else None,
    }


one_pass_op.autograd(save=_save_one_pass, backward=_backward_one_pass)


# ---------------------------------------------------------------------------
# the public op
# ---------------------------------------------------------------------------


def fused_linear_policy_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    old_logprob: Tensor | None,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    loss_spans: Tensor | None = None,
    span_tags: int | tuple[int, ...] | None = None,
    temperature: float | Tensor = 1.0,
    ignore_index: int = -100,
    ref_logprob: Tensor | None = None,
    return_entropy: bool = False,
    mode: str = "auto",
    chunk_tokens: int = CHUNK_TOKENS,
    config: PolicyLossConfig | None = None,
    importance_weights: Tensor | None = None,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    loss_scale: float | Tensor | None = None,
    **options,
) -> tuple[Tensor, dict[str, Tensor]] | tuple[Tensor, dict[str, Tensor], Tensor]:
    """Policy loss of ``hidden @ weight.T`` without materializing the logits of the whole batch.

    ``loss, metrics = policy_loss(linear_logprob(hidden, weight, scored, ...), old_logprob, advantages,
    scored != ignore_index, ref_logprob=ref_logprob, entropy=..., **kwargs)`` with ``scored = where(mask != 0,
    targets, ignore_index)``: a masked position counts as an ignored target (log-prob and entropy 0, no gradient,
    its hidden state never read into ``grad_weight``: NaN or inf there, as in padding rows, leave every gradient
    finite and bitwise those of zeros). In one of two modes (:func:`decide_mode` says which runs):

    * ``mode="lean"``: exactly that composition. The backward recomputes the logits (``linear_logprob``'s):
      8 N H V FLOPs forward and backward; extra memory ``linear_logprob``'s, O(N + tile) besides the gradients.
    * ``mode="one_pass"``: the batch is cut into chunks of ``chunk_tokens`` consecutive tokens (of whole
      sequences, ``max(1, chunk_tokens // T)`` rows, for the sequence-level losses ``gspo``, ``geo_mean`` and
      ``vespo``). Per chunk, in order: ``linear_logprob``'s forward kernels, which also store the chunk's scaled
      fp32 logits ``z`` in a ``[rows, V]`` buffer (log-prob, entropy and lse are ``linear_logprob``'s bits); the
      policy-loss forward over the chunk's sequences with the whole batch's normalizers (``global_tokens`` /
      ``global_seqs`` as given, else the batch's own counts), so each token's gradient coefficient is the one a
      call over the whole batch gives it; ``G = d loss / d x`` from the stored logits
      (``inv_t (g_lp (onehot - p) + g_H p (E_p[z] - z))``, ``p = exp(z - lse)``); ``grad_hidden[chunk] = G @ weight``
      and ``grad_weight += G.T @ hidden[chunk]`` (fp32 over the chunks in chunk order, rounded once at the end).
      Then the loss and the metrics from one policy-loss forward over the whole batch: the lean mode's values, bit
      for bit. The gradients exist at the end of the forward; the backward multiplies them by the upstream
      gradient. 6 N H V FLOPs. Extra memory at its peak, with ``e`` the input dtype's size, ``rows =
      min(chunk_tokens, B T)`` (whole rows for the sequence-level losses) and a 16-bit weight split into several
      chunks: ``V H 4`` (the fp32 weight-gradient sums) ``+ max(rows (V 4 + H e), V H e)`` (the chunk's fp32
      logits and a copy of its hidden states with ignored rows zeroed; after the last chunk, the rounded weight
      gradient) ``+ N H e`` (``grad_hidden``) ``+ O(B T)``. With one chunk, or fp32 inputs, the weight gradient is
      written (summed) in place: ``rows (V 4 + H e) + V H e + N H e``. At B T = 16384, H = 4096, V = 151936 in bf16
      with the default ``chunk_tokens = 2048``: 2.32 + 1.17 + 0.125 GiB, about 3.6 GiB including the returned
      gradients. ``chunk_tokens`` trades the buffer for the size of the GEMMs.
    * ``mode="auto"`` (default): one pass where ``linear_logprob`` runs on a backend of
      :data:`ONE_PASS_BACKENDS` (the batch has tokens and something needs a gradient; sequence-level losses with
      ``T <= chunk_tokens``), else lean. That tuple holds the Triton backend: on a GPU without rlk-cuda (or with
      ``RLK_BACKEND=triton``) ``auto`` is one pass; on the reference backend and rlk-cuda it is lean.

    On a batch-invariant backend (Triton) both modes give the same log-probs, entropy, loss and metrics bit for bit
    (the reference backend implements the one-pass primitives as their readable spec, but its matmuls may round
    differently for another number of rows: there the modes agree within the contract). Their gradients agree
    within the numerical contract (``rlk.core.contract``), not bitwise: one pass reads the logits its forward computed
    where the lean backward recomputes them, and sums ``grad_weight`` per chunk. One pass keeps the guarantees:
    each row's ``grad_hidden`` is bitwise independent of the other rows (batch-invariant) whenever its
    aggregation weight is (``token-sum``, or global normalizers), and ``grad_weight`` is deterministic run to run.
    Double backward is not supported (neither mode). rlk-cuda has one-pass kernels on Hopper GPUs (its TMA + wgmma
    forward with the logits stored; slower than its lean mode on an H200, so ``auto`` stays lean there); on a
    backend whose ``linear_logprob`` lacks them ``auto`` is lean and ``one_pass`` raises. Under
    ``torch.compile`` the mode (and the pinned backend it depends on) is decided when the call is traced.

    Args:
        hidden: ``[B, T, H]`` (or ``[T, H]``, one sequence) bf16 / fp16 / fp32 hidden states.
        weight: ``[V, H]`` LM head of the same dtype.
        targets: ``[B, T]`` (``[T]``) int32 / int64 next tokens; ``ignore_index`` positions are
            left out of the loss whatever ``mask`` says, and masked positions (``mask == 0``, or off
            ``loss_spans``) count as ``ignore_index`` whatever their target (their entropy is 0).
        old_logprob, advantages, mask: as in :func:`rlk.policy_loss` (``[B, T]``, or ``[T]``; float64 exactly when
            ``hidden`` is, as ``ref_logprob`` and ``importance_weights``).
        loss_spans, span_tags: instead of ``mask``, a span table of the loss tokens, as in :func:`rlk.policy_loss`
            (``[B, T]`` inputs; the mask is built on the device, or copied from a CPU table).
        temperature, ignore_index: as in :func:`rlk.linear_logprob`.
        ref_logprob: reference-model log-probs for the KL term (``kl``, ``kl_coef`` in the config).
        return_entropy: also return the per-token entropy (detached; 0 at masked and ignored positions). The
            entropy is computed whenever this is set or ``entropy_coef`` is non-zero (then it is differentiable
            through the loss).
        mode: ``"auto"``, ``"one_pass"`` or ``"lean"`` (above).
        chunk_tokens: tokens per one-pass chunk (an int >= 1; default :data:`CHUNK_TOKENS`).
        config, importance_weights, global_tokens, global_seqs, loss_scale, **options: as in
            :func:`rlk.policy_loss` (``options``: fields of :class:`rlk.PolicyLossConfig`, ``loss``, ``clip_low``,
            ``agg``, ``entropy_coef``...); no ``entropy``: it is computed here.

    Returns:
        ``(loss, metrics)``, or ``(loss, metrics, entropy)`` with ``return_entropy``. Gradients
        flow to ``hidden`` and ``weight``.
    """
    if "entropy" in options:
        raise TypeError("entropy: computed here from hidden and weight; pass entropy_coef instead")
    flat_hidden, weight_c, flat_targets, inv_t, ignore_index = logprob_ops.linear_inputs(
        hidden, weight, targets, temperature, ignore_index
    )
    checks.same_dtype(
        ("hidden", hidden),
        ("old_logprob", old_logprob),
        ("advantages", advantages),
        ("ref_logprob", ref_logprob),
        ("importance_weights", importance_weights),
    )
    if loss_spans is not None or span_tags is not None or mask is None:
        mask = spans.mask_of(mask, loss_spans, span_tags, tuple(targets.shape), hidden.device, "targets")
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != targets.shape:
        raise ValueError(f"mask: expected the shape of targets {tuple(targets.shape)}, got {tuple(mask.shape)}")
    chunk_tokens = checks.integer("chunk_tokens", chunk_tokens, minimum=1)
    config = resolve_config(config, options)
    tensors = {
        "importance_weights": importance_weights,
        "global_tokens": global_tokens,
        "global_seqs": global_seqs,
        "loss_scale": loss_scale,
    }
    with_entropy = checks.flag("return_entropy", return_entropy) or config.entropy_coef != 0.0
    decision = decide_mode(hidden, weight, targets, mode=mode, loss=config.loss, chunk_tokens=chunk_tokens)
    valid = (mask != 0) & (targets != ignore_index)
    # a masked position is absent, as an ignored target is: scored as ignore_index (log-prob and entropy 0, a zero
    # gradient row, its hidden row zeroed before the weight gradient), so that NaN or inf hidden states there
    # (padding) never reach grad_weight as 0 * NaN
    flat_targets = torch.where(valid.reshape(-1), flat_targets, ignore_index)
    one_sequence = targets.dim() == 1

    def rows(x: Tensor | None) -> Tensor | None:
        return x.unsqueeze(0) if one_sequence and x is not None and x.dim() == 1 else x

    if decision.mode == "lean":  # linear_logprob (its checks done above) then policy_loss
        logprob, entropy, _ = logprob_ops._linear_logprob_fwd(
            flat_hidden, weight_c, flat_targets, inv_t, ignore_index, with_entropy
        )
        logprob = logprob.view(targets.shape)
        entropy = entropy.view(targets.shape) if with_entropy else None
        loss, metrics = policy_loss(
            rows(logprob),
            rows(old_logprob),
            rows(advantages),
            rows(valid),
            ref_logprob=rows(ref_logprob),
            entropy=rows(entropy),
            config=config,
            **tensors,
        )
        if return_entropy:
            return loss, metrics, entropy.detach()
        return loss, metrics

    valid = rows(valid)
    shape = tuple(valid.shape)
    cdt = checks.stat_dtype(hidden)
    call = policy_ops.prepare(
        shape,
        hidden.device,
        cdt,
        rows(old_logprob),
        rows(advantages),
        valid,
        config,
        entropy=True if with_entropy else None,
        ref_logprob=rows(ref_logprob),
        **tensors,
    )
    need_grad = torch.is_grad_enabled()
    loss, _, _, _, entropy, metrics = _one_pass_fwd(
        flat_hidden,
        weight_c,
        flat_targets,
        inv_t,
        call.old,
        call.advantages,
        call.mask,
        call.importance_weights,
        call.ref_logprob,
        *call.norm_tensors,
        ignore_index,
        chunk_tokens,
        call.agg,
        call.loss,
        call.kl,
        call.flags,
        call.params,
        call.with_entropy_grad,
        with_entropy,
        need_grad and flat_hidden.requires_grad,
        need_grad and weight_c.requires_grad,
    )
    metrics = policy_ops.metrics_dict(call, metrics)
    if return_entropy:
        return loss, metrics, entropy.view(targets.shape)
    return loss, metrics
