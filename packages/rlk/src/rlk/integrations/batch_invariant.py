"""The batch-invariant mode: route the aten ops of an LLM forward and backward to rlk's kernels.

Inside ``with rlk.batch_invariant():`` (or between :func:`enable_batch_invariant` and
:func:`disable_batch_invariant`) the aten kernels below are overridden, through
``torch.library.Library("aten", "IMPL")``, by kernels that call the ABI primitives of a backend that
promises batch invariance (``Backend.batch_invariant``; the triton backend). A row's (token's,
sequence's) results then do not depend on the other rows of the batch: the same sequence gives
bitwise the same logits, and the same per-row gradients, alone or batched, padded or packed.

Overridden (the override keeps the stock kernel and calls it for every case it does not handle):

========================================== ===============================================================
aten op                                    served by
========================================== ===============================================================
``mm``, ``bmm``                            ``matmul_fwd`` (``bmm``: one call per batch entry)
``addmm``                                  ``matmul_fwd`` with the bias fused (1-D bias, beta = alpha = 1),
                                           else the invariant product then elementwise ``beta``/``alpha``
``_softmax``, ``_log_softmax``             ``softmax_fwd`` (any dim: moved last; ``half_to_float``: fp32)
``_softmax_backward_data``, ``_log_..``    ``softmax_bwd``
``mean.dim``                               ``matmul_fwd`` of the fp32 rows against a ones column, then / n
                                           (any dims: the reduced dims are moved last and flattened)
``_fused_rms_norm`` (+ ``_backward``)      ``rms_norm_fwd`` / ``rms_norm_bwd``
``embedding_dense_backward``               ``embedding_bwd`` (no atomics; not with ``scale_grad_by_freq``)
``convolution``                            ``matmul_fwd`` over the flattened patches (bias fused) when stride ==
                                           kernel, no padding, dilation 1, groups 1, not transposed: a patch
                                           embedding (ViT ``Conv2d``, Qwen2-VL ``Conv3d``); forward only (the
                                           stock ``convolution_backward`` serves the gradients)
``native_layer_norm``                      per row in fp32: mean and variance each summed by ``matmul_fwd``
                                           against a ones column, then ``(x - mean) * rstd * w + b``; weight
                                           and bias of the input's dtype; the stock backward uses its saved
                                           ``mean`` / ``rstd``
``_scaled_dot_product_flash_attention``    ``attention_fwd`` / ``attention_bwd`` on the varlen layout with
(+ ``_backward``), CUDA only               uniform ``cu_seqlens``; no dropout; causal only when Sq == Sk
``_scaled_dot_product_efficient_attention`` the same, when ``attn_bias`` is None (a mask: stock kernel and a
(+ ``_backward``), CUDA only               one-time warning that the call is not batch-invariant)
``_scaled_dot_product_cudnn_attention``    the same (torch's default SDPA kernel on Hopper); logsumexp
(+ ``_backward``), CUDA only               ``[B, H, Sq, 1]`` as cuDNN returns it
========================================== ===============================================================

An SDPA backward override serves only the saved state of an rlk forward (it recognizes the RNG-state tensor
rlk's forward returned); a forward that ran the stock kernel keeps the stock backward. Keep the mode on
from the forward through the backward.

Falls back to the stock kernel: other dtypes (integers, float64), empty tensors, mixed dtypes,
shapes an override does not cover, and any op while no batch-invariant backend serves the
inputs' device and dtype (for example ``RLK_BACKEND=reference``).

Dispatch keys: ``CUDA`` when CUDA is available, and ``CPU`` only when a batch-invariant backend serves
CPU tensors (the triton backend under ``TRITON_INTERPRET=1``: slow, for tests). Enabling with no
batch-invariant backend for any device raises :class:`rlk.BackendError` saying why.

With these two, a vision tower (patch embedding, LayerNorm blocks, merger) runs on rlk's kernels too; together
with :func:`rlk.patch_model` a vision-language model's prefill is batch-invariant (``docs/multimodal.md``).

Pointwise ops, reductions the model does not use, and kernels picked by ``torch.compile`` (inductor
lowers ``mm`` and ``softmax`` itself) are not covered: the mode is for eager execution. What the
overrides cannot reach in a Hugging Face model (RMSNorm written as ``pow/mean/rsqrt``, attention
masks) is handled by :func:`rlk.patch_model`.

Threads: the overrides are process-wide (the aten dispatcher is global): enabling the mode in one
thread changes the kernels every thread runs. Enabling and disabling are serialized by a lock. While a
thread serves an override it sets a thread-local guard, so every aten op rlk itself calls meanwhile
(allocation, copies, the torch ops inside a backend's launcher) runs the stock kernel.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from rlk.core import abi, dispatch
from rlk.core.backend import Backend
from rlk.core.dispatch import BackendError

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: A handler's answer meaning "not mine: run the stock kernel".
_FALLBACK = object()

_lock = threading.RLock()
_guard = threading.local()


class _State:
    explicit = False  # enable_batch_invariant() was called (and not undone)
    scopes = 0  # open ``with batch_invariant()`` blocks
    library: torch.library.Library | None = None


_state = _State()


# ---------------------------------------------------------------------------
# backend choice
# ---------------------------------------------------------------------------


#: ``_invariant_backend`` answers, per (op, device, dtype, pinned backend), while the mode is on (an aten op
#: of a model runs hundreds of times per forward); cleared whenever the overrides are registered or removed.
_backend_cache: dict[tuple, Backend | None] = {}


def _invariant_backend(op: str, device: torch.device, dtype: torch.dtype, **features: int) -> Backend | None:
    """The batch-invariant backend that serves ``op`` here (at sizes ``features``, see ``Backend.limits``): the
    pinned one, else the first of the device's chain, else any other installed one that serves the device (the
    triton backend on the CPU under ``TRITON_INTERPRET=1``, which the CPU chain does not list); None if none
    does (the caller then runs the stock kernel)."""
    key = (op, device, dtype, dispatch.pinned_backend(), tuple(sorted(features.items())))
    if key not in _backend_cache:
        _backend_cache[key] = _find_invariant_backend(op, device, dtype, features)
    return _backend_cache[key]


def _find_invariant_backend(
    op: str, device: torch.device, dtype: torch.dtype, features: dict[str, int]
) -> Backend | None:
    decision = dispatch.decide(op, device, dtype, features)
    statuses = dispatch.discover()
    chain = dispatch.chain_for(device)
    names = (decision.pinned,) if decision.pinned else (*chain, *sorted(set(statuses) - set(chain)))
    for name in names:
        status = statuses.get(name)
        if status is None or status.backend is None or not status.backend.batch_invariant:
            continue
        if dispatch.why_not(name, abi.OPS[op], device, dtype, features) is None:
            return status.backend
    return None


def _served_device_types() -> tuple[set[str], list[str]]:
    """Device types some batch-invariant backend serves now, and why each backend serves none."""
    served: set[str] = set()
    why: list[str] = []
    for name, status in dispatch.discover().items():
        if status.reason is not None or status.backend is None:
            why.append(f"{name}: unavailable: {status.reason or 'not loaded'}")
            continue
        if not status.backend.batch_invariant:
            why.append(f"{name}: does not promise batch invariance")
            continue
        types = set(status.backend.device_types()) & {"cuda", "cpu"}
        if "cuda" in types and not torch.cuda.is_available():
            types.discard("cuda")
        if not types:
            why.append(f"{name}: serves no CUDA or CPU device here")
        served |= types
    return served, why


# ---------------------------------------------------------------------------
# helpers for the handlers
# ---------------------------------------------------------------------------


def _is_float(*tensors: Tensor) -> bool:
    return all(t.dtype in _FLOAT_DTYPES for t in tensors) and len({t.dtype for t in tensors}) == 1


def _unit_stride(x: Tensor) -> Tensor:
    """``x`` if it is row-major or column-major (the matmul ABI accepts both), else a contiguous copy."""
    if x.stride(-1) == 1 or x.stride(-2) == 1:
        return x
    return x.contiguous()


def _rows(x: Tensor, dim: int) -> tuple[Tensor, torch.Size]:
    """``x`` with ``dim`` moved last, as contiguous ``[N, V]`` rows, and the moved shape."""
    moved = x.movedim(dim, -1)
    return moved.reshape(math.prod(moved.shape[:-1]), moved.shape[-1]).contiguous(), moved.shape


def _matmul_2d(a: Tensor, b: Tensor, bias: Tensor | None) -> Tensor | object:
    if a.dim() != 2 or b.dim() != 2 or not _is_float(a, b) or a.device != b.device:
        return _FALLBACK
    (m, k), n = a.shape, b.shape[1]
    if m == 0 or n == 0 or k == 0 or b.shape[0] != k:
        return _FALLBACK
    backend = _invariant_backend("matmul", a.device, a.dtype)
    if backend is None:
        return _FALLBACK
    out = a.new_empty((m, n))
    backend.primitives["matmul_fwd"](_unit_stride(a), _unit_stride(b), bias, out)
    return out


# ---------------------------------------------------------------------------
# handlers: same arguments as the aten op; return the result or _FALLBACK
# ---------------------------------------------------------------------------


def _mm(a, b):
    return _matmul_2d(a, b, None)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if not isinstance(bias, Tensor) or bias.dtype != a.dtype or bias.device != a.device:
        return _FALLBACK
    n = b.shape[1] if b.dim() == 2 else -1
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == n:
        return _matmul_2d(a, b, bias.contiguous())
    out = _matmul_2d(a, b, None)
    if out is _FALLBACK:
        return out
    if alpha != 1:
        out = out * alpha
    if beta != 0:  # beta == 0 ignores the bias (NaN included), as aten does
        out = out + (bias if beta == 1 else bias * beta)
    return out.contiguous()


def _bmm(a, b):
    if a.dim() != 3 or b.dim() != 3 or not _is_float(a, b) or a.device != b.device:
        return _FALLBACK
    (batch, m, k), n = a.shape, b.shape[2]
    if batch == 0 or m == 0 or n == 0 or k == 0 or b.shape[0] != batch or b.shape[1] != k:
        return _FALLBACK
    backend = _invariant_backend("matmul", a.device, a.dtype)
    if backend is None:
        return _FALLBACK
    out = a.new_empty((batch, m, n))
    matmul_fwd = backend.primitives["matmul_fwd"]
    for i in range(batch):
        matmul_fwd(_unit_stride(a[i]), _unit_stride(b[i]), None, out[i])
    return out


def _softmax_forward(x, dim, half_to_float, log):
    if x.dtype not in _FLOAT_DTYPES or x.dim() == 0 or x.numel() == 0:
        return _FALLBACK
    if half_to_float:
        x = x.float()
    backend = _invariant_backend("softmax", x.device, x.dtype)
    if backend is None:
        return _FALLBACK
    rows, moved_shape = _rows(x, dim)
    out = torch.empty_like(rows)
    backend.primitives["softmax_fwd"](rows, log, out)
    return out.view(moved_shape).movedim(-1, dim).contiguous()


def _softmax_backward(grad_output, output, dim, input_dtype, log):
    if output.dtype not in _FLOAT_DTYPES or output.dim() == 0 or output.numel() == 0:
        return _FALLBACK
    if grad_output.shape != output.shape or grad_output.device != output.device:
        return _FALLBACK
    backend = _invariant_backend("softmax", output.device, output.dtype)
    if backend is None:
        return _FALLBACK
    g_rows, moved_shape = _rows(grad_output.to(output.dtype), dim)
    y_rows, _ = _rows(output, dim)
    grad = torch.empty_like(y_rows)
    backend.primitives["softmax_bwd"](g_rows, y_rows, log, grad)
    return grad.view(moved_shape).movedim(-1, dim).contiguous().to(input_dtype)


def _log_softmax(x, dim, half_to_float):
    return _softmax_forward(x, dim, half_to_float, log=True)


def _softmax(x, dim, half_to_float):
    return _softmax_forward(x, dim, half_to_float, log=False)


def _log_softmax_backward_data(grad_output, output, dim, input_dtype):
    return _softmax_backward(grad_output, output, dim, input_dtype, log=True)


def _softmax_backward_data(grad_output, output, dim, input_dtype):
    return _softmax_backward(grad_output, output, dim, input_dtype, log=False)


def _mean_dim(x, dim=None, keepdim=False, *, dtype=None):
    """Mean over ``dim``: the reduced dims are moved last and flattened into rows of ``C`` elements;
    each row is summed in fp32 by ``matmul_fwd`` against a ones column (a ``K`` loop in fixed order),
    divided by ``C`` in fp32 and rounded once."""
    out_dtype = dtype if dtype is not None else x.dtype
    if x.dtype not in _FLOAT_DTYPES or out_dtype not in _FLOAT_DTYPES or x.dim() == 0:
        return _FALLBACK
    dims = sorted({d % x.dim() for d in dim}) if dim else list(range(x.dim()))
    kept = [d for d in range(x.dim()) if d not in dims]
    n_cols = math.prod(x.shape[d] for d in dims)
    n_rows = math.prod(x.shape[d] for d in kept)
    if n_cols == 0 or n_rows == 0:
        return _FALLBACK
    backend = _invariant_backend("matmul", x.device, torch.float32)
    if backend is None:
        return _FALLBACK
    rows = x.permute(*kept, *dims).reshape(n_rows, n_cols).to(torch.float32).contiguous()
    sums = rows.new_empty((n_rows, 1))
    backend.primitives["matmul_fwd"](rows, rows.new_ones((n_cols, 1)), None, sums)
    shape = [1 if d in dims else x.shape[d] for d in range(x.dim())] if keepdim else [x.shape[d] for d in kept]
    return (sums / n_cols).to(out_dtype).reshape(shape)


def _norm_rows(normalized_shape, x: Tensor) -> int | None:
    n_dims = len(normalized_shape)
    if n_dims == 0 or n_dims > x.dim() or tuple(x.shape[-n_dims:]) != tuple(normalized_shape):
        return None
    return math.prod(normalized_shape)


def _rms_norm_rows(x, normalized_shape, weight):
    """``(backend, rows [N, H], weight [H])`` of an aten rms_norm call rlk serves, else None."""
    hidden = _norm_rows(normalized_shape, x)
    if hidden is None or hidden == 0 or x.dtype not in _FLOAT_DTYPES or x.numel() == 0:
        return None
    if weight is not None and (weight.dtype != x.dtype or weight.numel() != hidden):
        return None
    backend = _invariant_backend("rms_norm", x.device, x.dtype)
    if backend is None:
        return None
    rows = x.reshape(-1, hidden).contiguous()
    w = x.new_ones(hidden) if weight is None else weight.reshape(hidden).contiguous()
    return backend, rows, w


def _fused_rms_norm(x, normalized_shape, weight=None, eps=None):
    served = _rms_norm_rows(x, normalized_shape, weight)
    if served is None:
        return _FALLBACK
    backend, rows, w = served
    if eps is None:  # aten's default: the epsilon of the accumulation type
        eps = torch.finfo(torch.float32).eps
    out = torch.empty_like(rows)
    rstd = x.new_empty((rows.shape[0],), dtype=torch.float32)
    backend.primitives["rms_norm_fwd"](rows, w, None, float(eps), False, out, None, rstd)
    stat_shape = (*x.shape[: x.dim() - len(normalized_shape)], *([1] * len(normalized_shape)))
    return out.view(x.shape), rstd.view(stat_shape)


def _fused_rms_norm_backward(grad_out, x, normalized_shape, rstd, weight, output_mask):
    served = _rms_norm_rows(x, normalized_shape, weight)
    if served is None:
        return _FALLBACK
    backend, rows, w = served
    if rstd.dtype != torch.float32 or grad_out.shape != x.shape or rstd.numel() != rows.shape[0]:
        return _FALLBACK
    grad_x = torch.empty_like(rows)
    grad_w = torch.empty_like(w) if weight is not None and output_mask[1] else None
    backend.primitives["rms_norm_bwd"](
        grad_out.to(x.dtype).reshape(rows.shape).contiguous(),
        rows,
        w,
        rstd.reshape(-1).contiguous(),
        False,
        None,
        grad_x,
        grad_w,
    )
    return (grad_x.view(x.shape) if output_mask[0] else None, grad_w.view(weight.shape) if grad_w is not None else None)


def _embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    if scale_grad_by_freq or grad_output.dtype not in _FLOAT_DTYPES or indices.is_floating_point():
        return _FALLBACK
    hidden = grad_output.shape[-1]
    if indices.numel() == 0 or hidden == 0 or grad_output.numel() != indices.numel() * hidden:
        return _FALLBACK
    backend = _invariant_backend("embedding", grad_output.device, grad_output.dtype)
    if backend is None:
        return _FALLBACK
    grad_weight = grad_output.new_empty((num_weights, hidden))
    backend.primitives["embedding_bwd"](
        grad_output.reshape(-1, hidden).contiguous(),
        indices.reshape(-1).to(torch.int64).contiguous(),
        int(padding_idx) if padding_idx >= 0 else -1,
        grad_weight,
    )
    return grad_weight


# ---- patch embeddings and layer norm (vision towers) ----------------------------------------------------


def _all(values, expected: int) -> bool:
    return all(int(v) == expected for v in values)


def _convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A convolution whose stride equals its kernel (no padding, dilation, groups): a patch embedding (ViT's
    Conv2d, Qwen2-VL's Conv3d). The input is cut into its non-overlapping patches (trailing pixels that fill no
    patch are dropped, as the convolution drops them), each flattened to a row ``[C * prod(kernel)]``, and the
    rows run through ``matmul_fwd`` against the flattened weight (bias fused): a patch's output does not depend on
    the other patches."""
    spatial = x.dim() - 2
    if transposed or groups != 1 or spatial < 1 or weight.dim() != x.dim() or x.numel() == 0:
        return _FALLBACK
    kernel = tuple(weight.shape[2:])
    if tuple(int(s) for s in stride) != kernel or not _all(padding, 0) or not _all(dilation, 1):
        return _FALLBACK
    if not _is_float(x, weight) or (bias is not None and (bias.dtype != x.dtype or bias.dim() != 1)):
        return _FALLBACK
    batch, channels = x.shape[:2]
    out_channels = weight.shape[0]
    if weight.shape[1] != channels or any(size < k for size, k in zip(x.shape[2:], kernel)):
        return _FALLBACK
    backend = _invariant_backend("matmul", x.device, x.dtype)
    if backend is None:
        return _FALLBACK
    counts = [size // k for size, k in zip(x.shape[2:], kernel)]
    x = x[(slice(None), slice(None), *(slice(0, n * k) for n, k in zip(counts, kernel)))]
    split = [batch, channels]
    for n, k in zip(counts, kernel):
        split += [n, k]
    # [B, C, n1, k1, n2, k2, ...] -> [B, n1, n2, ..., C, k1, k2, ...]
    order = [0, *(2 + 2 * i for i in range(spatial)), 1, *(3 + 2 * i for i in range(spatial))]
    rows = x.reshape(split).permute(order).reshape(batch * math.prod(counts), channels * math.prod(kernel))
    out = x.new_empty((rows.shape[0], out_channels))
    backend.primitives["matmul_fwd"](
        rows.contiguous(),
        weight.reshape(out_channels, -1).t(),
        None if bias is None else bias.contiguous(),
        out,
    )
    # [B * n1 * n2 ..., O] -> [B, O, n1, n2, ...]
    return out.view(batch, *counts, out_channels).movedim(-1, 1).contiguous()


def _native_layer_norm(x, normalized_shape, weight, bias, eps):
    """LayerNorm over the trailing ``normalized_shape`` dims: per row of ``H`` elements, in fp32, the mean and then
    the mean of the squared deviations each summed by ``matmul_fwd`` against a ones column (a ``K`` loop in fixed
    order, as ``mean.dim``); ``y = (x - mean) * rsqrt(var + eps) * weight + bias``, rounded once. The saved
    statistics have the stock kernel's shape and dtype (fp32 on CUDA, the input's dtype on the CPU), so the stock
    backward uses them."""
    hidden = _norm_rows(normalized_shape, x)
    if hidden is None or hidden == 0 or x.dtype not in _FLOAT_DTYPES or x.numel() == 0:
        return _FALLBACK
    for param in (weight, bias):
        if param is not None and (param.dtype != x.dtype or param.numel() != hidden or param.device != x.device):
            return _FALLBACK
    backend = _invariant_backend("matmul", x.device, torch.float32)
    if backend is None:
        return _FALLBACK
    rows = x.reshape(-1, hidden).to(torch.float32).contiguous()
    ones = rows.new_ones((hidden, 1))
    sums = rows.new_empty((rows.shape[0], 1))
    backend.primitives["matmul_fwd"](rows, ones, None, sums)
    mean = sums / hidden
    centered = rows - mean
    backend.primitives["matmul_fwd"]((centered * centered).contiguous(), ones, None, sums)
    rstd = torch.rsqrt(sums / hidden + eps)
    y = centered * rstd
    if weight is not None:
        y = y * weight.reshape(hidden).to(torch.float32)
    if bias is not None:
        y = y + bias.reshape(hidden).to(torch.float32)
    stat_shape = (*x.shape[: x.dim() - len(normalized_shape)], *([1] * len(normalized_shape)))
    stat_dtype = torch.float32 if x.device.type == "cuda" else x.dtype
    return y.to(x.dtype).view(x.shape), mean.to(stat_dtype).view(stat_shape), rstd.to(stat_dtype).view(stat_shape)


# ---- scaled dot-product attention: dense [B, H, S, D] <-> varlen [B * S, H, D] -----------------------


def _sdpa_backend(query, key, value, dropout_p, is_causal) -> Backend | None:
    if dropout_p != 0.0 or query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        return None
    if not _is_float(query, key, value) or query.numel() == 0 or key.numel() == 0:
        return None
    batch, heads, seq_q, head_dim = query.shape
    if key.shape[0] != batch or key.shape[3] != head_dim or heads % key.shape[1] != 0:
        return None
    if is_causal and seq_q != key.shape[2]:  # aten's causal mask is top-left aligned, rlk's bottom-right
        return None
    return _invariant_backend("attention", query.device, query.dtype, head_dim=head_dim)


def _to_varlen(x: Tensor) -> Tensor:
    """``[B, H, S, D]`` -> contiguous ``[B * S, H, D]``."""
    batch, heads, seq, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch * seq, heads, head_dim).contiguous()


def _from_varlen(x: Tensor, batch: int) -> Tensor:
    """``[B * S, H, D]`` -> ``[B, H, S, D]`` (a view with aten's flash output layout)."""
    total, heads, head_dim = x.shape
    return x.view(batch, total // batch, heads, head_dim).transpose(1, 2)


def _uniform_cu_seqlens(batch: int, seq: int, device: torch.device) -> Tensor:
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * seq


def _attention_forward(backend, query, key, value, is_causal, scale) -> tuple[Tensor, Tensor]:
    """Output ``[B, H, Sq, D]`` and lse ``[B, H, Sq]`` fp32 of dense SDPA through ``attention_fwd``."""
    batch, heads, seq_q, head_dim = query.shape
    seq_k = key.shape[2]
    q = _to_varlen(query)
    out = torch.empty_like(q)
    lse = q.new_empty((heads, batch * seq_q), dtype=torch.float32)
    backend.primitives["attention_fwd"](
        q,
        _to_varlen(key),
        _to_varlen(value),
        _uniform_cu_seqlens(batch, seq_q, q.device),
        _uniform_cu_seqlens(batch, seq_k, q.device),
        seq_q,
        seq_k,
        bool(is_causal),
        float(scale) if scale is not None else 1.0 / math.sqrt(head_dim),
        out,
        lse,
    )
    return _from_varlen(out, batch), lse.view(heads, batch, seq_q).permute(1, 0, 2).contiguous()


def _attention_backward(backend, grad_out, query, key, value, out, lse, is_causal, scale):
    """``(grad_q, grad_k, grad_v)`` ``[B, H, S, D]`` from the dense saved state; ``lse`` is ``[B, H, >= Sq]``."""
    batch, heads, seq_q, head_dim = query.shape
    seq_k = key.shape[2]
    q, k, v = _to_varlen(query), _to_varlen(key), _to_varlen(value)
    lse_rows = lse[:, :, :seq_q].permute(1, 0, 2).reshape(heads, batch * seq_q).contiguous()
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backend.primitives["attention_bwd"](
        _to_varlen(grad_out.to(query.dtype)),
        q,
        k,
        v,
        _to_varlen(out),
        lse_rows,
        None,
        _uniform_cu_seqlens(batch, seq_q, q.device),
        _uniform_cu_seqlens(batch, seq_k, q.device),
        seq_q,
        seq_k,
        bool(is_causal),
        float(scale) if scale is not None else 1.0 / math.sqrt(head_dim),
        grad_q,
        grad_k,
        grad_v,
    )
    return _from_varlen(grad_q, batch), _from_varlen(grad_k, batch), _from_varlen(grad_v, batch)


#: Per (device, dtype, shape): the tensor every rlk SDPA forward returns as its RNG state. The backward override
#: serves a call only when the RNG state it gets back is (a view of) this tensor, so a forward that ran the
#: stock kernel (the mode switched on between forward and backward) keeps the stock backward.
_rng_markers: dict[tuple, Tensor] = {}


def _rng_marker(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    key = (device, dtype, shape)
    if key not in _rng_markers:
        _rng_markers[key] = torch.empty(shape, dtype=dtype, device=device)  # never read: an identity
    return _rng_markers[key]


def _ours(rng_state) -> bool:
    return isinstance(rng_state, Tensor) and any(
        rng_state.data_ptr() == marker.data_ptr() for marker in _rng_markers.values()
    )


def _flash_attention(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    backend = None if return_debug_mask else _sdpa_backend(query, key, value, dropout_p, is_causal)
    if backend is None:
        return _FALLBACK
    out, lse = _attention_forward(backend, query, key, value, is_causal, scale)
    seed = _rng_marker(query.device, torch.uint64, (2,))
    offset = _rng_marker(query.device, torch.uint64, ())
    debug = query.new_empty((0,))
    no_cum = torch.empty((0,), dtype=torch.int32, device=query.device)
    return out, lse, no_cum, no_cum, query.shape[2], key.shape[2], seed, offset, debug


def _flash_attention_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    *,
    scale=None,
):
    backend = _sdpa_backend(query, key, value, dropout_p, is_causal)
    if backend is None or not _ours(philox_seed) or logsumexp.dim() != 3 or logsumexp.dtype != torch.float32:
        return _FALLBACK
    return _attention_backward(backend, grad_out, query, key, value, out, logsumexp, is_causal, scale)


_warned_masks: set[str] = set()


def _warn_not_invariant(what: str) -> None:
    if what not in _warned_masks:
        _warned_masks.add(what)
        warnings.warn(
            f"rlk.batch_invariant(): {what}: running the stock kernel, this call is NOT batch-invariant "
            "(for Hugging Face models, rlk.patch_model(model) routes attention with padding masks)",
            RuntimeWarning,
            stacklevel=3,
        )


def _efficient_attention(
    query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None
):
    if attn_bias is not None:
        _warn_not_invariant("scaled_dot_product_attention with an attn_mask (efficient kernel)")
        return _FALLBACK
    backend = _sdpa_backend(query, key, value, dropout_p, is_causal)
    if backend is None or key.shape[1] != query.shape[1]:
        return _FALLBACK
    out, lse = _attention_forward(backend, query, key, value, is_causal, scale)
    batch, heads, seq_q, _ = query.shape
    padded = (seq_q if torch.version.hip else math.ceil(seq_q / 32) * 32) if compute_log_sumexp else 0
    lse_out = lse.new_zeros((batch, heads, padded))
    if compute_log_sumexp:
        lse_out[:, :, :seq_q] = lse
    seed = _rng_marker(query.device, torch.int64, ())
    offset = _rng_marker(query.device, torch.int64, ())
    return out, lse_out, seed, offset


def _efficient_attention_backward(
    grad_out,
    query,
    key,
    value,
    attn_bias,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    dropout_p,
    grad_input_mask,
    is_causal=False,
    *,
    scale=None,
):
    if attn_bias is not None:
        return _FALLBACK
    backend = _sdpa_backend(query, key, value, dropout_p, is_causal)
    if backend is None or not _ours(philox_seed) or key.shape[1] != query.shape[1] or logsumexp.dim() != 3:
        return _FALLBACK
    if logsumexp.shape[2] < query.shape[2] or logsumexp.dtype != torch.float32:
        return _FALLBACK
    grads = _attention_backward(backend, grad_out, query, key, value, out, logsumexp, is_causal, scale)
    return (*grads, None)


def _cudnn_attention(
    query,
    key,
    value,
    attn_bias,
    compute_log_sumexp,
    dropout_p=0.0,
    is_causal=False,
    return_debug_mask=False,
    *,
    scale=None,
):
    """cuDNN SDPA (torch's default SDPA kernel on Hopper): output, and logsumexp ``[B, H, Sq, 1]`` fp32."""
    if attn_bias is not None:
        _warn_not_invariant("scaled_dot_product_attention with an attn_mask (cuDNN kernel)")
        return _FALLBACK
    backend = None if return_debug_mask else _sdpa_backend(query, key, value, dropout_p, is_causal)
    if backend is None:
        return _FALLBACK
    out, lse = _attention_forward(backend, query, key, value, is_causal, scale)
    no_cum = torch.empty((0,), dtype=torch.int32, device=query.device)
    seed = _rng_marker(query.device, torch.int64, ())
    offset = _rng_marker(query.device, torch.int64, ())
    return (out, lse.unsqueeze(-1), no_cum, no_cum, query.shape[2], key.shape[2], seed, offset, query.new_empty((0,)))


def _cudnn_attention_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    attn_bias,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    *,
    scale=None,
):
    if attn_bias is not None and attn_bias.numel() > 0:
        return _FALLBACK
    backend = _sdpa_backend(query, key, value, dropout_p, is_causal)
    if backend is None or not _ours(philox_seed) or logsumexp.dim() != 4 or logsumexp.dtype != torch.float32:
        return _FALLBACK
    lse = logsumexp[..., 0]
    return _attention_backward(backend, grad_out, query, key, value, out, lse, is_causal, scale)


#: (aten op with overload, handler, CUDA only)
_OVERRIDES: tuple[tuple[str, Callable, bool], ...] = (
    ("mm", _mm, False),
    ("addmm", _addmm, False),
    ("bmm", _bmm, False),
    ("_log_softmax", _log_softmax, False),
    ("_log_softmax_backward_data", _log_softmax_backward_data, False),
    ("_softmax", _softmax, False),
    ("_softmax_backward_data", _softmax_backward_data, False),
    ("mean.dim", _mean_dim, False),
    ("_fused_rms_norm", _fused_rms_norm, False),
    ("_fused_rms_norm_backward", _fused_rms_norm_backward, False),
    ("embedding_dense_backward", _embedding_dense_backward, False),
    ("convolution", _convolution, False),
    ("native_layer_norm", _native_layer_norm, False),
    ("_scaled_dot_product_flash_attention", _flash_attention, True),
    ("_scaled_dot_product_flash_attention_backward", _flash_attention_backward, True),
    ("_scaled_dot_product_efficient_attention", _efficient_attention, True),
    ("_scaled_dot_product_efficient_attention_backward", _efficient_attention_backward, True),
    ("_scaled_dot_product_cudnn_attention", _cudnn_attention, True),
    ("_scaled_dot_product_cudnn_attention_backward", _cudnn_attention_backward, True),
)


#: Forward ops overridden only where their backward op has a stock kernel too: on the CPU, aten's
#: ``rms_norm`` decomposes when gradients are needed and ``_fused_rms_norm_backward`` has no CPU kernel.
_NEEDS_BACKWARD_KERNEL = {"_fused_rms_norm": "_fused_rms_norm_backward"}


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------


def _op_exists(name: str) -> bool:
    packet, _, overload = name.partition(".")
    return hasattr(torch.ops.aten, packet) and (overload or "default") in getattr(torch.ops.aten, packet).overloads()


#: Calls served by rlk (not the stock kernel) per aten op since import: for tests and debugging.
served_calls: collections.Counter[str] = collections.Counter()


def _kernel(name: str, handler: Callable, original) -> Callable:
    """The registered kernel: the handler under the thread-local guard, else (or on _FALLBACK) the stock one."""

    def kernel(keyset, *args, **kwargs):
        if getattr(_guard, "active", False):
            return original.call_boxed(keyset, *args, **kwargs)
        _guard.active = True
        try:
            result = handler(*args, **kwargs)
        finally:
            _guard.active = False
        if result is _FALLBACK:
            return original.call_boxed(keyset, *args, **kwargs)
        served_calls[name] += 1
        return result

    return kernel


def _dispatch_keys() -> list[str]:
    served, why = _served_device_types()
    if not served:
        raise BackendError(
            "rlk.batch_invariant(): no batch-invariant backend serves this machine's devices:\n  " + "\n  ".join(why)
        )
    return [key for key, kind in (("CUDA", "cuda"), ("CPU", "cpu")) if kind in served]


def _register() -> torch.library.Library:
    keys = _dispatch_keys()
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            # overriding aten kernels is the point: silence torch's "Overriding a previously registered kernel"
            warnings.filterwarnings("ignore", message="(?s).*previously registered kernel")
            for key in keys:
                for name, handler, cuda_only in _OVERRIDES:
                    if (cuda_only and key != "CUDA") or not _op_exists(name):
                        continue
                    try:
                        original = torch.library.get_kernel(f"aten::{name}", key)
                        if name in _NEEDS_BACKWARD_KERNEL:
                            torch.library.get_kernel(f"aten::{_NEEDS_BACKWARD_KERNEL[name]}", key)
                    except RuntimeError:  # no stock kernel for this key (e.g. a CUDA-only op on CPU)
                        continue
                    library.impl(name, _kernel(name, handler, original), key, with_keyset=True)
    except BaseException:
        library._destroy()
        raise
    return library


def _sync() -> None:
    """Register or remove the overrides so that they are present exactly while the mode is on."""
    want = _state.explicit or _state.scopes > 0
    _backend_cache.clear()
    if want and _state.library is None:
        _state.library = _register()
    elif not want and _state.library is not None:
        library, _state.library = _state.library, None
        library._destroy()


def enable_batch_invariant() -> None:
    """Turn the mode on for the whole process (a no-op if it is on already).

    Raises :class:`rlk.BackendError` when no batch-invariant backend serves any device here (on a
    CPU-only machine, set ``TRITON_INTERPRET=1`` to run the triton backend's kernels, slowly).
    """
    with _lock:
        previous = _state.explicit
        _state.explicit = True
        try:
            _sync()
        except BaseException:
            _state.explicit = previous
            raise


def disable_batch_invariant() -> None:
    """Undo :func:`enable_batch_invariant` (a no-op if it was not called). Open
    ``with rlk.batch_invariant():`` blocks keep the mode on until they exit."""
    with _lock:
        _state.explicit = False
        _sync()


def is_batch_invariant_enabled() -> bool:
    """Whether the overrides are registered now."""
    with _lock:
        return _state.library is not None


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Run the block with the batch-invariant overrides on; they are removed on exit (also on an
    exception) unless an enclosing block or :func:`enable_batch_invariant` still wants them.
    Blocks nest. See the module docstring for what is routed and the threading rules."""
    with _lock:
        _state.scopes += 1
        try:
            _sync()
        except BaseException:
            _state.scopes -= 1
            raise
    try:
        yield
    finally:
        with _lock:
            _state.scopes -= 1
            _sync()
