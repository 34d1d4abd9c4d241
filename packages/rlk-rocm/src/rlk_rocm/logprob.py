"""ROCm primitives of ``selected_logprob`` (kernels: rlk-cuda's ``csrc/logprob.cuh``, shared through
``portable.cuh``; launchers: ``csrc/logprob.hip``).

The math is the spec in :mod:`rlk.reference.logprob`; the kernels are rlk-cuda's (see :mod:`rlk_cuda.logprob`):
one workgroup of 256 threads (four 64-lane wavefronts) per row, online max / sum-exp over 16-byte packs, the
backward recomputing ``p`` from the saved lse. Batch-invariant: the thread map and every reduction order depend
on V and the dtype only; no atomics.
"""

from __future__ import annotations

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
