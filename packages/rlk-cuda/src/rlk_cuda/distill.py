"""CUDA primitives of ``fused_linear_kl`` (kernels: ``csrc/distill.cu``; Hopper only, float16 / bfloat16).

Spec: :mod:`rlk.reference.distill`. Per vocab chunk of 4096 columns, in order, both models' scaled logits are
computed by the Hopper tile GEMM of ``linear_logprob`` into two fp32 ``[N, 4096]`` buffers, then a block per row
folds them into the row's online state (forward / reverse KL: one pass; the JSD: a second pass for its sums, after
both logsumexps). The gradient recomputes each chunk's logits, forms ``G`` per row (written over the student's
buffer) and runs ``linear_logprob``'s Hopper GEMMs 2 and 3: ``grad_hidden += G @ W_s[c]`` (fp32 accumulator),
``grad_weight[c] = G.T @ h_s``. Scratch from torch: the two logit buffers (``2 * N * 4096 * 4`` bytes), a
``[5, N]`` state and, for ``grad_hidden`` with ``V > 4096``, an fp32 ``[N, Hs]`` accumulator.

Batch invariance and determinism: fixed tiles and chunks, per-row reductions in a fixed order, no atomics (the
module header of ``csrc/distill.cu``). Where the Hopper kernels cannot run (:func:`problem`) the backend's
``supports`` declines the op and it falls through to triton.
"""

from __future__ import annotations

import torch

from rlk_cuda._native import C, array, on_device, stream_of
from rlk_cuda.logprob import _check_half, _copy_back, _grad_layout, _kernel_layout, _padded, wgmma_problem

#: The kernels' divergence codes.
_DIVERGENCE = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}


def problem(device) -> str | None:
    """None if the ``fused_linear_kl`` kernels serve CUDA ``device``, else why not (Hopper kernels only)."""
    reason = wgmma_problem(device)
    return None if reason is None else f"fused_linear_kl: Hopper kernels only ({reason})"


def _require(device) -> None:
    reason = problem(device)
    if reason is not None:
        raise RuntimeError(f"rlk_cuda {reason}")


def _operands(hidden, weight):
    """``hidden``, ``weight`` as the kernels take them (zero-padded copies where H % 8 != 0 or misaligned)."""
    width = _kernel_layout(hidden, weight)
    if width is None:
        return hidden, weight
    return _padded(hidden, width), _padded(weight, width)


def _scratch(n_rows: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    cols = C.linear_logprob_bwd_chunk_cols(vocab)
    return (
        torch.empty((n_rows, cols), dtype=torch.float32, device=device),
        torch.empty((n_rows, cols), dtype=torch.float32, device=device),
    )


def _gradients(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    targets,
    inv_temperature,
    stats,
    coef,
    ignore_index,
    divergence,
    beta,
    grad_hidden_out,
    grad_weight_out,
    scratch=None,
):
    if grad_hidden_out is None and grad_weight_out is None:
        return
    n, hs = student_hidden.shape
    vocab = student_weight.shape[0]
    width, sh, sw, gh, gw = _grad_layout(student_hidden, student_weight, grad_hidden_out, grad_weight_out)
    th, tw = _operands(teacher_hidden, teacher_weight)
    zq, zp = scratch if scratch is not None else _scratch(n, vocab, sh.device)
    acc = None
    if gh is not None and C.linear_logprob_bwd_num_chunks(vocab) > 1:
        acc = torch.empty((n, sh.shape[1]), dtype=torch.float32, device=sh.device)
    with on_device(sh):
        C.fused_linear_kl_grad_wgmma(
            array(sh),
            array(sw),
            array(th),
            array(tw),
            array(targets),
            array(inv_temperature),
            array(stats),
            array(coef.to(torch.float32).contiguous()),
            int(ignore_index),
            _DIVERGENCE[divergence],
            float(beta),
            array(gh),
            array(gw),
            zq,
            zp,
            acc,
            stream_of(sh),
        )
    _copy_back(width, hs, grad_hidden_out, grad_weight_out, gh, gw)


def fused_linear_kl_fwd(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    targets,
    inv_temperature,
    ignore_index,
    divergence,
    beta,
    loss_out,
    stats_out,
    grad_coef,
    grad_hidden_out,
    grad_weight_out,
):
    """Per-row divergence ``loss_out`` (``[N]`` fp32, 0 on ignored rows) and ``stats_out`` (``[3, N]`` fp32: the
    student's and the teacher's lse, the gradient's row constant); with ``grad_coef`` (``[N]``) also the gradients
    of ``sum_i grad_coef_i loss_i`` into ``grad_hidden_out`` / ``grad_weight_out`` (either may be None).

    Inputs: ``student_hidden`` ``[N, Hs]`` and ``student_weight`` ``[V, Hs]``, ``teacher_hidden`` ``[N, Ht]`` and
    ``teacher_weight`` ``[V, Ht]``, one 16-bit dtype; ``targets`` ``[N]`` int64 or None (only compared with
    ``ignore_index``); ``inv_temperature`` ``[N]`` fp32; ``divergence`` ``"forward_kl"``, ``"reverse_kl"`` or
    ``"jsd"`` (``0 < beta < 1``). Spec: :func:`rlk.reference.distill.fused_linear_kl_fwd`.
    """
    _check_half(student_hidden)
    _require(student_hidden.device)
    n = student_hidden.shape[0]
    vocab = student_weight.shape[0]
    sh, sw = _operands(student_hidden, student_weight)
    th, tw = _operands(teacher_hidden, teacher_weight)
    zq, zp = _scratch(n, vocab, sh.device)
    state = torch.empty((5, n), dtype=torch.float32, device=sh.device)
    with on_device(sh):
        C.fused_linear_kl_fwd_wgmma(
            array(sh),
            array(sw),
            array(th),
            array(tw),
            array(targets),
            array(inv_temperature),
            int(ignore_index),
            _DIVERGENCE[divergence],
            float(beta),
            array(loss_out),
            array(stats_out),
            zq,
            zp,
            state,
            stream_of(sh),
        )
    if grad_coef is not None:
        _gradients(
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            targets,
            inv_temperature,
            stats_out,
            grad_coef,
            ignore_index,
            divergence,
            beta,
            grad_hidden_out,
            grad_weight_out,
            (zq, zp),
        )


def fused_linear_kl_bwd(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    targets,
    inv_temperature,
    stats,
    grad_loss,
    ignore_index,
    divergence,
    beta,
    grad_hidden_out,
    grad_weight_out,
):
    """Gradients of ``sum_i grad_loss_i loss_i`` (``grad_loss`` ``[N]`` fp32) from the forward's ``stats``, logits
    recomputed. Spec: :func:`rlk.reference.distill.fused_linear_kl_bwd`."""
    _check_half(student_hidden)
    _require(student_hidden.device)
    _gradients(
        student_hidden,
        student_weight,
        teacher_hidden,
        teacher_weight,
        targets,
        inv_temperature,
        stats,
        grad_loss,
        ignore_index,
        divergence,
        beta,
        grad_hidden_out,
        grad_weight_out,
    )
