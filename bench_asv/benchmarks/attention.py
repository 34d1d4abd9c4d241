"""Benchmarks of ``rlk.ops.attention.attention`` (varlen, batch-invariant flash attention) against SDPA flash.

Implementations (the ``impl`` parameter), modes (the ``mode`` option) ``fwd`` and ``fwd+bwd``:

* ``rlk``: ``rlk.ops.attention.attention`` on the packed varlen tensors (``[total, H, D]``, ``cu_seqlens``);
* ``sdpa_flash``: ``torch.nn.functional.scaled_dot_product_attention`` under
  ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)`` on ``[B, H, S, D]`` tensors, GQA through
  ``enable_gqa=True`` (no repeat of k/v). The packed mix runs one SDPA call per sequence (torch exposes
  no public varlen flash entry), which is what a framework without varlen kernels does.

Shapes (``shape = (B, T, Hq, Hkv, D)``: sequences, total tokens, heads, kv heads, head dim): dense
``(8, 32768, 32, 8, 128)``, 8 sequences of 4096, causal, bf16; packed ``(9, 32768, 32, 8, 128)``, 9
sequences of lengths 512..8192 (:data:`LENGTHS`) summing to 32768 tokens. Quick mode
(``RLK_BENCH_QUICK=1`` or no GPU): tiny fp32 shapes. FLOPs credited per step (every impl gets
the same nominal work): causal forward ``2 * 2 * S^2 / 2 * D * Hq`` per sequence (two matmuls, half
the score matrix), backward 2.5x that, so ``fwd+bwd`` is 3.5x the forward's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlk.ops.attention import attention

from .common import DEVICE, QUICK, SEED, CaseBase, _CaseSetup, _MemorySetup

DTYPE = torch.float32 if QUICK else torch.bfloat16
_HEADS = (4, 2, 32) if QUICK else (32, 8, 128)  # Hq, Hkv, D
_DENSE = [64] * 2 if QUICK else [4096] * 8
_PACKED = [16, 48, 80] if QUICK else [512, 8192, 1024, 6144, 2048, 4096, 7168, 1536, 2048]
#: shape (B, T, Hq, Hkv, D) -> the sequence lengths
LENGTHS = {(len(x), sum(x), *_HEADS): x for x in (_DENSE, _PACKED)}
SHAPES = list(LENGTHS)


def causal_flops(lengths: list[int], n_heads: int, head_dim: int) -> float:
    """Nominal forward FLOPs of causal attention: two matmuls over half of each sequence's score matrix."""
    return sum(2 * 2 * n * n / 2 * head_dim * n_heads for n in lengths)


class AttentionCase(CaseBase):
    """One step of causal attention (``fwd`` or ``fwd+bwd``) on a packed batch of sequences."""

    def __init__(self, op: str, impl: str, mode: str, shape: tuple[int, ...]):
        if mode not in ("fwd", "fwd+bwd"):
            raise ValueError(f"unknown mode {mode!r}")
        if impl not in ("rlk", "sdpa_flash"):
            raise ValueError(f"unknown impl {impl!r}")
        lengths = LENGTHS[tuple(shape)]
        n_heads, n_kv_heads, head_dim = shape[2:]
        gen = torch.Generator(DEVICE).manual_seed(SEED)
        total = sum(lengths)
        grad = mode == "fwd+bwd"

        def rnd(*size: int) -> Tensor:
            return torch.randn(*size, generator=gen, device=DEVICE, dtype=DTYPE)

        self.q, self.k, self.v = (
            rnd(total, n_heads, head_dim),
            rnd(total, n_kv_heads, head_dim),
            rnd(total, n_kv_heads, head_dim),
        )
        self.grad_out = rnd(total, n_heads, head_dim)
        self.lengths, self.mode, self.impl = lengths, mode, impl
        self.work = causal_flops(lengths, n_heads, head_dim) * (3.5 if grad else 1.0)
        self.unit = "TFLOP/s"
        if impl == "rlk":
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
            self.kwargs = dict(
                cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths), causal=True
            )
            self.leaves = [t.requires_grad_(grad) for t in (self.q, self.k, self.v)]
            import rlk

            self.decision = rlk.explain("attention", self.q)
        else:
            # [B, H, S, D] per run of equal lengths (one tensor for the dense shape, one per sequence otherwise)
            self.dense: list[tuple[Tensor, ...]] = []
            start = 0
            for n in lengths:

                def view(t: Tensor, s=start, n=n) -> Tensor:
                    return t[s : s + n].transpose(0, 1).unsqueeze(0)

                self.dense.append(tuple(view(t) for t in (self.q, self.k, self.v, self.grad_out)))
                start += n
            if len(set(lengths)) == 1:
                b = len(lengths)
                self.dense = [
                    tuple(
                        t.view(b, lengths[0], t.shape[1], head_dim).transpose(1, 2).contiguous()
                        for t in (self.q, self.k, self.v, self.grad_out)
                    )
                ]
            self.dense = [
                tuple(t.contiguous().requires_grad_(grad and i < 3) for i, t in enumerate(group))
                for group in self.dense
            ]
        self.step()

    def step(self) -> object:
        if self.impl == "rlk":
            out = attention(*self.leaves, **self.kwargs)
            if self.mode == "fwd":
                return out
            return torch.autograd.grad(out, self.leaves, self.grad_out)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        results = []
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for q, k, v, grad_out in self.dense:
                out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                results.append(out if self.mode == "fwd" else torch.autograd.grad(out, (q, k, v), grad_out))
        return results


class Attention(_CaseSetup):
    """Causal varlen attention, fwd and fwd+bwd: ms and TFLOP/s (module docstring: FLOPs credited)."""

    op, case_type, shape_names = "attention", AttentionCase, "BTHKD"
    baselines = ("sdpa_flash",)
    param_names = ["impl", "mode", "shape"]
    params = [["rlk", "sdpa_flash"], ["fwd", "fwd+bwd"], SHAPES]

    def track_ms(self, impl: str, mode: str, shape: tuple[int, ...]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_tflops(self, impl: str, mode: str, shape: tuple[int, ...]) -> float:
        return self.case.rate()

    track_tflops.unit = "TFLOP/s"


class AttentionMemory(_MemorySetup):
    """Peak extra memory of one causal attention step."""

    op, case_type, shape_names = "attention", AttentionCase, "BTHKD"
    param_names = ["impl", "mode", "shape"]
    params = [["rlk", "sdpa_flash"], ["fwd", "fwd+bwd"], SHAPES]
