"""The training one-liner: :func:`apply` / :func:`unapply`.

After ``rlk.integrations.hf.apply(model)``, ``model(input_ids, ..., logprob_targets=targets)`` returns the per-token
log-probs (and entropy) of ``targets`` through :func:`rlk.linear_logprob`, from the hidden states the LM head
receives and the head's weight, without the ``[N, V]`` logits, forward and backward. Without ``logprob_targets``
the model runs its own forward. During a log-prob call the head module's ``forward`` is the fused op and its
output takes the logits' place through the model's own forward, so hooks on the head (FSDP, ZeRO-3) still run.
Guide (target convention, supported models, limits): ``docs/hf.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import warnings

import torch
from torch import Tensor

from rlk.core import checks, dispatch
from rlk.integrations.batch_invariant import _invariant_backend
from rlk.integrations.batch_invariant import batch_invariant as _batch_invariant_mode
from rlk.integrations.hf.patch import patch_model, unpatch_model
from rlk.ops.logprob import linear_logprob

#: Config fields of models whose forward changes the LM head's output before returning it (the log-probs of
#: the plain head would be those of another distribution). Read from the text config; None means "off".
_LOGIT_TRANSFORMS = (
    ("final_logit_softcapping", "a final logit soft-cap"),
    ("logit_scale", "a logit scale"),
    ("logits_scaling", "a logit scaling"),
    ("lm_head_multiplier", "an LM head multiplier"),
    ("output_multiplier", "an output multiplier"),
)

#: Keyword arguments of a log-prob call that override the options given to :func:`apply`.
_PER_CALL = ("temperature", "return_entropy")


@dataclasses.dataclass
class _State:
    """What :func:`apply` stored on the model (``model._rlk_apply``)."""

    temperature: float | Tensor
    ignore_index: int
    return_entropy: bool
    batch_invariant: bool
    previous_forward: object  # an instance-level ``forward`` found on the model (restored by unapply), or None
    patched: bool  # apply called patch_model (unapply undoes it)

    def same_options(self, other: _State) -> bool:
        same_t = (
            self.temperature is other.temperature
            if isinstance(self.temperature, Tensor)
            else not isinstance(other.temperature, Tensor) and self.temperature == other.temperature
        )
        return same_t and (self.ignore_index, self.return_entropy, self.batch_invariant) == (
            other.ignore_index,
            other.return_entropy,
            other.batch_invariant,
        )


@dataclasses.dataclass
class _Request:
    """One log-prob call, as the replaced head forward sees it."""

    targets: Tensor
    temperature: float | Tensor
    ignore_index: int
    return_entropy: bool
    batch_invariant: bool
    output: Tensor | None = None  # what the head returned, and its version counter then
    version: int = 0
    calls: int = 0


# ---------------------------------------------------------------------------
# what is supported
# ---------------------------------------------------------------------------


def _kind(model) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__} (model_type {model_type!r})" if model_type else type(model).__name__


def _check_model(model) -> None:
    """Refuse what the fused head cannot compute exactly, naming the model type and the reason."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "get_output_embeddings", None)):
        raise TypeError(
            f"model: expected a transformers causal LM (a config and get_output_embeddings()), got "
            f"{type(model).__name__}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"model: {_kind(model)} is an encoder-decoder model; "
            "rlk.integrations.hf.apply supports decoder-only causal LMs"
        )
    text_config = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    if text_config is not config or getattr(config, "vision_config", None) is not None:
        raise ValueError(
            f"model: {_kind(model)} is a multimodal model (its config holds a text config); "
            "rlk.integrations.hf.apply supports text-only causal LMs"
        )
    for field, what in _LOGIT_TRANSFORMS:
        value = getattr(text_config, field, None)
        if value is not None:
            raise ValueError(
                f"model: {_kind(model)} has {what} ({field}={value!r}) after its LM head; "
                "rlk.integrations.hf.apply computes the log-probs of a plain linear head only"
            )
    _check_head(model, model.get_output_embeddings())


def _check_head(model, head) -> None:
    if head is None:
        raise ValueError(f"model: {_kind(model)} has no LM head (get_output_embeddings() is None)")
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        raise ValueError(
            f"model: the LM head of {_kind(model)} is a {type(head).__name__}, not a plain "
            "torch.nn.Linear (quantized, LoRA or tensor-parallel heads are not supported)"
        )
    if head.bias is not None:
        raise ValueError(
            f"model: the LM head of {_kind(model)} has a bias; "
            "rlk.integrations.hf.apply supports a bias-free linear head"
        )


def _is_dtensor(x: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(x, DTensor)


# ---------------------------------------------------------------------------
# apply / unapply
# ---------------------------------------------------------------------------


def apply(
    model,
    *,
    temperature: float | Tensor = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    batch_invariant: bool = False,
):
    """Give a transformers causal LM a fused log-prob path; returns ``model``.

    Afterwards ``out = model(input_ids, ..., logprob_targets=targets)`` returns, for ``targets [B, S]`` int
    (aligned with the positions: ``targets[b, t]`` is the token whose probability position ``t`` predicts,
    e.g. ``input_ids[:, 1:]`` padded at the end with ``ignore_index``):

    * ``out.logprobs [B, S]`` fp32: ``log softmax(h_t W^T / T)[targets[b, t]]``, 0 where ``targets ==
      ignore_index``; ``h_t`` the hidden state the LM head receives, ``W`` its weight read at each call;
    * ``out.entropy [B, S]`` fp32 when ``return_entropy``, else None; ``out.logits`` None;
    * the model's other outputs (cache, hidden states, ...) as usual. ``labels`` are refused on this path.

    Both are differentiable (the head's weight and the hidden states get their gradients, and through them
    the whole model), computed by :func:`rlk.linear_logprob` without materializing the logits. With
    ``logits_to_keep=k`` the head sees the last ``k`` positions: pass ``targets [B, k]``. ``temperature=`` and
    ``return_entropy=`` given to the call override the options below for that call. Without
    ``logprob_targets`` the model runs its own forward, unchanged.

    Args:
        model: a decoder-only transformers causal LM whose head is a bias-free ``nn.Linear`` over the final
            hidden states (Llama, Qwen2, Qwen3, Mistral, Gemma, ...); a model whose forward changes the head's
            output (Gemma 2's soft-cap, Cohere's logit scale, ...), a biased or non-Linear head, a multimodal
            or encoder-decoder model raise ``ValueError``.
        temperature: ``T > 0``, a float or a tensor broadcastable to the targets (``[B, 1]``: per sequence).
        ignore_index: the target value that gives log-prob 0 and no gradient.
        return_entropy: also compute the entropy.
        batch_invariant: also :func:`rlk.patch_model` the model and run every forward under
            :func:`rlk.batch_invariant` (and the fused head on a batch-invariant backend), so a sequence's
            log-probs are bitwise the same whatever else is in the batch and however it is padded. Keep the
            backward inside ``with rlk.batch_invariant():`` as well for invariant gradients.

    Idempotent; applying with other options replaces them. :func:`unapply` restores the model exactly.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers causal LM), got {type(model).__name__}")
    state = _State(
        temperature=checks.positive_scalar_or_tensor("temperature", temperature, torch.float32),
        ignore_index=checks.integer("ignore_index", ignore_index),
        return_entropy=checks.flag("return_entropy", return_entropy),
        batch_invariant=checks.flag("batch_invariant", batch_invariant),
        previous_forward=None,
        patched=False,
    )
    current = getattr(model, "_rlk_apply", None)
    if current is not None:
        if current.same_options(state):
            return model
        unapply(model)
    _check_model(model)
    state.previous_forward = model.__dict__.get("forward")
    if state.batch_invariant and getattr(model, "_rlk_patch", None) is None:
        patch_model(model)
        state.patched = True
    model._rlk_apply = state
    # A bound method survives copy.deepcopy (rebound to the copy); functools.wraps keeps the class forward's
    # signature, which generate() and the Trainer inspect.
    model.forward = types.MethodType(_forward_of(type(model).forward), model)
    return model


def unapply(model):
    """Undo :func:`apply` (a no-op on a model it was not applied to); returns ``model``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers causal LM), got {type(model).__name__}")
    state = getattr(model, "_rlk_apply", None)
    if state is None:
        return model
    model.__dict__.pop("forward", None)
    if state.previous_forward is not None:
        model.__dict__["forward"] = state.previous_forward
    if state.patched:
        unpatch_model(model)
    del model._rlk_apply
    return model


# ---------------------------------------------------------------------------
# the forward
# ---------------------------------------------------------------------------


def _forward_of(stock):
    @functools.wraps(stock)
    def forward(self, *args, logprob_targets: Tensor | None = None, **kwargs):
        return _forward(self, args, kwargs, logprob_targets)

    return forward


def _forward(model, args: tuple, kwargs: dict, targets: Tensor | None):
    state: _State = model._rlk_apply
    stock = state.previous_forward or functools.partial(type(model).forward, model)
    mode = _batch_invariant_mode() if state.batch_invariant else contextlib.nullcontext()
    if targets is None:
        for name in _PER_CALL:
            if name in kwargs:
                raise TypeError(f"{name}: an option of the log-prob path; pass it together with logprob_targets")
        with mode:
            return stock(*args, **kwargs)
    if not isinstance(targets, Tensor):
        raise TypeError(f"logprob_targets: expected a torch.Tensor, got {type(targets).__name__}")
    temperature = kwargs.pop("temperature", state.temperature)
    temperature = checks.positive_scalar_or_tensor("temperature", temperature, torch.float32)
    return_entropy = checks.flag("return_entropy", kwargs.pop("return_entropy", state.return_entropy))
    for name in ("labels", "shift_labels"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{name}: not with logprob_targets (the log-prob path returns no loss; compute it from out.logprobs)"
            )
    if kwargs.get("return_dict", True) is False:
        raise ValueError("return_dict: must not be False with logprob_targets (the log-probs come in the output)")
    kwargs["return_dict"] = True
    head = model.get_output_embeddings()  # looked up at each call: FSDP or resize_token_embeddings replace it
    _check_head(model, head)
    request = _Request(targets, temperature, state.ignore_index, return_entropy, state.batch_invariant)
    previous_head_forward = head.__dict__.get("forward")
    head.forward = functools.partial(_head_forward, head, request)
    try:
        with mode:
            out = stock(*args, **kwargs)
    finally:
        head.__dict__.pop("forward", None)
        if previous_head_forward is not None:
            head.__dict__["forward"] = previous_head_forward
    return _logprob_output(model, out, request)


def _head_forward(head: torch.nn.Linear, request: _Request, hidden: Tensor) -> Tensor:
    """The LM head during a log-prob call: ``[..., H] -> [..., 1]`` log-probs (``[..., 2]`` with the entropy)."""
    request.calls += 1
    if request.calls > 1:
        raise RuntimeError(
            "rlk.integrations.hf.apply: the model called its LM head more than once in one forward; the "
            "log-prob path supports one head call per forward"
        )
    result = _fused_head(head, request, hidden)
    packed = torch.stack(result, -1) if request.return_entropy else result.unsqueeze(-1)
    request.output, request.version = packed, packed._version
    return packed


def logprobs_from_hidden(
    model, hidden: Tensor, targets: Tensor, *, temperature: float | Tensor | None = None, return_entropy: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """What the log-prob path of an applied ``model`` computes for ``hidden`` ``[..., H]``, the states its LM head
    receives, and ``targets`` ``[...]``: the same op, head weight, options and (batch-invariant mode) backend.

    For tokens chosen outside a forward, such as a rollout's samples: scored from the hidden states of the
    forward that produced their logits, they get the very bits a later log-prob call (training) gives them,
    when the forwards are batch-invariant (``apply(..., batch_invariant=True)``).

    Outside the model's forward an FSDP2 head's weight is a sharded DTensor and a DeepSpeed ZeRO-3 head's is
    partitioned: it is gathered for the call (a collective: every rank of the group calls), which serves scoring
    under ``torch.no_grad()`` (a rollout's); a gradient through such a weight would bypass the engine's gradient
    reduction, so with gradients enabled it raises ValueError (score inside the forward: ``logprob_targets=``).
    """
    state = getattr(model, "_rlk_apply", None)
    if state is None:
        raise ValueError("model: rlk.integrations.hf.apply has not been applied to it")
    head = model.get_output_embeddings()
    _check_head(model, head)
    temperature = state.temperature if temperature is None else temperature
    request = _Request(
        targets,
        checks.positive_scalar_or_tensor("temperature", temperature, torch.float32),
        state.ignore_index,
        checks.flag("return_entropy", return_entropy),
        state.batch_invariant,
    )
    weight = head.weight
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with _full_weight(weight, needs_grad) as full:
        return _fused_head(head, request, hidden, full)


def _is_zero3_partitioned(weight: Tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter not gathered now (its ``data`` is this rank's partition, often empty)."""
    status = getattr(weight, "ds_status", None)
    return hasattr(weight, "ds_id") and status is not None and getattr(status, "name", "") != "AVAILABLE"


@contextlib.contextmanager
def _full_weight(weight: Tensor, needs_grad: bool):
    """The head's full ``[V, H]`` weight for a call outside the model's forward: an FSDP2 (DTensor) weight gathered
    with ``full_tensor()``, a partitioned ZeRO-3 one inside ``deepspeed.zero.GatheredParameters`` (TRL's
    ``maybe_gather_lm_head_ctx`` case), anything else as it is. Gathered weights serve no-grad scoring only."""
    dtensor, zero3 = _is_dtensor(weight), _is_zero3_partitioned(weight)
    if (dtensor or zero3) and needs_grad:
        engine = "an FSDP2 DTensor" if dtensor else "a partitioned DeepSpeed ZeRO-3 parameter"
        raise ValueError(
            f"model: the LM head's weight is {engine} outside the model's forward; logprobs_from_hidden gathers it "
            "for scoring under torch.no_grad() only (a gradient would bypass the engine's reduction): score "
            "with gradients inside the forward, model(..., logprob_targets=targets)"
        )
    if dtensor:
        yield weight.full_tensor()
    elif zero3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([weight]):
            yield weight
    else:
        yield weight


def _fused_head(
    head: torch.nn.Linear, request: _Request, hidden: Tensor, weight: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """``linear_logprob`` of ``hidden`` with the head's weight (or ``weight``) and the request's options."""
    if weight is None:
        weight = head.weight  # read now: FSDP and ZeRO-3 gather it around the head's forward
    if _is_dtensor(weight):
        raise ValueError(
            "model: the LM head's weight is a DTensor (a tensor-parallel head); rlk.integrations.hf.apply "
            "needs the full [V, H] weight on one device"
        )
    if weight.device.type == "meta":
        raise ValueError(
            "model: the LM head's weight is on the meta device (offloaded?); "
            "rlk.integrations.hf.apply needs it materialized on the device of the hidden states"
        )
    hidden = hidden.to(weight.device)
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    if autocast:  # the dtype nn.Linear would compute in; the op itself then runs outside autocast (fp32 inside)
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    targets = request.targets
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"logprob_targets: expected shape {tuple(hidden.shape[:-1])}, the positions whose hidden "
            f"states reach the LM head ([B, S]; [B, k] with logits_to_keep=k), got "
            f"{tuple(targets.shape)}"
        )
    temperature = request.temperature
    if isinstance(temperature, Tensor):
        temperature = temperature.to(hidden.device)
    no_autocast = torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext()
    with _logprob_backend(request, hidden), no_autocast:
        return linear_logprob(
            hidden,
            weight,
            targets.to(hidden.device),
            temperature=temperature,
            ignore_index=request.ignore_index,
            return_entropy=request.return_entropy,
        )


_warned: set[str] = set()


def _logprob_backend(request: _Request, hidden: Tensor):
    """Pin ``linear_logprob`` to a batch-invariant backend in batch-invariant mode."""
    if not request.batch_invariant:
        return contextlib.nullcontext()
    backend = _invariant_backend("linear_logprob", hidden.device, hidden.dtype)
    if backend is None:
        what = f"no batch-invariant linear_logprob for {hidden.dtype} on {hidden.device.type}"
        if what not in _warned:
            _warned.add(what)
            warnings.warn(
                f"rlk.integrations.hf.apply: {what}; the log-probs are not batch-invariant",
                RuntimeWarning,
                stacklevel=4,
            )
        return contextlib.nullcontext()
    return dispatch.use_backend(backend.name)


def _untouched(returned, request: _Request) -> bool:
    """``returned`` is the head's output as it left the head (the tensor, or an alias of it that a hook made),
    neither a transformed copy nor modified in place since."""
    packed = request.output
    return (
        isinstance(returned, Tensor)
        and returned.data_ptr() == packed.data_ptr()
        and returned.shape == packed.shape
        and returned.stride() == packed.stride()
        and returned.dtype == packed.dtype
        and returned._version == request.version
    )


def _logprob_output(model, out, request: _Request):
    if request.output is None:
        raise RuntimeError(
            f"rlk.integrations.hf.apply: the forward of {_kind(model)} did not call its LM head "
            "(get_output_embeddings()); the log-prob path cannot serve it"
        )
    returned = out.get("logits") if isinstance(out, dict) else None
    if not _untouched(returned, request):
        raise RuntimeError(
            f"rlk.integrations.hf.apply: the forward of {_kind(model)} changes the LM head's "
            "output before returning it as logits (soft-capping, scaling, ...); the log-probs of "
            "the plain head would be those of another distribution"
        )
    fields = {name: value for name, value in out.items() if name != "logits"}
    if request.return_entropy:
        logprobs, entropy = (x.contiguous() for x in returned.unbind(-1))
    else:
        # a copy, not a view of the head's output: FSDP2 hooks the forward's outputs for its backward, and an
        # in-place change of a view would drop the hook
        logprobs, entropy = returned.squeeze(-1).clone(), None
    return _output_type(type(out))(**fields, logprobs=logprobs, entropy=entropy)


@functools.cache
def _output_type(base: type) -> type:
    """``base`` (the model's output dataclass, e.g. ``CausalLMOutputWithPast``) with ``logprobs`` and
    ``entropy`` fields; ``logits`` stays None."""
    cls = dataclasses.make_dataclass(
        f"Logprob{base.__name__}", [("logprobs", Tensor | None, None), ("entropy", Tensor | None, None)], bases=(base,)
    )
    cls.__module__ = __name__
    return cls
