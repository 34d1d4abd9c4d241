"""Public log-prob ops: ``selected_logprob`` and ``linear_logprob``.

Each op is two ``torch.library.custom_op`` primitives (``rlk::<op>_fwd`` and
``rlk::<op>_bwd``) with fake implementations, so the ops trace under
``torch.compile(fullgraph=True)``, and one ``register_autograd`` that calls the
backward primitive. The custom ops dispatch to the backend chosen by
``rlk.core.dispatch`` at run time; the backward runs on the backend that served the
forward. The math is specified in ``rlk.reference.logprob``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlk.core import checks, custom_op, dispatch
from rlk.core.checks import check_float
from rlk.ops import spans
from rlk.ops.pack import _pack_fwd, _unpack_fwd

_TARGET_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------
# argument checks (shape and dtype at call time; values inside the custom op)
# ---------------------------------------------------------------------------


def _check_targets(targets: Tensor, lead: torch.Size, lead_name: str, device: torch.device) -> None:
    if not isinstance(targets, Tensor):
        raise TypeError(f"targets: expected a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype not in _TARGET_DTYPES:
        raise TypeError(f"targets: expected dtype int32 or int64, got {targets.dtype}")
    if targets.shape != lead:
        raise ValueError(
            f"targets: expected shape {tuple(lead)} ({lead_name} without its last dim), got {tuple(targets.shape)}"
        )
    if targets.device != device:
        raise ValueError(f"targets: expected device {device} (the device of {lead_name}), got {targets.device}")


def _inv_temperature(temperature: float | Tensor, lead: torch.Size, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Per-row ``1 / T`` in ``dtype`` (fp32; fp64 for reference runs), shape ``[N]`` (N = prod(lead))."""
    temperature = checks.positive_scalar_or_tensor("temperature", temperature, dtype)
    if isinstance(temperature, Tensor):
        if temperature.device != device:
            raise ValueError(f"temperature: expected device {device}, got {temperature.device}")
        try:
            t = torch.broadcast_to(temperature, lead)
        except RuntimeError:
            raise ValueError(
                f"temperature: shape {tuple(temperature.shape)} does not broadcast to the targets' "
                f"shape {tuple(lead)} (for one temperature per sequence of targets [B, T], pass "
                "shape [B, 1])"
            ) from None
        t = t.to(dtype)
    else:
        t = torch.full(lead, temperature, dtype=dtype, device=device)
    return torch.reciprocal(t.reshape(-1)).contiguous()


def _check_values(targets: Tensor, inv_temperature: Tensor, vocab: int, ignore_index: int) -> None:
    """Value checks that need the data; run inside the custom op.

    They cost one host synchronization per forward. ``RLK_CHECK_VALUES=0`` skips them (for
    CUDA graph capture, or once a pipeline is known to be clean): a target outside
    ``[0, V)`` then reads out of bounds in the kernels instead of raising.
    """
    if not checks.values_checked():
        return
    bad_target = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
    bad_temperature = ~(inv_temperature > 0) | torch.isinf(inv_temperature)
    flags = torch.stack([bad_target.any(), bad_temperature.any()]).tolist()
    if flags[0]:
        i = int(bad_target.nonzero()[0, 0])
        raise ValueError(
            f"targets: values must lie in [0, {vocab}) or equal ignore_index={ignore_index}; "
            f"found {int(targets[i])} at flat position {i}"
        )
    if flags[1]:
        checks.check_positive_values("temperature", inv_temperature, reciprocal=True)


# ---------------------------------------------------------------------------
# selected_logprob
# ---------------------------------------------------------------------------


def _fwd_outputs(like: Tensor, *inputs) -> tuple[Tensor, Tensor, Tensor]:
    """A forward's outputs ``(logprob [N], entropy [N] ([0] without it), lse [N])`` in the stat dtype of ``like``
    (``logits`` / ``hidden``, ``[N, *]``); ``inputs``: the op's other inputs, ``with_entropy`` last."""
    n_rows, dtype, with_entropy = like.shape[0], checks.stat_dtype(like), inputs[-1]
    logprob = like.new_empty((n_rows,), dtype=dtype)
    entropy = like.new_empty((n_rows if with_entropy else 0,), dtype=dtype)
    return logprob, entropy, like.new_empty((n_rows,), dtype=dtype)


selected_logprob_op = custom_op.declare("selected_logprob")


@selected_logprob_op.forward(outputs=_fwd_outputs)
def _selected_logprob_fwd(
    primitive, out, logits: Tensor, targets: Tensor, inv_temperature: Tensor, ignore_index: int, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    logprob, entropy, lse = out
    if logits.shape[0] == 0:
        return
    _check_values(targets, inv_temperature, logits.shape[1], ignore_index)
    primitive(logits, targets, inv_temperature, ignore_index, logprob, entropy if with_entropy else None, lse)


@selected_logprob_op.backward_primitive(outputs=lambda logits, *_: torch.empty_like(logits))
def _selected_logprob_bwd(
    primitive,
    out,
    logits: Tensor,
    targets: Tensor,
    inv_temperature: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    grad_logprob: Tensor,
    grad_entropy: Tensor | None,
    ignore_index: int,
) -> Tensor:
    if logits.shape[0]:
        primitive(logits, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, ignore_index, out)


def _save_selected(ctx, inputs, output):
    _, entropy, lse = output
    ctx.save_for_backward(inputs.logits, inputs.targets, inputs.inv_temperature, lse, entropy)
    ctx.ignore_index = inputs.ignore_index
    ctx.with_entropy = inputs.with_entropy


def _backward_grads(ctx, grad_logprob, grad_entropy, like: Tensor) -> tuple[Tensor, Tensor | None]:
    """fp32 contiguous output gradients; a missing one is zeros (logprob) or None (entropy)."""
    dtype = checks.stat_dtype(like)
    if grad_logprob is None:
        grad_logprob = like.new_zeros((like.shape[0],), dtype=dtype)
    grad_logprob = grad_logprob.to(dtype).contiguous()
    if not ctx.with_entropy or grad_entropy is None:
        return grad_logprob, None
    return grad_logprob, grad_entropy.to(dtype).contiguous()


def _backward_selected(ctx, grad_logprob, grad_entropy, grad_lse):
    logits, targets, inv_temperature, lse, entropy = ctx.saved_tensors
    grad_logprob, grad_entropy = _backward_grads(ctx, grad_logprob, grad_entropy, logits)
    grad_logits = selected_logprob_op.backward(
        ctx,
        logits,
        targets,
        inv_temperature,
        lse,
        entropy if grad_entropy is not None else None,
        grad_logprob,
        grad_entropy,
        ctx.ignore_index,
    )
    return {"logits": grad_logits}


selected_logprob_op.autograd(save=_save_selected, backward=_backward_selected)


def selected_logprob(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float | Tensor = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    loss_spans: Tensor | None = None,
    span_tags: int | tuple[int, ...] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probability of the target token (and optionally the entropy) from logits.

    For each position with logits ``x`` over ``V`` classes, target ``y`` and
    temperature ``T``: ``z = x / T`` (computed as ``x * (1/T)`` in fp32),
    ``logprob = z_y - logsumexp(z)``, ``entropy = logsumexp(z) - sum_v softmax(z)_v z_v``, both computed relative to
    the row's max ``m`` (``(z_y - m) - log s``, ``log s - b / s``, :mod:`rlk.reference.logprob`): given ``z``, each
    is accurate to its own size for logits of any magnitude (every logit 1e6 or 3e38, offsets of 1e5).

    Args:
        logits: ``[..., V]`` bfloat16, float16 or float32 (any strides).
        targets: ``[...]`` int32 or int64, values in ``[0, V)`` or ``ignore_index``.
        temperature: a float ``> 0``, or a floating tensor ``> 0`` broadcastable to
            ``targets`` (e.g. ``[B, 1]`` for one temperature per sequence). Not
            differentiable.
        ignore_index: positions with this target give log-prob 0, entropy 0 and
            no gradient.
        return_entropy: also return the entropy.
        loss_spans: an int ``[S, 4]`` span table (``rlk.multimodal``'s rows ``(sequence, start, end, tag)``; ``[S, 3]``
            without tags) over the ``[B, T]`` positions of ``targets``: only the positions it covers are scored, the
            others count as ``ignore_index``. On the tensors' device or on the CPU; turned into a mask there (no
            dense mask is built on the host for a device table; one synchronization for the value check, which
            ``RLK_CHECK_VALUES=0`` skips). Spans on token columns mark the
            tokens predicted; for next-token targets (``targets[:, t] = input_ids[:, t + 1]``) pass
            ``rlk.multimodal.shift_spans(spans, -1)``.
        span_tags: score only the rows of ``loss_spans`` whose tag is one of these (a turn; or the modalities to score
            when ``loss_spans`` is ``modality_spans``); None: every row.

    Returns:
        ``logprob`` of shape ``targets.shape``, and ``entropy`` of the same shape when
        ``return_entropy``; fp32 (fp64 for fp64 logits, a reference-only mode). Both are differentiable w.r.t.
        ``logits`` (``d logprob/dz = onehot - p``, ``d entropy/dz = p (E_p[z] - z)``).

    Memory: one pass over the logits; nothing of size ``[N, V]`` is allocated
    besides the gradient. Batch invariance: bitwise on backends that promise it
    (``rlk info``).
    """
    check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits: expected shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    ignore_index = checks.integer("ignore_index", ignore_index)
    return_entropy = checks.flag("return_entropy", return_entropy)
    lead = logits.shape[:-1]
    _check_targets(targets, lead, "logits", logits.device)
    flat_logits = logits.reshape(-1, logits.shape[-1]).contiguous()
    flat_targets = _scored(targets, loss_spans, span_tags, ignore_index, "logits")
    inv_t = _inv_temperature(temperature, lead, logits.device, checks.stat_dtype(logits))
    logprob, entropy, _ = _selected_logprob_fwd(flat_logits, flat_targets, inv_t, ignore_index, return_entropy)
    if return_entropy:
        return logprob.view(lead), entropy.view(lead)
    return logprob.view(lead)


# ---------------------------------------------------------------------------
# linear_logprob
# ---------------------------------------------------------------------------


def _linear_bwd_outputs(hidden: Tensor, weight: Tensor, *inputs) -> tuple[Tensor, Tensor]:
    """``(grad_hidden, grad_weight)``, each a placeholder when not needed; ``inputs``: the backward's other inputs,
    ``need_grad_hidden`` and ``need_grad_weight`` last."""
    need_grad_hidden, need_grad_weight = inputs[-2:]
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else custom_op.placeholder(hidden)
    grad_weight = torch.empty_like(weight) if need_grad_weight else custom_op.placeholder(weight)
    return grad_hidden, grad_weight


linear_logprob_op = custom_op.declare("linear_logprob")


@linear_logprob_op.forward(outputs=_fwd_outputs)
def _linear_logprob_fwd(
    primitive,
    out,
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    inv_temperature: Tensor,
    ignore_index: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    logprob, entropy, lse = out
    if hidden.shape[0] == 0:
        return
    _check_values(targets, inv_temperature, weight.shape[0], ignore_index)
    primitive(hidden, weight, targets, inv_temperature, ignore_index, logprob, entropy if with_entropy else None, lse)


@linear_logprob_op.backward_primitive(outputs=_linear_bwd_outputs)
def _linear_logprob_bwd(
    primitive,
    out,
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    inv_temperature: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    grad_logprob: Tensor,
    grad_entropy: Tensor | None,
    ignore_index: int,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[Tensor, Tensor]:
    grad_hidden, grad_weight = out
    if hidden.shape[0] == 0:
        grad_weight.zero_()
        return
    if need_grad_hidden or need_grad_weight:
        primitive(
            hidden,
            weight,
            targets,
            inv_temperature,
            lse,
            entropy,
            grad_logprob,
            grad_entropy,
            ignore_index,
            grad_hidden if need_grad_hidden else None,
            grad_weight if need_grad_weight else None,
        )


def _save_linear(ctx, inputs, output):
    _, entropy, lse = output
    ctx.save_for_backward(inputs.hidden, inputs.weight, inputs.targets, inputs.inv_temperature, lse, entropy)
    ctx.ignore_index = inputs.ignore_index
    ctx.with_entropy = inputs.with_entropy


def _backward_linear(ctx, grad_logprob, grad_entropy, grad_lse):
    hidden, weight, targets, inv_temperature, lse, entropy = ctx.saved_tensors
    grad_logprob, grad_entropy = _backward_grads(ctx, grad_logprob, grad_entropy, hidden)
    if ctx.needs_input_grad[1]:
        # grad_weight = G^T @ hidden with G = 0 on ignored rows: zero their hidden states too, so that NaN or inf
        # there (padding) never reaches the weight's gradient as 0 * NaN.
        hidden = torch.where((targets != ctx.ignore_index)[:, None], hidden, hidden.new_zeros(()))
    grad_hidden, grad_weight = linear_logprob_op.backward(
        ctx,
        hidden,
        weight,
        targets,
        inv_temperature,
        lse,
        entropy if grad_entropy is not None else None,
        grad_logprob,
        grad_entropy,
        ctx.ignore_index,
        ctx.needs_input_grad[0],
        ctx.needs_input_grad[1],
    )
    return {
        "hidden": grad_hidden if ctx.needs_input_grad[0] else None,
        "weight": grad_weight if ctx.needs_input_grad[1] else None,
    }


linear_logprob_op.autograd(save=_save_linear, backward=_backward_linear)


def linear_logprob(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float | Tensor = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    loss_spans: Tensor | None = None,
    span_tags: int | tuple[int, ...] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Target log-prob (and entropy) of ``hidden @ weight.T`` without materializing the logits.

    Same outputs as ``selected_logprob(hidden @ weight.T, targets, ...)``, but the
    ``[N, V]`` logits never exist: the forward streams vocab tiles through an
    online logsumexp/entropy accumulator and saves only fp32 per-row state
    (``lse``); the backward recomputes logit tiles and returns ``grad_hidden``
    and ``grad_weight`` (fp32 accumulation, cast to the input dtype at the end),
    including the entropy gradient. Extra memory is O(N + tile), never O(N*V). With
    ``RLK_TRITON_LM_HEAD=tiled`` the Triton backend runs its cuBLAS-tiled path instead (opt-in;
    :mod:`rlk_triton.lm_head`): fp32 logits per chunk of 2048 rows, extra memory O(chunk * V + N * H); the forward
    alone and with its backward give the same bits there too.

    Args:
        hidden: ``[..., H]`` bfloat16, float16 or float32 (the last hidden states).
        weight: ``[V, H]`` of the same dtype (the LM head).
        targets: ``[...]`` int32 or int64, values in ``[0, V)`` or ``ignore_index``.
        temperature, ignore_index, return_entropy, loss_spans, span_tags: as in :func:`selected_logprob`. A
            ``loss_spans`` table on the CPU (the host's copy, as data loaders build it) computes the scored rows only:
            they are packed (``rlk.pack``'s slot primitives, their number counted on the host: no synchronization),
            scored and unpacked, 0 elsewhere, so the work follows the scored tokens, not ``B * T``. A table on the
            device masks the rows in place (every row computed); so does a host table while a pinned backend
            (``rlk.use_backend``) does not serve ``pack``, as rlk-cuda and rlk-rocm do not. Both give each row the
            same bits on batch-invariant backends; the weight's gradient sums the same nonzero rows in another
            grouping (equal up to rounding). Under ``torch.compile`` a host table masks in place too: the number of
            packed rows is read on the host, which a traced graph cannot do (``fullgraph=True`` holds).

    Returns:
        fp32 ``logprob`` (and ``entropy``) of shape ``targets.shape``,
        differentiable w.r.t. ``hidden`` and ``weight``.
    """
    flat_hidden, weight, flat_targets, inv_t, ignore_index = linear_inputs(
        hidden, weight, targets, temperature, ignore_index
    )
    return_entropy = checks.flag("return_entropy", return_entropy)
    lead = hidden.shape[:-1]
    # the packed rows' number is read on the host: a traced graph cannot (torch.compile masks in place instead)
    on_host = isinstance(loss_spans, Tensor) and loss_spans.device.type == "cpu" and not torch.compiler.is_compiling()
    if on_host and _pack_served(hidden.device, (flat_hidden.dtype, flat_targets.dtype, inv_t.dtype)):
        logprob, entropy = _linear_logprob_scored_rows(
            flat_hidden, weight, flat_targets, inv_t, ignore_index, return_entropy, loss_spans, span_tags, lead
        )
    else:
        if loss_spans is not None or span_tags is not None:
            flat_targets = _scored(targets, loss_spans, span_tags, ignore_index, "hidden")
        logprob, entropy, _ = _linear_logprob_fwd(
            flat_hidden, weight, flat_targets, inv_t, ignore_index, return_entropy
        )
    if return_entropy:
        return logprob.view(lead), entropy.view(lead)
    return logprob.view(lead)


def _pack_served(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether the backend selection of the moment (a pin included) runs ``pack`` on ``device`` for each dtype."""
    return all(dispatch.decide("pack", device, dtype).backend is not None for dtype in set(dtypes))


def _linear_logprob_scored_rows(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    inv_t: Tensor,
    ignore_index: int,
    with_entropy: bool,
    loss_spans: Tensor,
    span_tags,
    lead: torch.Size,
) -> tuple[Tensor, Tensor]:
    """:func:`linear_logprob` on the scored rows only (a host span table): the rows the spans cover are packed by
    ``rlk.pack``'s slot primitives (the count known on the host: no synchronization), scored, and unpacked with 0
    elsewhere; the gradients run back through the same primitives (0 on the unscored rows)."""
    slot, count = spans.scored_slots(loss_spans, span_tags, tuple(lead), hidden.device)  # checks lead is [B, T]
    rows = _pack_fwd(hidden, slot, count)
    row_targets = _pack_fwd(targets[:, None], slot, count)[:, 0]
    row_inv_t = _pack_fwd(inv_t[:, None], slot, count)[:, 0]
    logprob, entropy, _ = _linear_logprob_fwd(rows, weight, row_targets, row_inv_t, ignore_index, with_entropy)
    logprob = _unpack_fwd(logprob[:, None], slot, 0.0)[:, 0]
    return logprob, _unpack_fwd(entropy[:, None], slot, 0.0)[:, 0] if with_entropy else entropy


def _scored(targets: Tensor, loss_spans, span_tags, ignore_index: int, lead_name: str) -> Tensor:
    """Flat int64 ``targets`` with ``ignore_index`` outside ``loss_spans`` (targets checked already)."""
    spans.no_tags_without_spans(loss_spans, span_tags)
    flat = targets.reshape(-1).to(torch.int64)
    if loss_spans is not None:
        scored = spans.loss_mask(loss_spans, span_tags, tuple(targets.shape), targets.device, f"targets ({lead_name})")
        flat = torch.where(scored.reshape(-1), flat, ignore_index)
    return flat.contiguous()


def linear_inputs(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float | Tensor, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """:func:`linear_logprob`'s argument checks (errors name the argument) and its primitives' inputs:
    ``hidden`` as ``[N, H]``, ``weight`` contiguous, ``targets`` int64 ``[N]``, ``inv_temperature`` ``[N]``
    (fp32; fp64 for fp64 inputs) and ``ignore_index`` as an int."""
    check_float("hidden", hidden)
    check_float("weight", weight)
    if hidden.dim() < 1 or hidden.shape[-1] == 0:
        raise ValueError(f"hidden: expected shape [..., H] with H >= 1, got {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight: expected shape [V, H] with V >= 1 and H = {hidden.shape[-1]} "
            f"(hidden's last dim), got {tuple(weight.shape)}"
        )
    checks.same_dtype(("hidden", hidden), ("weight", weight), exact=True)
    if weight.device != hidden.device:
        raise ValueError(f"weight: expected device {hidden.device} (the device of hidden), got {weight.device}")
    ignore_index = checks.integer("ignore_index", ignore_index)
    lead = hidden.shape[:-1]
    _check_targets(targets, lead, "hidden", hidden.device)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    flat_targets = targets.reshape(-1).to(torch.int64).contiguous()
    inv_t = _inv_temperature(temperature, lead, hidden.device, checks.stat_dtype(hidden))
    return flat_hidden, weight.contiguous(), flat_targets, inv_t, ignore_index


def check_target_values(targets: Tensor, inv_temperature: Tensor, vocab: int, ignore_index: int) -> None:
    """The value checks of :func:`linear_logprob`'s forward (targets in range, temperatures > 0): one host
    synchronization, skipped with ``RLK_CHECK_VALUES=0``. For ops that run its primitives themselves."""
    _check_values(targets, inv_temperature, vocab, ignore_index)
