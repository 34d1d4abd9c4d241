"""CUDA primitives of ``selected_logprob`` (kernels: ``csrc/logprob.cuh``) and ``linear_logprob``
(kernels: ``csrc/linear_logprob.cuh``, tensor-core GEMM core ``csrc/mma.cuh``).

The math is the spec in :mod:`rlk.reference.logprob`. Per row, ``z = logits * inv_temperature``
(one fp32 multiply)::

    lse = logsumexp(z),   logprob = z_target - lse,   entropy = lse - sum_v softmax(z)_v z_v
    grad_logits = inv_t * (g_lp * (onehot - p) + g_ent * p * (lse - entropy - z)),   p = exp(z - lse)

One block of 256 threads per row; the forward reads the logits once (online max / sum-exp over 16-byte
packs), the backward reads them once more and writes the gradient once. Rows whose target equals
``ignore_index`` are not read: their outputs (and their lse, which the ABI leaves unspecified) are 0.
fp32 logits use accurate ``expf``; bf16 / fp16 logits take kernels built for few instructions per element
(the max of 32 values per step on the packed 16-bit words, ``exp`` as one FMA plus one ``ex2.approx``
in log2 units; details in ``csrc/logprob.cuh``), and a variant without the element-wise load path where
every row starts 16-byte aligned (the same bits either way).

``linear_logprob`` (float16 / bfloat16 only; float32 is declined by the backend's ``supports`` and falls
through to triton): logits ``hidden @ weight.T`` are never materialized. Forward: blocks of 128 rows x one
vocab split of 4096 columns, tiles of 128 x 128 logits from mma.sync (fp32 accumulation, K loop in steps of
64), online (max, sum-exp, weighted sum) per row, splits merged in split order. Backward, per vocab chunk of
4096 columns in order: G = d loss / d logits recomputed into a scratch buffer, ``grad_hidden += G @ W_c``
(fp32 scratch accumulator), ``grad_weight[c] = G.T @ hidden``. Scratch comes from torch here:

* forward: fp32 ``[2 or 3, ceil(V / 4096), N]`` split partials plus ``[N]`` target logits;
* backward: ``[N, min(4096, V rounded up to 128)]`` of the input dtype (G of one chunk) plus, when
  ``V > 4096`` and ``grad_hidden`` is wanted, an fp32 ``[N, H]`` accumulator.

The kernels need ``H % 8 == 0`` and 16-byte aligned hidden / weight / gradient buffers (16-byte cp.async
rows). Other inputs (an odd ``H``, a view starting mid-allocation) are copied into zero-padded aligned
buffers first: the extra zero columns add exact zeros, so the results are the same, at the cost of a copy.

Hopper kernels (``csrc/linear_logprob_wgmma.cu``, sm_90a only): a forward with TMA loads + wgmma, one producer
and two consumer warpgroups, 128 x 256 x 64 tiles, the same vocab splits and combine; and a backward whose three
GEMMs per vocab chunk (G, ``G @ W_c``, ``G.T @ hidden``) run on a generic TMA + wgmma tile GEMM
(``csrc/wgmma_gemm.cuh``) with the same chunks, scratch and fixed summation orders. Where they can run (a
compute capability 9.0 GPU and a build with sm_90a kernels, :func:`wgmma_problem`) they are the default; the
environment variables ``RLK_CUDA_LINEAR_FWD`` and ``RLK_CUDA_LINEAR_BWD`` (``mma`` or ``wgmma``) choose per
direction, see :func:`forward_kernel` / :func:`backward_kernel`. Both kernels are batch-invariant and within the
contract; they are not bitwise equal to each other (different instruction and fold grouping).

``linear_logprob_stored_fwd`` / ``_bwd`` (``fused_linear_policy_loss``'s one-pass mode) run on the Hopper kernels
only (:func:`stored_problem`): the forward also stores the fp32 logits it folds; the backward computes G from them in
place and runs the backward's GEMMs 2 and 3 per vocab chunk.
"""

from __future__ import annotations

import functools
import os

import torch

from rlk_cuda._native import C, array, on_device, stream_of


def selected_logprob_fwd(logits, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
    """Fill ``logprob_out``, ``entropy_out`` (when not None) and ``lse_out``.

    Args:
        logits: ``[N, V]`` fp32 / fp16 / bf16, contiguous, on a CUDA device.
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
            f"rlk_cuda linear_logprob: dtype {hidden.dtype} not implemented (float16, bfloat16); the "
            f"dispatcher sends float32 to the next backend"
        )


#: Environment variables choosing the linear_logprob forward / backward kernels: unset or "" (the Hopper kernels
#: where :func:`wgmma_problem` is None, else mma.sync), "mma" (always mma.sync), "wgmma" (Hopper where it can run).
FORWARD_ENV = "RLK_CUDA_LINEAR_FWD"
BACKWARD_ENV = "RLK_CUDA_LINEAR_BWD"
_KERNEL_CHOICES = ("", "mma", "wgmma")


@functools.cache
def _wgmma_problem(index: int) -> str | None:
    return C.linear_logprob_wgmma_problem(index) or None


def wgmma_problem(device) -> str | None:
    """None if the Hopper (wgmma) kernels can run on CUDA ``device`` (sm_90a compiled in and a compute
    capability 9.0 GPU), else why not."""
    device = torch.device(device)
    return _wgmma_problem(torch.cuda.current_device() if device.index is None else device.index)


def _kernel(env: str, device) -> str:
    choice = os.environ.get(env, "")
    if choice not in _KERNEL_CHOICES:
        raise ValueError(f"{env}={choice!r}: expected one of 'mma', 'wgmma' (or unset)")
    if choice == "mma":
        return "mma"
    return "wgmma" if wgmma_problem(device) is None else "mma"


def forward_kernel(device) -> str:
    """The forward kernel :func:`linear_logprob_fwd` uses on ``device`` now: ``"wgmma"`` where it can run
    (:func:`wgmma_problem`) unless ``RLK_CUDA_LINEAR_FWD=mma``; else ``"mma"``."""
    return _kernel(FORWARD_ENV, device)


def backward_kernel(device) -> str:
    """The backward kernel :func:`linear_logprob_bwd` uses on ``device`` now: ``"wgmma"`` where it can run
    unless ``RLK_CUDA_LINEAR_BWD=mma``; else ``"mma"``."""
    return _kernel(BACKWARD_ENV, device)


def _require_wgmma(device, what: str) -> None:
    problem = wgmma_problem(device)
    if problem is not None:
        raise RuntimeError(f"rlk_cuda linear_logprob wgmma {what} unavailable: {problem}")


def _linear_fwd(
    native, hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out, *logits_out
):
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
        native(
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
            *logits_out,
            stream_of(hidden),
        )


def linear_logprob_fwd(hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
    """Fill ``logprob_out``, ``entropy_out`` (when not None) and ``lse_out`` for ``logits = hidden @ weight.T``.

    Args:
        hidden: ``[N, H]`` float16 / bfloat16, contiguous, on a CUDA device.
        weight: ``[V, H]``, hidden's dtype, contiguous.
        targets: ``[N]`` int64, in ``[0, V)`` or ``ignore_index``.
        inv_temperature: ``[N]`` fp32, ``1 / T`` per row.
        ignore_index: rows with this target give 0 (logprob, entropy and lse).
        logprob_out, entropy_out (or None), lse_out: ``[N]`` fp32.

    The kernel is :func:`forward_kernel`'s: the Hopper one where it can run, else the mma.sync one.
    """
    _check_half(hidden)
    native = C.linear_logprob_fwd_wgmma if forward_kernel(hidden.device) == "wgmma" else C.linear_logprob_fwd
    _linear_fwd(native, hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out)


def linear_logprob_fwd_mma(hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
    """:func:`linear_logprob_fwd` on the mma.sync kernel whatever ``RLK_CUDA_LINEAR_FWD`` says (tests, benchmarks)."""
    _linear_fwd(
        C.linear_logprob_fwd, hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out
    )


def linear_logprob_fwd_wgmma(hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
    """:func:`linear_logprob_fwd` on the Hopper kernel whatever ``RLK_CUDA_LINEAR_FWD`` says (tests, benchmarks).
    Raises RuntimeError where :func:`wgmma_problem` is not None."""
    _require_wgmma(hidden.device, "forward")
    _linear_fwd(
        C.linear_logprob_fwd_wgmma,
        hidden,
        weight,
        targets,
        inv_temperature,
        ignore_index,
        logprob_out,
        entropy_out,
        lse_out,
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
    Gradients are accumulated in fp32 and stored in the inputs' dtype. The kernel is :func:`backward_kernel`'s.
    """
    _check_half(hidden)
    native = C.linear_logprob_bwd_wgmma if backward_kernel(hidden.device) == "wgmma" else C.linear_logprob_bwd
    _linear_bwd(
        native,
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
    )


def linear_logprob_bwd_mma(
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
    """:func:`linear_logprob_bwd` on the mma.sync kernels whatever ``RLK_CUDA_LINEAR_BWD`` says (tests, benchmarks)."""
    _linear_bwd(
        C.linear_logprob_bwd,
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
    )


def linear_logprob_bwd_wgmma(
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
    """:func:`linear_logprob_bwd` on the Hopper kernels whatever ``RLK_CUDA_LINEAR_BWD`` says (tests, benchmarks).
    Raises RuntimeError where :func:`wgmma_problem` is not None."""
    _require_wgmma(hidden.device, "backward")
    _linear_bwd(
        C.linear_logprob_bwd_wgmma,
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
    )


def _entropy_arg(entropy, grad_entropy):
    """The forward's entropy where the backward uses it (with ``grad_entropy``), else None."""
    if grad_entropy is None:
        return None
    if entropy is None:
        raise ValueError("entropy: required when grad_entropy is given (the forward's entropy output)")
    return entropy


def _grad_layout(hidden, weight, grad_hidden_out, grad_weight_out, accumulate=False):
    """``(width, hidden, weight, gh, gw)``: the operands and gradient buffers the kernels take (``width`` None: the
    caller's own), else zero-padded copies of ``width`` columns (``gw`` holding ``grad_weight_out`` when the kernel
    adds to it)."""
    width = _kernel_layout(hidden, weight, grad_hidden_out, grad_weight_out)
    gh, gw = grad_hidden_out, grad_weight_out
    if width is not None:
        hidden, weight = _padded(hidden, width), _padded(weight, width)
        gh = None if gh is None else torch.empty((hidden.shape[0], width), dtype=hidden.dtype, device=hidden.device)
        if gw is not None:
            gw = (
                _padded(gw, width)
                if accumulate
                else torch.empty((weight.shape[0], width), dtype=gw.dtype, device=gw.device)
            )
    return width, hidden, weight, gh, gw


def _copy_back(width, h, grad_hidden_out, grad_weight_out, gh, gw) -> None:
    """The padded gradient buffers of :func:`_grad_layout` into the caller's (their first ``h`` columns)."""
    if width is not None:
        if grad_hidden_out is not None:
            grad_hidden_out.copy_(gh[:, :h])
        if grad_weight_out is not None:
            grad_weight_out.copy_(gw[:, :h])


def _linear_bwd(
    native,
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
    _check_half(hidden)
    if grad_hidden_out is None and grad_weight_out is None:
        return
    entropy = _entropy_arg(entropy, grad_entropy)
    n, h = hidden.shape
    vocab = weight.shape[0]
    width, hidden, weight, gh, gw = _grad_layout(hidden, weight, grad_hidden_out, grad_weight_out)
    g_scratch = torch.empty((n, C.linear_logprob_bwd_chunk_cols(vocab)), dtype=hidden.dtype, device=hidden.device)
    acc = None
    if gh is not None and C.linear_logprob_bwd_num_chunks(vocab) > 1:
        acc = torch.empty((n, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    with on_device(hidden):
        native(
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
    _copy_back(width, h, grad_hidden_out, grad_weight_out, gh, gw)


def stored_problem(device) -> str | None:
    """None if :func:`linear_logprob_stored_fwd` / ``_bwd`` serve CUDA ``device``, else why not: they exist for the
    Hopper forward only, and must give the bits of the forward :func:`linear_logprob_fwd` runs there."""
    problem = wgmma_problem(device)
    if problem is not None:
        return f"linear_logprob_stored: Hopper kernels only ({problem})"
    if forward_kernel(device) != "wgmma":
        return (
            f"linear_logprob_stored: {FORWARD_ENV}=mma selects the mma.sync forward, whose bits the stored "
            f"(Hopper) forward does not give"
        )
    return None


def linear_logprob_stored_fwd(
    hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out, logits_out
):
    """:func:`linear_logprob_fwd` on the Hopper kernel, which also stores the scaled logits it reduces.

    Args:
        hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out: as in
            :func:`linear_logprob_fwd`; the log-prob, entropy and lse are its bits (the same kernel, with a store
            of each folded ``z`` added).
        logits_out: ``[N, V]`` fp32, contiguous: ``z = (hidden @ weight.T) * inv_temperature`` as the kernel folds it.

    Spec: :func:`rlk.reference.logprob.linear_logprob_stored_fwd`. Raises RuntimeError where
    :func:`stored_problem` is not None (the backend's ``supports`` declines those devices first).
    """
    problem = stored_problem(hidden.device)
    if problem is not None:
        raise RuntimeError(f"rlk_cuda {problem}")
    if not logits_out.is_contiguous():
        raise ValueError(f"logits_out: expected a contiguous [N, V] fp32 tensor, got strides {logits_out.stride()}")
    _linear_fwd(
        C.linear_logprob_stored_fwd_wgmma,
        hidden,
        weight,
        targets,
        inv_temperature,
        ignore_index,
        logprob_out,
        entropy_out,
        lse_out,
        logits_out,
    )


def linear_logprob_stored_bwd(
    hidden,
    weight,
    targets,
    inv_temperature,
    lse,
    entropy,
    grad_logprob,
    grad_entropy,
    ignore_index,
    logits,
    grad_hidden_out,
    grad_weight_out,
    accumulate,
):
    """:func:`linear_logprob_bwd` from the forward's stored logits (:func:`linear_logprob_stored_fwd`).

    Args:
        hidden, weight, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, ignore_index: as in
            :func:`linear_logprob_bwd`.
        logits: ``[N, V]`` fp32, contiguous, the forward's ``logits_out``; spent: ``G = d loss / d z`` is written
            over it in ``hidden.dtype`` (the first half of each row's bytes) when its row stride is a multiple of 4
            elements and it is 16-byte aligned, else into a padded copy.
        grad_hidden_out: ``[N, H]`` in ``hidden.dtype`` or None: ``G @ weight``, summed over the vocab chunks of 4096
            in order (fp32), rounded once.
        grad_weight_out: ``[V, H]`` or None: ``G.T @ hidden`` in ``weight.dtype`` or fp32, or with ``accumulate``
            (fp32 only) ``grad_weight_out + G.T @ hidden``; rows summed in 64-row steps in order (deterministic).

    Spec: :func:`rlk.reference.logprob.linear_logprob_stored_bwd`. One kernel for ``G`` (a block per row), then
    :func:`linear_logprob_bwd`'s Hopper GEMMs 2 and 3 per vocab chunk. Each row's ``grad_hidden`` depends on that
    row only (batch-invariant).
    """
    problem = stored_problem(hidden.device)
    if problem is not None:
        raise RuntimeError(f"rlk_cuda {problem}")
    _check_half(hidden)
    entropy = _entropy_arg(entropy, grad_entropy)
    if accumulate and (grad_weight_out is None or grad_weight_out.dtype != torch.float32):
        raise ValueError("accumulate: needs an fp32 grad_weight_out")
    if grad_hidden_out is None and grad_weight_out is None:
        return
    n, h = hidden.shape
    vocab = weight.shape[0]
    width, hidden, weight, gh, gw = _grad_layout(hidden, weight, grad_hidden_out, grad_weight_out, accumulate)
    if not (logits.is_contiguous() and vocab % 4 == 0 and _aligned(logits)):
        padded = torch.empty((n, -(-vocab // 4) * 4), dtype=torch.float32, device=logits.device)
        padded[:, :vocab] = logits
        logits = padded
    acc = None
    if gh is not None and C.linear_logprob_bwd_num_chunks(vocab) > 1:
        acc = torch.empty((n, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    with on_device(hidden):
        C.linear_logprob_stored_bwd_wgmma(
            array(hidden),
            array(weight),
            array(targets),
            array(inv_temperature),
            array(lse),
            array(entropy),
            array(grad_logprob),
            array(grad_entropy),
            int(ignore_index),
            array(logits),
            array(gh),
            array(gw),
            bool(accumulate),
            acc,
            stream_of(hidden),
        )
    _copy_back(width, h, grad_hidden_out, grad_weight_out, gh, gw)
