"""ROCm primitives of ``selected_logprob`` (kernels: rlk-cuda's ``csrc/logprob.cuh``, shared through
``portable.cuh``; launchers: ``csrc/logprob.hip``) and ``linear_logprob`` (kernels: rlk-cuda's
``csrc/linear_logprob.cuh`` over the MFMA core ``csrc/mma_amd.cuh``; launchers: rlk-cuda's
``csrc/linear_logprob_launchers.h``, compiled by ``csrc/linear_logprob.hip``).

The math is the spec in :mod:`rlk.reference.logprob`; the kernels are rlk-cuda's (see :mod:`rlk_cuda.logprob`).

``selected_logprob``: one workgroup of 256 threads (four 64-lane wavefronts) per row, online max / sum-exp over
16-byte packs, the backward recomputing ``p`` from the saved lse. Batch-invariant: the thread map and every reduction
order depend on V and the dtype only; no atomics.

``linear_logprob`` (float16 / bfloat16 only; float32 is declined by the backend's ``supports`` and falls through to
triton): the logits ``hidden @ weight.T`` are never materialized. Per row, with ``z = (hidden @ weight.T)[n, v] *
inv_t`` (one rounded fp32 multiply)::

    lse = logsumexp_v z,   logprob = z_target - lse,   entropy = lse - sum_v p_v z_v,   p = softmax(z)
    G = inv_t * (g_lp * (onehot - p) + g_ent * p * (lse - entropy - z)),   grad_hidden = G @ W,   grad_weight = G.T @ h

Forward: workgroups of 128 rows x one vocab split of 4096 columns, 128 x 128 logit tiles from MFMA
(``v_mfma_f32_32x32x8``, fp32 accumulation, K in steps of 32 through two LDS stages), an online (max, sum-exp,
weighted sum) state per row, merged over the 2 lanes and the 2 wavefronts that hold a row in a fixed order, the
splits merged in split order. Backward, per vocab chunk of 4096 columns in order: G recomputed into a scratch buffer,
``grad_hidden += G @ W_c`` (fp32 scratch accumulator), ``grad_weight[c] = G.T @ hidden`` (the sum over all rows in
32-row steps, in order). The same kernel bodies as rlk-cuda's mma.sync path, on another accumulator layout: rocm's
bits are its own (deterministic and batch-invariant), not cuda's. Scratch comes from torch here:

* forward: fp32 ``[2 or 3, ceil(V / 4096), N]`` split partials plus ``[N]`` target logits;
* backward: ``[N, min(4096, V rounded up to 128)]`` of the input dtype (G of one chunk) plus, when ``V > 4096`` and
  ``grad_hidden`` is wanted, an fp32 ``[N, H]`` accumulator.

The kernels need ``H % 8 == 0`` and 16-byte aligned hidden / weight / gradient buffers (16-byte vector loads).
Other inputs are copied into zero-padded aligned buffers first (the extra zero columns add exact zeros: the same
results, at the cost of a copy). These helpers mirror rlk_cuda/logprob.py's on purpose: the two distributions are
installed without each other.
"""

from __future__ import annotations

import torch

from rlk_rocm._native import C, array, on_device, stream_of


def selected_logprob_fwd(logits, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
    """Fill ``logprob_out``, ``entropy_out`` (when not None) and ``lse_out``.

    Args:
        logits: ``[N, V]`` fp32 / fp16 / bf16, contiguous, on an AMD GPU.
        targets: ``[N]`` int64, in ``[0, V)`` or ``ignore_index``.
        inv_temperature: ``[N]`` fp32, ``1 / T`` per row.
        ignore_index: rows with this target give 0.
        logprob_out, entropy_out (or None), lse_out: ``[N]`` fp32.
    """
    with on_device(logits):
        C.selected_logprob_fwd(
            array(logits),
            array(targets),
            array(inv_temperature),
            int(ignore_index),
            array(logprob_out),
            array(entropy_out),
            array(lse_out),
            stream_of(logits),
        )


def selected_logprob_bwd(
    logits, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, ignore_index, grad_logits_out
):
    """Fill ``grad_logits_out`` (``[N, V]``, logits' dtype) with the gradient of the logits.

    ``entropy`` and ``grad_entropy`` (``[N]`` fp32) are used together: the entropy term is present when
    ``grad_entropy`` is given, and then needs ``entropy``; ``lse`` and ``grad_logprob`` are ``[N]`` fp32.
    """
    if grad_entropy is None:
        entropy = None
    elif entropy is None:
        raise ValueError("entropy: required when grad_entropy is given (the forward's entropy output)")
    with on_device(logits):
        C.selected_logprob_bwd(
            array(logits),
            array(targets),
            array(inv_temperature),
            array(lse),
            array(entropy),
            array(grad_logprob),
            array(grad_entropy),
            int(ignore_index),
            array(grad_logits_out),
            stream_of(logits),
        )


# ---- linear_logprob --------------------------------------------------------------------------------


def _aligned(t: torch.Tensor | None) -> bool:
    return t is None or t.data_ptr() % 16 == 0


def _padded(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` ([rows, H]) as a fresh, 16-byte aligned ``[rows, width]`` tensor, zeros past column H."""
    out = torch.zeros((t.shape[0], width), dtype=t.dtype, device=t.device)
    out[:, : t.shape[1]] = t
    return out


def _kernel_layout(hidden, weight, *grads) -> int | None:
    """None if the kernels can take ``hidden``, ``weight`` and the gradient buffers as they are, else the padded
    hidden size (H rounded up to 8) to copy them into."""
    h = hidden.shape[1]
    if h % 8 == 0 and all(_aligned(t) for t in (hidden, weight, *grads)):
        return None
    return -(-h // 8) * 8


def _check_half(hidden) -> None:
    if hidden.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"rlk_rocm linear_logprob: dtype {hidden.dtype} not implemented (float16, bfloat16); the "
            f"dispatcher sends float32 to the next backend"
        )


def linear_logprob_fwd(hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
    """Fill ``logprob_out``, ``entropy_out`` (when not None) and ``lse_out`` for ``logits = hidden @ weight.T``.

    Args:
        hidden: ``[N, H]`` float16 / bfloat16, contiguous, on an AMD GPU.
        weight: ``[V, H]``, hidden's dtype, contiguous.
        targets: ``[N]`` int64, in ``[0, V)`` or ``ignore_index``.
        inv_temperature: ``[N]`` fp32, ``1 / T`` per row.
        ignore_index: rows with this target give 0 (logprob, entropy and lse).
        logprob_out, entropy_out (or None), lse_out: ``[N]`` fp32.
    """
    _check_half(hidden)
    n = hidden.shape[0]
    width = _kernel_layout(hidden, weight)
    if width is not None:
        hidden, weight = _padded(hidden, width), _padded(weight, width)
    splits = C.linear_logprob_num_splits(weight.shape[0])
    with_entropy = entropy_out is not None
    part = torch.empty((3 if with_entropy else 2, splits, n), dtype=torch.float32, device=hidden.device)
    z_target = torch.empty((n,), dtype=torch.float32, device=hidden.device)
    with on_device(hidden):
        C.linear_logprob_fwd(
            array(hidden),
            array(weight),
            array(targets),
            array(inv_temperature),
            int(ignore_index),
            array(logprob_out),
            array(entropy_out),
            array(lse_out),
            part[0],
            part[1],
            part[2] if with_entropy else None,
            z_target,
            stream_of(hidden),
        )


def linear_logprob_bwd(
    hidden,
    weight,
    targets,
    inv_temperature,
    lse,
    entropy,
    grad_logprob,
    grad_entropy,
    ignore_index,
    grad_hidden_out,
    grad_weight_out,
):
    """Fill ``grad_hidden_out`` (``[N, H]``) and ``grad_weight_out`` (``[V, H]``), each optional (None: not computed).

    ``lse``, ``grad_logprob`` are ``[N]`` fp32; ``entropy`` and ``grad_entropy`` (``[N]`` fp32) are used together:
    the entropy term is present when ``grad_entropy`` is given, and then needs the forward's ``entropy``.
    Gradients are accumulated in fp32 and stored in the inputs' dtype.
    """
    _check_half(hidden)
    if grad_hidden_out is None and grad_weight_out is None:
        return
    if grad_entropy is None:
        entropy = None
    elif entropy is None:
        raise ValueError("entropy: required when grad_entropy is given (the forward's entropy output)")
    n, h = hidden.shape
    vocab = weight.shape[0]
    width = _kernel_layout(hidden, weight, grad_hidden_out, grad_weight_out)
    gh, gw = grad_hidden_out, grad_weight_out
    if width is not None:
        hidden, weight = _padded(hidden, width), _padded(weight, width)
        gh = None if gh is None else torch.empty((n, width), dtype=hidden.dtype, device=hidden.device)
        gw = None if gw is None else torch.empty((vocab, width), dtype=gw.dtype, device=gw.device)
    g_scratch = torch.empty((n, C.linear_logprob_bwd_chunk_cols(vocab)), dtype=hidden.dtype, device=hidden.device)
    acc = None
    if gh is not None and C.linear_logprob_bwd_num_chunks(vocab) > 1:
        acc = torch.empty((n, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    with on_device(hidden):
        C.linear_logprob_bwd(
            array(hidden),
            array(weight),
            array(targets),
            array(inv_temperature),
            array(lse),
            array(entropy),
            array(grad_logprob),
            array(grad_entropy),
            int(ignore_index),
            array(gh),
            array(gw),
            g_scratch,
            acc,
            stream_of(hidden),
        )
    if width is not None:
        if grad_hidden_out is not None:
            grad_hidden_out.copy_(gh[:, :h])
        if grad_weight_out is not None:
            grad_weight_out.copy_(gw[:, :h])
