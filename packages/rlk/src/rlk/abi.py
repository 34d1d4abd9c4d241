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

from dataclasses import dataclass

#: Bumped on any incompatible change of a primitive's signature or meaning.
ABI_VERSION = 1


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
    )
}

_FLOAT_DTYPES = ("float32", "float16", "bfloat16")

OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op("selected_logprob", "selected_logprob_fwd", "selected_logprob_bwd", _FLOAT_DTYPES),
        Op("linear_logprob", "linear_logprob_fwd", "linear_logprob_bwd", _FLOAT_DTYPES),
    )
}
