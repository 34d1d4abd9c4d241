"""The pieces of vLLM's forward that rlk's plugin replaces, each in the trainer's (transformers + rlk) op order.

* :func:`rlk_linear_dispatch` replaces ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``: every
  unquantized linear layer and the LM head run ``F.linear`` (``aten::mm`` / ``addmm``, served by the aten overrides
  of :func:`rlk.enable_batch_invariant`) instead of oneDNN / SGL kernels, and keep their weight;
* :class:`RlkRMSNorm` (over vLLM's ``RMSNorm``): ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` by rlk's
  ``rms_norm`` primitive; the fused add first rounds ``x + residual`` to the activations' dtype, as transformers
  does, then normalizes that rounded residual;
* :class:`RlkRotaryEmbedding` (over ``RotaryEmbedding``): transformers' formula, ``freqs = inv_freq @ position``
  (fp32), ``cos, sin = cos(cat(freqs, freqs)), sin(...)`` cast to the activations' dtype, ``q * cos +
  rotate_half(q) * sin`` in that dtype;
* :class:`RlkSiluAndMul` (over ``SiluAndMul``): ``silu(x[..., :d]) * x[..., d:]``, each op rounded;
* :func:`full_logprobs` / :func:`apply_temperature` (over the sampler's): ``z = logits.float() * (1 / T)`` (one
  fp32 rounding) and every vocab entry's ``(z_v - m) - log s``, bitwise what :func:`rlk.selected_logprob` gives that
  entry (``log s`` is read off ``selected_logprob`` at the row's argmax, where ``z_y - m = 0``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlk.core import dispatch
from rlk.integrations.batch_invariant import _invariant_backend


class NotServed(ValueError):
    """What the rlk vLLM plugin does not serve (a model, a layer option, a dtype): raised when the engine builds
    the model, never a silent fallback to vLLM's own kernels."""


def _invariant(op: str, x: Tensor, **features: int) -> str:
    """The batch-invariant backend serving ``op`` for ``x`` (its name), or :class:`NotServed` saying why."""
    backend = _invariant_backend(op, x.device, x.dtype, **features)
    if backend is None:
        raise NotServed(
            f"rlk vLLM plugin: no batch-invariant {op} for {x.dtype} on {x.device.type} "
            f"(on the CPU: TRITON_INTERPRET=1 before starting Python, float32 or float16; see `rlk info`)"
        )
    return backend.name


# ---------------------------------------------------------------------------
# linear layers and the LM head
# ---------------------------------------------------------------------------


def rlk_linear_dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Replacement of vLLM's CPU GEMM dispatch: ``layer.cpu_linear = F.linear`` (the weight is kept, whatever
    ``remove_weight`` says, so that weight sync can write into it). Non-2-D weights (MoE experts, convolutions)
    are refused: the plugin serves dense models only."""
    weight = getattr(layer, "weight", None)
    if weight is not None and not weight.is_meta and weight.dim() != 2:
        raise NotServed(f"rlk vLLM plugin: a {weight.dim()}-D linear weight in {type(layer).__name__} (dense only)")
    layer.cpu_linear = F.linear


# ---------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)`` over the last dim (fp32 statistics), by rlk's
    batch-invariant ``rms_norm`` primitive, one program per row: the transformers RMSNorm of the trainer."""
    from rlk.integrations.hf.patch import _RMSNorm

    hidden = weight.shape[0]
    rows = x.reshape(-1, hidden).contiguous()
    return _RMSNorm.apply(rows, weight.contiguous(), float(eps), _invariant("rms_norm", x)).view(x.shape)


def _check_norm(norm) -> None:
    if not norm.has_weight or norm.variance_size_override is not None:
        raise NotServed("rlk vLLM plugin: RMSNorm without a weight or with a partial variance size")


def rms_norm_forward(norm, x: Tensor, residual: Tensor | None = None):
    """vLLM's ``RMSNorm.forward(x, residual=None)``: ``y`` or ``(y, x + residual)``, the residual sum rounded to
    the activations' dtype before the norm (transformers' ``hidden = residual + hidden``)."""
    _check_norm(norm)
    if residual is None:
        return rms_norm(x, norm.weight.data, norm.variance_epsilon)
    summed = x + residual
    return rms_norm(summed, norm.weight.data, norm.variance_epsilon), summed


# ---------------------------------------------------------------------------
# rotary embedding
# ---------------------------------------------------------------------------


def hf_inv_freq(base: float, dim: int, device: torch.device) -> Tensor:
    """transformers' default RoPE frequencies: ``1 / base ** (arange(0, dim, 2) / dim)``, fp32 ``[dim / 2]``."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (base**exponents)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(positions: Tensor, query: Tensor, key: Tensor | None, inv_freq: Tensor, head_size: int):
    """transformers' RoPE of ``query [T, Hq * D]`` and ``key [T, Hkv * D]`` at ``positions [T]`` (neox layout,
    the whole head rotated): ``freqs [1, T, D/2] = (inv_freq[None, :, None] @ positions[None, None, :]).mT`` in
    fp32, ``cos = cos(cat(freqs, freqs)).to(dtype)`` (``sin`` alike), ``x * cos + rotate_half(x) * sin`` in the
    activations' dtype. Returns ``(query, key)`` of the input shapes."""
    pos = positions.flatten()
    tokens = pos.shape[0]
    freqs = (inv_freq[None, :, None].float() @ pos[None, None, :].float()).transpose(1, 2)[0]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(query.dtype)[:, None, :], emb.sin().to(query.dtype)[:, None, :]

    def rotate(x: Tensor) -> Tensor:
        heads = x.view(tokens, -1, head_size)
        return ((heads * cos) + (_rotate_half(heads) * sin)).reshape(x.shape)

    return rotate(query), (None if key is None else rotate(key))


def _check_rope(module) -> None:
    if not module.is_neox_style or module.rotary_dim != module.head_size:
        raise NotServed(
            "rlk vLLM plugin: RoPE must rotate the whole head in the neox layout (Llama / Qwen); got "
            f"rotary_dim={module.rotary_dim}, head_size={module.head_size}, is_neox_style={module.is_neox_style}"
        )


def rope_forward(module, positions: Tensor, query: Tensor, key: Tensor | None = None):
    """vLLM's ``RotaryEmbedding.forward(positions, query, key)`` by :func:`rope` (frequencies of
    :func:`hf_inv_freq`, cached per device)."""
    _check_rope(module)
    cached = module.__dict__.get("_rlk_inv_freq")
    if cached is None or cached.device != query.device:
        cached = hf_inv_freq(module.base, module.rotary_dim, query.device)
        module.__dict__["_rlk_inv_freq"] = cached
    return rope(positions, query, key, cached, module.head_size)


# ---------------------------------------------------------------------------
# SiLU * up
# ---------------------------------------------------------------------------


def silu_and_mul(x: Tensor) -> Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``: transformers' ``act(gate) * up``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


# ---------------------------------------------------------------------------
# log-probs
# ---------------------------------------------------------------------------


def full_logprobs(logits: Tensor) -> Tensor:
    """fp32 ``[N, V]`` log-probs of ``logits [N, V]`` (any float dtype), entry ``v`` bitwise
    ``rlk.selected_logprob(logits, v)``: ``(z_v - m) - log s`` with ``z = logits.float()``, ``m = max z`` and
    ``log s = -selected_logprob(z, argmax z)`` (the kernel's own sum). Rows with temperature already applied by
    :func:`apply_temperature` are the ``selected_logprob(logits, v, temperature=T)`` of the raw logits."""
    import rlk

    z = logits.float()
    if z.numel() == 0:
        return z
    top = z.argmax(-1)
    with dispatch.use_backend(_invariant("selected_logprob", z)):
        log_s = -rlk.selected_logprob(z, top)  # (m - m) - log s = -log s, exactly
    return (z - z.gather(-1, top[:, None])) - log_s[:, None]


def apply_temperature(logits: Tensor, temp: Tensor, all_random: bool) -> Tensor:
    """The sampler's temperature step in rlk's order: ``logits *= 1 / T`` (fp32 reciprocal, one rounded
    multiply; ``T < 1e-5`` rows, greedy, use 1), in place like vLLM's ``logits /= T``."""
    if not all_random:
        temp = torch.where(temp < 1e-5, 1.0, temp)
    return logits.mul_(torch.reciprocal(temp.float()).unsqueeze(1))


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """The trainer's side of :func:`full_logprobs`: ``rlk.selected_logprob(logits, tokens, temperature=T)`` on a
    batch-invariant backend; fp32 ``tokens.shape``."""
    import rlk

    z = logits.float()
    with dispatch.use_backend(_invariant("selected_logprob", z)):
        return rlk.selected_logprob(z, tokens, temperature=temperature)
