"""Shared by ``test_arguments.py``, ``test_loss_spans.py`` and ``test_fuzz_options.py``: minimal valid calls of rlk's
public ops, for the checks every op must make of its options and inputs.

* :func:`bool_options`: every boolean option of the public API, found by inspecting signatures (parameters annotated
  ``bool``, or without annotation and with a bool default; a config dataclass's bool fields; and those fields again as
  keywords of the ops that take the config with ``**options``). :data:`BOOL_CALLS` holds one valid call per op that
  has such an option; a new op or option is found automatically, and a new op without its entry there fails
  ``test_every_boolean_option_is_found_and_has_a_call``.
* :data:`DTYPE_CASES`: the ops with several floating data inputs, each input named, for the dtype rule
  (``rlk.core.checks.same_dtype``).
* :data:`SPAN_OPS`: the ops that take ``loss_spans``, as losses of their differentiable input, for
  ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import NamedTuple
from unittest import mock

import numpy as np
import torch

import rlk
import rlk.distributed
from rlk.core.abi import ABI_VERSION
from rlk.integrations import verl
from rlk.integrations.hf import training as hf_training
from rlk.ops import logprob as logprob_ops

#: Public callables beyond ``rlk.__all__`` whose boolean options are checked (the integrations': a few, by name).
EXTRA_PUBLIC: dict[str, Callable] = {
    "rlk.integrations.hf.apply": hf_training.apply,
    "rlk.integrations.verl.compute_grpo_outcome_advantage": verl.compute_grpo_outcome_advantage,
    "rlk.integrations.verl.compute_grpo_vectorized_outcome_advantage": verl.compute_grpo_vectorized_outcome_advantage,
    "rlk.integrations.verl.register": verl.register,
}


def public_api() -> dict[str, object]:
    """``rlk.__all__`` and ``rlk.distributed.__all__`` by qualified name (no modules), and :data:`EXTRA_PUBLIC`."""
    found = {f"rlk.{name}": getattr(rlk, name) for name in rlk.__all__}
    found |= {f"rlk.distributed.{name}": getattr(rlk.distributed, name) for name in rlk.distributed.__all__}
    found = {name: obj for name, obj in found.items() if callable(obj) and not inspect.ismodule(obj)}
    return found | EXTRA_PUBLIC


def _bool_fields(cls) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if f.init and hints[f.name] is bool]


def _bool_parameters(obj) -> list[str]:
    if dataclasses.is_dataclass(obj):
        return _bool_fields(obj)
    try:
        sig = inspect.signature(obj, eval_str=True)
    except (TypeError, ValueError):  # exceptions and other builtins
        return []
    names = [
        p.name
        for p in sig.parameters.values()
        if p.annotation is bool or (p.annotation is inspect.Parameter.empty and isinstance(p.default, bool))
    ]
    config = sig.parameters.get("config")
    takes_options = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    if config is not None and takes_options and "PolicyLossConfig" in str(config.annotation):
        names += _bool_fields(rlk.PolicyLossConfig)  # its fields are keywords of the call too
    return names


def bool_options() -> list[tuple[str, str]]:
    """``(qualified op name, option)`` of every boolean option of the public API, sorted."""
    return sorted((name, option) for name, obj in public_api().items() for option in _bool_parameters(obj))


# ---------------------------------------------------------------------------
# one valid call per op with a boolean option
# ---------------------------------------------------------------------------

_B, _T, _V, _H = 2, 3, 5, 4


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _lp(seed: int = 0) -> torch.Tensor:
    return -torch.rand(_B, _T, generator=torch.Generator().manual_seed(seed)) - 0.1


def _policy_args() -> tuple:
    return _lp(0), _lp(1), torch.randn(_B, _T, generator=_g()), torch.ones(_B, _T, dtype=torch.bool)


def _linear_args() -> tuple:
    g = _g()
    return torch.randn(_B, _T, _H, generator=g), torch.randn(_V, _H, generator=g), torch.randint(0, _V, (_B, _T))


def _attention_args() -> tuple:
    g = _g()
    q, k, v = (torch.randn(5, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    return (q, k, v), {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 3, "max_seqlen_k": 3}


def _rope_args() -> tuple:
    g = _g()
    q, k = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g)
    return q, k, torch.randn(1, 3, 8, generator=g), torch.randn(1, 3, 8, generator=g)


def _backend(**kw):
    return rlk.Backend(
        name="probe",
        version="0",
        abi_version=ABI_VERSION,
        primitives={},
        probe=lambda: None,
        device_types=lambda: ("cpu",),
        **kw,
    )


@contextlib.contextmanager
def _restore_settings():
    """Leave the process-wide switches as they were, whatever a call did to them."""
    ranges = rlk.core.custom_op._ranges
    tp = rlk.is_tensor_parallel_invariant()
    try:
        yield
    finally:
        rlk.core.custom_op._ranges = ranges
        rlk.set_tensor_parallel_invariant(tp)


def _entered(cm) -> None:
    with cm:
        pass


def _verl_grpo(fn, **kw):
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    return fn(rewards, torch.ones(4, 3), np.array(["a", "a", "b", "b"], dtype=object), **kw)


#: One valid call per op with a boolean option: ``BOOL_CALLS[op](**{option: value})``.
BOOL_CALLS: dict[str, Callable[..., object]] = {
    "rlk.Backend": lambda **kw: _backend(**kw),
    "rlk.PolicyLossConfig": lambda **kw: rlk.PolicyLossConfig(**kw),
    "rlk.apply_rope": lambda **kw: rlk.apply_rope(*_rope_args(), **kw),
    "rlk.attention": lambda **kw: rlk.attention(*_attention_args()[0], **_attention_args()[1], **kw),
    "rlk.prefix_attention": lambda **kw: rlk.prefix_attention(
        *_attention_args()[0], **_attention_args()[1], prefix_index=torch.tensor([-1, -1], dtype=torch.int32), **kw
    ),
    "rlk.fused_linear_policy_loss": lambda **kw: rlk.fused_linear_policy_loss(
        *_linear_args(), *_policy_args()[1:], **kw
    ),
    "rlk.kl_penalty": lambda **kw: rlk.kl_penalty(_lp(0), _lp(1), "k3", **kw),
    "rlk.linear_logprob": lambda **kw: rlk.linear_logprob(*_linear_args(), **kw),
    "rlk.masked_whiten": lambda **kw: rlk.masked_whiten(torch.randn(_B, _T, generator=_g()), torch.ones(_B, _T), **kw),
    "rlk.policy_loss": lambda **kw: rlk.policy_loss(*_policy_args(), **kw),
    "rlk.policy_loss_and_grad": lambda **kw: rlk.policy_loss_and_grad(*_policy_args(), **kw),
    "rlk.rms_norm": lambda **kw: rlk.rms_norm(torch.randn(_B, _H, generator=_g()), torch.ones(_H), **kw),
    "rlk.selected_logprob": lambda **kw: rlk.selected_logprob(
        torch.randn(_B, _T, _V, generator=_g()), torch.randint(0, _V, (_B, _T)), **kw
    ),
    "rlk.set_profiler_ranges": lambda **kw: rlk.set_profiler_ranges(**kw),
    "rlk.set_tensor_parallel_invariant": lambda **kw: rlk.set_tensor_parallel_invariant(**kw),
    "rlk.tensor_parallel_invariant": lambda **kw: _entered(rlk.tensor_parallel_invariant(**kw)),
    "rlk.distributed.column_parallel_linear": lambda **kw: rlk.distributed.column_parallel_linear(
        torch.randn(_B, 64, generator=_g()),
        [torch.randn(64, 64, generator=_g())],
        group=rlk.distributed.SimulatedGroup(1),
        **kw,
    ),
    "rlk.distributed.vocab_parallel_linear_logprob": lambda **kw: rlk.distributed.vocab_parallel_linear_logprob(
        _linear_args()[0], [_linear_args()[1]], _linear_args()[2], group=rlk.distributed.SimulatedGroup(1), **kw
    ),
    "rlk.distributed.context_parallel_attention": lambda **kw: rlk.distributed.context_parallel_attention(
        *_attention_args()[0], cu_seqlens=_attention_args()[1]["cu_seqlens_q"], group=None, **kw
    ),
    "rlk.integrations.hf.apply": lambda **kw: hf_training.unapply(hf_training.apply(torch.nn.Linear(2, 2), **kw)),
    "rlk.integrations.verl.compute_grpo_outcome_advantage": lambda **kw: _verl_grpo(
        verl.compute_grpo_outcome_advantage, **kw
    ),
    "rlk.integrations.verl.compute_grpo_vectorized_outcome_advantage": lambda **kw: _verl_grpo(
        verl.compute_grpo_vectorized_outcome_advantage, **kw
    ),
    "rlk.integrations.verl.register": lambda **kw: _verl_register(**kw),
}


def _verl_register(**kw):
    """``verl.register`` refuses a non-bool ``override`` before it imports verl; with a bool it needs verl."""
    try:
        names = verl.register(**kw)
    except ImportError:
        return None
    verl.unregister()
    return names


def call_option(op: str, option: str, value) -> object:
    """``BOOL_CALLS[op]`` with ``option=value``, process-wide switches restored afterwards."""
    with _restore_settings():
        return BOOL_CALLS[op](**{option: value})


#: Non-bool values that a boolean option must refuse (each read as True or False by ``bool()``).
NOT_BOOLS = ("False", "true", "", 2, 1, 0, None, 1.0, np.bool_(True), [False])


# ---------------------------------------------------------------------------
# the dtype rule
# ---------------------------------------------------------------------------


class DtypeCase(NamedTuple):
    """An op's floating data inputs (``inputs()``: fp32, by name, in the op's order; the first its main input),
    ``call(inputs)`` the op, and the inputs that must share the main input's dtype exactly (GEMM operands)."""

    inputs: Callable[[], dict[str, torch.Tensor]]
    call: Callable[[dict[str, torch.Tensor]], object]
    exact: tuple[str, ...] = ()


def _pairs() -> dict[str, torch.Tensor]:
    g = _g()
    return {n: -torch.rand(4, generator=g) for n in ("chosen", "rejected", "ref_chosen", "ref_rejected")}


DTYPE_CASES: dict[str, DtypeCase] = {
    "policy_loss": DtypeCase(
        lambda: dict(
            zip(("logprob", "old_logprob", "advantages"), _policy_args()[:3]),
            importance_weights=torch.ones(_B, _T),
            ref_logprob=_lp(2),
            entropy=torch.rand(_B, _T, generator=_g()),
        ),
        lambda x: rlk.policy_loss(
            x["logprob"],
            x["old_logprob"],
            x["advantages"],
            torch.ones(_B, _T, dtype=torch.bool),
            importance_weights=x["importance_weights"],
            ref_logprob=x["ref_logprob"],
            entropy=x["entropy"],
        ),
    ),
    "policy_loss_and_grad": DtypeCase(
        lambda: dict(zip(("logprob", "old_logprob", "advantages"), _policy_args()[:3]), ref_logprob=_lp(2)),
        lambda x: rlk.policy_loss_and_grad(
            x["logprob"], x["old_logprob"], x["advantages"], torch.ones(_B, _T), ref_logprob=x["ref_logprob"]
        ),
    ),
    "kl_penalty": DtypeCase(
        lambda: {"logprob": _lp(0), "ref_logprob": _lp(1), "old_logprob": _lp(2)},
        lambda x: rlk.kl_penalty(x["logprob"], x["ref_logprob"], "k3", old_logprob=x["old_logprob"]),
    ),
    "value_loss": DtypeCase(
        lambda: {"values": torch.randn(_B, _T, generator=_g()), "old_values": _lp(1), "returns": _lp(2)},
        lambda x: rlk.value_loss(x["values"], x["old_values"], x["returns"], torch.ones(_B, _T)),
    ),
    "dpo_loss": DtypeCase(
        lambda: {f"{n}_logprob": t for n, t in _pairs().items()},
        lambda x: rlk.dpo_loss(*x.values()),
    ),
    "linear_logprob": DtypeCase(
        lambda: dict(zip(("hidden", "weight"), _linear_args()[:2])),
        lambda x: rlk.linear_logprob(x["hidden"], x["weight"], _linear_args()[2]),
        exact=("weight",),
    ),
    "fused_linear_policy_loss": DtypeCase(
        lambda: dict(
            zip(("hidden", "weight"), _linear_args()[:2]),
            old_logprob=_lp(1),
            advantages=torch.randn(_B, _T, generator=_g()),
            ref_logprob=_lp(2),
            importance_weights=torch.ones(_B, _T),
        ),
        lambda x: rlk.fused_linear_policy_loss(
            x["hidden"],
            x["weight"],
            _linear_args()[2],
            x["old_logprob"],
            x["advantages"],
            torch.ones(_B, _T),
            ref_logprob=x["ref_logprob"],
            importance_weights=x["importance_weights"],
        ),
        exact=("weight",),
    ),
    "fused_linear_kl": DtypeCase(
        lambda: dict(
            zip(("student_hidden", "student_weight"), _linear_args()[:2]),
            teacher_hidden=torch.randn(_B, _T, 3, generator=_g()),
            teacher_weight=torch.randn(_V, 3, generator=_g()),
        ),
        lambda x: rlk.fused_linear_kl(*x.values()),
        exact=("student_weight", "teacher_hidden", "teacher_weight"),
    ),
    "gae": DtypeCase(
        lambda: {"rewards": torch.randn(_B, _T, generator=_g()), "values": torch.randn(_B, _T, generator=_g())},
        lambda x: rlk.gae(x["rewards"], x["values"], torch.ones(_B, _T)),
    ),
    "rollout_correction": DtypeCase(
        lambda: {"old_logprob": _lp(0), "rollout_logprob": _lp(1)},
        lambda x: rlk.rollout_correction(x["old_logprob"], x["rollout_logprob"], torch.ones(_B, _T)),
    ),
    "scatter_rewards": DtypeCase(
        lambda: {
            "rewards": torch.randn(_B, 2, generator=_g()),
            "reward_weights": torch.ones(2),
            "costs": torch.ones(_B),
        },
        lambda x: rlk.scatter_rewards(
            x["rewards"], torch.ones(_B, _T), reward_weights=x["reward_weights"], costs=x["costs"]
        ),
    ),
}


def mixed_inputs(case: DtypeCase, changed: str, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], str]:
    """The case's inputs with ``changed`` in ``dtype``, and the argument the error must name: ``changed``, or, when
    it is the main input, the next input (the first that no longer agrees with it)."""
    inputs = case.inputs()
    inputs[changed] = inputs[changed].to(dtype)
    names = list(inputs)
    return inputs, names[1] if changed == names[0] else changed


def refused_dtypes(case: DtypeCase, name: str) -> tuple[torch.dtype, ...]:
    """The dtypes that ``name`` may not take while the others are fp32: float64 (another compute dtype), and for an
    input that must match exactly (or the main input of an op that has one) float16 and bfloat16 too."""
    exact = name in case.exact or (case.exact and name == next(iter(case.inputs())))
    return (torch.float64, torch.float16, torch.bfloat16) if exact else (torch.float64,)


# ---------------------------------------------------------------------------
# the ops that take loss_spans
# ---------------------------------------------------------------------------


class SpanOp(NamedTuple):
    """``loss(seed, b, t, tags)(x, spans)``: a 0-d loss of the op given ``loss_spans=spans`` and ``span_tags=tags``
    (its other inputs drawn from ``seed``), differentiable w.r.t. ``x``, made by ``leaf(seed, b, t)``."""

    leaf: Callable[[int, int, int], torch.Tensor]
    loss: Callable[..., Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _targets(seed: int, b: int, t: int) -> torch.Tensor:
    return torch.randint(0, _V, (b, t), generator=torch.Generator().manual_seed(seed + 1))


def _span_loss_selected(seed, b, t, tags=None):
    targets = _targets(seed, b, t)

    def loss(x, spans):
        lp, ent = rlk.selected_logprob(x, targets, loss_spans=spans, span_tags=tags, return_entropy=True)
        return lp.sum() + ent.sum()

    return loss


def _span_loss_linear(seed, b, t, tags=None):
    targets, weight = _targets(seed, b, t), _randn(seed + 2, _V, _H) * 0.3

    def loss(x, spans):
        return rlk.linear_logprob(x, weight, targets, loss_spans=spans, span_tags=tags).sum()

    return loss


def _span_loss_policy(seed, b, t, tags=None):
    old, adv = -_randn(seed + 1, b, t).abs(), _randn(seed + 2, b, t)

    def loss(x, spans):
        value, metrics = rlk.policy_loss(x, old, adv, loss_spans=spans, span_tags=tags)
        return value + metrics["ratio_mean"]

    return loss


def _span_loss_kl(seed, b, t, tags=None):
    ref = -_randn(seed + 1, b, t).abs()

    def loss(x, spans):
        return rlk.kl_penalty(x, ref, "k3", loss_spans=spans, span_tags=tags).sum()

    return loss


def _span_loss_value(seed, b, t, tags=None):
    old, returns = _randn(seed + 1, b, t), _randn(seed + 2, b, t)

    def loss(x, spans):
        return rlk.value_loss(x, old, returns, loss_spans=spans, span_tags=tags)[0]

    return loss


def _span_loss_fused(seed, b, t, tags=None):
    targets, weight = _targets(seed, b, t), _randn(seed + 2, _V, _H) * 0.3
    old, adv = -_randn(seed + 3, b, t).abs() - 1.0, _randn(seed + 4, b, t)

    def loss(x, spans):
        return rlk.fused_linear_policy_loss(x, weight, targets, old, adv, loss_spans=spans, span_tags=tags)[0]

    return loss


SPAN_OPS: dict[str, SpanOp] = {
    "selected_logprob": SpanOp(lambda s, b, t: _randn(s, b, t, _V) * 2, _span_loss_selected),
    "policy_loss": SpanOp(lambda s, b, t: -_randn(s, b, t).abs(), _span_loss_policy),
    "kl_penalty": SpanOp(lambda s, b, t: -_randn(s, b, t).abs(), _span_loss_kl),
    "value_loss": SpanOp(lambda s, b, t: _randn(s, b, t), _span_loss_value),
    "linear_logprob": SpanOp(lambda s, b, t: _randn(s, b, t, _H), _span_loss_linear),
    "fused_linear_policy_loss": SpanOp(lambda s, b, t: _randn(s, b, t, _H), _span_loss_fused),
}


def eager_and_compiled(op: str, spans: torch.Tensor, seed: int, b: int, t: int, tags=None):
    """``(loss, grad)`` of :data:`SPAN_OPS` ``[op]`` eagerly and under ``torch.compile(fullgraph=True)`` (aot_eager:
    the graph's own ops run as torch's, so any difference is rlk's), each from a fresh leaf.

    A host table makes eager ``linear_logprob`` pack the scored rows (their number read on the host), which a traced
    graph cannot: compiled, it masks in place, as eager does where ``pack`` is not served. The eager run takes that
    path too, so that the two compute the same rows (the packed path agrees within rounding on the reference)."""
    case = SPAN_OPS[op]
    loss_fn = case.loss(seed, b, t, tags)
    torch._dynamo.reset()
    results = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True, backend="aot_eager")):
        x = case.leaf(seed, b, t).requires_grad_(True)
        with mock.patch.object(logprob_ops, "_pack_served", return_value=False):
            value = fn(x, spans)
        (grad,) = torch.autograd.grad(value, x)
        results.append((value.detach(), grad))
    return results
