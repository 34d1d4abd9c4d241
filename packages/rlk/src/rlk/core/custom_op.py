"""How rlk's public ops call their primitives: torch custom ops when traced, the same code directly in eager.

Every rlk op is built from ``torch.library`` custom ops (``rlk::<op>_fwd`` / ``rlk::<op>_bwd``) with fake
implementations and a registered autograd formula, so ``torch.compile`` / ``torch.export`` / ``opcheck``
see one opaque node per primitive. Going through torch's dispatcher and its custom-op autograd wrapper costs
host time on every call, though: hundreds of microseconds per forward + backward on a GPU host, more than
the kernels of a [512, 8192] policy loss or a [16384, 4096] RMSNorm take (``tools/profile_policy_loss.py``).

:func:`define` wraps ``torch.library.custom_op`` and returns an :class:`Op` that is used like the custom op
(``register_fake``, ``register_autograd``, calling it). A call runs the custom op through torch's dispatcher
when anything may be tracing or transforming it (``torch.compile``, a ``TorchDispatchMode`` such as fake
tensors or ``opcheck``'s, functorch transforms, tensor subclasses); in plain eager mode it runs the very
same Python body directly, and, when a gradient is needed, through a ``torch.autograd.Function`` whose
``forward`` / ``backward`` are the registered ``setup_context`` and ``backward``. Both paths execute the same
code and kernels in the same order, so their results are bitwise equal (``tests/test_custom_op.py``).

:func:`declare` is how an op module uses this: from the ABI op's name, one output allocator per primitive (it
serves the body and the fake), the launch of the backend's primitive on those outputs, what the forward saves
and the backward formula, it makes ``rlk::<op>_fwd`` / ``rlk::<op>_bwd``, their fakes, the autograd
registration and the eager path, and records the backend the forward ran on for the backward.

``RLK_NVTX=1`` (read at import; :func:`set_profiler_ranges` at run time) names every primitive call in profiler
timelines: an NVTX range (Nsight Systems) when CUDA is available and a ``torch.profiler`` range, both called
``rlk::<op>_fwd`` / ``rlk::<op>_bwd``. Off by default: then a call costs one flag test.
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from rlk.core import checks, dispatch

#: Tensor types the eager path takes as they are (subclasses go through the dispatcher).
_PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)


def _plain_eager(args: tuple[Any, ...]) -> bool:
    """True when nothing traces or transforms this call: no compile, no dispatch mode, no functorch, plain tensors
    with data (meta tensors take the dispatcher, which runs the fake implementation: shapes, no values)."""
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:  # inside vmap / grad / jvp
        return False
    return all(type(a) in _PLAIN_TENSOR_TYPES and not a.is_meta for a in args if isinstance(a, Tensor))


def _autocast_off(impl: Callable[..., Any]) -> Callable[..., Any]:
    """``impl`` run with autocast off: an rlk primitive computes in the dtypes of its inputs and its own
    accumulation dtypes (fp32 statistics, fp32 matmuls of the reference), which autocast would lower to bf16."""

    @functools.wraps(impl)
    def run(*args):
        if torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"):
            with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
                return impl(*args)
        return impl(*args)

    return run


_ranges = os.environ.get("RLK_NVTX", "0") not in ("", "0")


def set_profiler_ranges(enabled: bool) -> None:
    """Name each primitive call in profiler timelines (NVTX and ``torch.profiler`` ranges) or stop doing so;
    the run-time switch of ``RLK_NVTX``."""
    global _ranges
    _ranges = checks.flag("enabled", enabled)


def _ranged(name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
    """``impl`` inside an NVTX range and a ``torch.profiler`` range named ``name`` while ranges are on."""

    @functools.wraps(impl)
    def run(*args):
        if not _ranges:
            return impl(*args)
        nvtx = torch.cuda.is_available()
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            with torch.profiler.record_function(name):
                return impl(*args)
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()

    return run


class Op:
    """One rlk primitive: a registered torch custom op plus a direct eager path to the same body."""

    def __init__(self, name: str, impl: Callable[..., Any]):
        self.name = name
        impl = _ranged(name, _autocast_off(impl))
        self.impl = impl
        self.custom_op = torch.library.custom_op(name, mutates_args=())(impl)
        self._function: type[torch.autograd.Function] | None = None

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: the fake (meta) implementation, as ``CustomOpDef.register_fake``."""
        self.custom_op.register_fake(fake)
        return fake

    def register_autograd(self, backward: Callable[..., Any], *, setup_context: Callable[..., Any]) -> None:
        """The autograd formula, as ``CustomOpDef.register_autograd``; also builds the eager path's Function.

        The backward primitives are not differentiable themselves, so a backward that builds a graph
        (``create_graph=True``: second-order gradients, ``torch.func.grad``) is refused with an error naming
        the op instead of returning a gradient whose own gradient is silently wrong or missing.
        """
        backward = first_order_only(self.name, backward)
        self.custom_op.register_autograd(backward, setup_context=setup_context)
        impl = self.impl

        class EagerFunction(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                output = impl(*args)
                setup_context(ctx, args, output)
                return output

            @staticmethod
            def backward(ctx, *grads):
                return backward(ctx, *grads)

        EagerFunction.__name__ = EagerFunction.__qualname__ = self.name.replace("::", "_")
        self._function = EagerFunction

    def __call__(self, *args: Any) -> Any:
        if not _plain_eager(args):
            return self.custom_op(*args)
        if (
            self._function is not None
            and torch.is_grad_enabled()
            and any(isinstance(a, Tensor) and a.requires_grad for a in args)
        ):
            return self._function.apply(*args)
        return self.impl(*args)


class DoubleBackwardError(RuntimeError):
    """A backward with ``create_graph=True`` reached an rlk op, whose gradients are first order only."""


def first_order_only(name: str, backward: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """``backward`` (of the op ``name``, e.g. ``"rlk::rms_norm_fwd"``) that raises :class:`DoubleBackwardError`
    when it would have to record a graph; without ``backward``, a decorator."""
    if backward is None:
        return lambda fn: first_order_only(name, fn)
    public = "rlk." + name.removeprefix("rlk::").removesuffix("_fwd")

    def checked(ctx, *grads):
        # The autograd engine runs a backward under grad mode exactly when create_graph=True.
        if torch.is_grad_enabled():
            raise DoubleBackwardError(
                f"{public}: double backward is not supported (a backward with create_graph=True, as for "
                "second-order gradients, gradient penalties or torch.func.grad): rlk's backward kernels compute "
                "first-order gradients only. Run this backward without create_graph, or use a PyTorch "
                "implementation for the part that needs higher-order gradients."
            )
        return backward(ctx, *grads)

    return checked


def placeholder(like: Tensor) -> Tensor:
    """The empty tensor a custom op returns in place of an output it was asked not to compute (a custom op's
    outputs must all be tensors): ``like.new_empty((0,))``, on ``like``'s device and dtype."""
    return like.new_empty((0,))


def _launcher_signature(launch: Callable[..., Any], extra: tuple[inspect.Parameter, ...] = ()) -> inspect.Signature:
    """The custom op's signature: ``launch``'s after its ``(primitive, out)`` parameters, annotations evaluated (the
    schema is inferred from them), with ``extra`` parameters appended."""
    sig = inspect.signature(launch, eval_str=True)
    params = list(sig.parameters.values())
    if [p.name for p in params[:2]] != ["primitive", "out"]:
        raise TypeError(f"{launch.__qualname__}: a launch takes (primitive, out, *inputs), got {list(sig.parameters)}")
    return sig.replace(parameters=[*params[2:], *extra])


def _as_body(
    name: str, launch: Callable[..., Any], sig: inspect.Signature, run: Callable[..., Any]
) -> Callable[..., Any]:
    """A function of ``sig`` (what ``torch.library.custom_op`` infers the schema from) that calls ``run(args)``."""

    def body(*args, **kwargs):
        if kwargs:
            args = sig.bind(*args, **kwargs).args
        return run(args)

    body.__signature__ = sig  # type: ignore[attr-defined]
    body.__name__ = body.__qualname__ = name.replace("rlk::", "")
    body.__module__ = launch.__module__
    return body


class Declaration:
    """One ABI op's custom ops, declared once by :func:`declare`: :attr:`fwd` (``rlk::<op>_fwd``) and, for a
    differentiable op, :attr:`bwd` (``rlk::<op>_bwd``), both :class:`Op`; :meth:`backward` calls :attr:`bwd` on
    the backend that ran the forward."""

    def __init__(self, op: str, key: Callable[..., tuple], dispatch_op: str | None):
        self.op = op
        self.dispatch_op = dispatch_op or op
        self.key = key
        self.fwd: Op | None = None
        self.bwd: Op | None = None
        self._inputs: Any = None  # the named tuple of the forward's inputs

    def forward(
        self,
        *,
        outputs: Callable[..., Any],
        fake: Callable[..., Any] | None = None,
        primitive: str | tuple[str, ...] | None = None,
    ) -> Callable[[Callable[..., Any]], Op]:
        """Decorator on the launch ``launch(primitive, out, *inputs) -> None`` (annotated: the schema). The custom
        op allocates ``out = outputs(*inputs)``, selects the backend (``dispatch.select(op, *key(*inputs))``),
        calls ``launch`` with its ``primitive`` (``"<op>_fwd"`` unless named; a tuple of names gives a tuple of
        that backend's primitives) and returns ``out``; its fake returns ``outputs(*inputs)`` (or ``fake(*inputs)``
        where the body allocates some outputs itself, late, and returns them from ``launch``: a launch that
        returns something returns the outputs)."""
        names = primitive if isinstance(primitive, tuple) else (primitive or f"{self.dispatch_op}_fwd",)

        def wrap(launch: Callable[..., Any]) -> Op:
            sig = _launcher_signature(launch)

            def run(args):
                out = outputs(*args)
                primitives = dispatch.select(self.dispatch_op, *self.key(*args)).primitives
                chosen = tuple(primitives[name] for name in names)
                returned = launch(chosen if isinstance(primitive, tuple) else chosen[0], out, *args)
                return out if returned is None else returned

            self.fwd = Op(f"rlk::{self.op}_fwd", _as_body(f"rlk::{self.op}_fwd", launch, sig, run))
            self.fwd.register_fake(fake or outputs)
            self._inputs = collections.namedtuple(f"{self.op}_inputs", list(sig.parameters))  # type: ignore[misc]
            return self.fwd

        return wrap

    def backward_primitive(
        self, *, outputs: Callable[..., Any], primitive: str | None = None
    ) -> Callable[[Callable[..., Any]], Op]:
        """Decorator on the backward's launch ``launch(primitive, out, *inputs) -> None``: ``rlk::<op>_bwd`` takes
        ``inputs`` and the name of the backend that ran the forward (appended by :meth:`backward`), allocates
        ``out = outputs(*inputs)`` and runs that backend's ``"<op>_bwd"`` (unless named)."""
        name = primitive or f"{self.dispatch_op}_bwd"
        backend_param = inspect.Parameter("backend", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str)

        def wrap(launch: Callable[..., Any]) -> Op:
            sig = _launcher_signature(launch, (backend_param,))

            def run(args):
                *inputs, backend = args
                out = outputs(*inputs)
                launch(dispatch.backend_named(backend).primitives[name], out, *inputs)
                return out

            self.bwd = Op(f"rlk::{self.op}_bwd", _as_body(f"rlk::{self.op}_bwd", launch, sig, run))
            self.bwd.register_fake(lambda *args: outputs(*args[:-1]))
            return self.bwd

        return wrap

    def autograd(self, *, save: Callable[..., Any], backward: Callable[..., Any]) -> None:
        """The autograd formula of :attr:`fwd`: ``save(ctx, inputs, output)`` keeps what the backward needs
        (``ctx.save_for_backward``, ``ctx`` attributes; ``inputs`` is a named tuple of the forward's inputs);
        ``backward(ctx, *grads)`` returns one gradient per input, or a dict of the inputs that get one by name,
        and calls :meth:`backward` for the backward primitive. The backend the forward ran on is recorded in
        ``ctx.backend`` before ``save`` runs."""
        fwd = self.fwd
        if fwd is None:
            raise RuntimeError(f"{self.op}: declare the forward (Declaration.forward) before its autograd")
        names = self._inputs._fields

        def setup(ctx, inputs, output):
            ctx.backend = dispatch.decide(self.dispatch_op, *self.key(*inputs)).backend or ""
            save(ctx, self._inputs(*inputs), output)

        def formula(ctx, *grads):
            result = backward(ctx, *grads)
            if not isinstance(result, dict):
                return result
            unknown = set(result) - set(names)
            if unknown:
                raise TypeError(f"{self.op}: gradients for {sorted(unknown)}, which are not inputs of {names}")
            return tuple(result.get(name) for name in names)

        fwd.register_autograd(formula, setup_context=setup)

    def backward(self, ctx, *inputs: Any) -> Any:
        """:attr:`bwd` on ``inputs``, run by the backend that served the forward of ``ctx``."""
        if self.bwd is None:
            raise RuntimeError(f"{self.op}: no backward primitive declared (Declaration.backward_primitive)")
        return self.bwd(*inputs, ctx.backend)


def first_tensor_key(x: Tensor, *_: Any) -> tuple[torch.device, torch.dtype]:
    """The default dispatch key of an op: the device and dtype of its first input."""
    return x.device, x.dtype


def declare(op: str, *, key: Callable[..., tuple] = first_tensor_key, dispatch_op: str | None = None) -> Declaration:
    """The custom ops of the ABI op ``op`` (``rlk::<op>_fwd`` / ``rlk::<op>_bwd``), declared with
    :meth:`Declaration.forward`, :meth:`Declaration.backward_primitive` and :meth:`Declaration.autograd`.

    ``key(*forward_inputs)`` gives ``dispatch.select``'s ``(device, dtype[, shape facts])``: by default the first
    input's device and dtype. ``dispatch_op``: the ABI op whose backend runs it, when that is another op's (an op
    composed in the op layer from another op's primitives).

    Example (``rlk.ops.softmax``)::

        softmax_op = custom_op.declare("softmax")

        @softmax_op.forward(outputs=lambda x, log: torch.empty_like(x))
        def _softmax_fwd(primitive, out, x: Tensor, log: bool) -> Tensor:
            if out.numel():
                primitive(x, log, out)
    """
    return Declaration(op, key, dispatch_op)


def define(name: str) -> Callable[[Callable[..., Any]], Op]:
    """Decorator: ``@define("rlk::x_fwd")`` on the body makes the custom op ``rlk::x_fwd`` (schema from the
    annotations, no mutated arguments) and returns its :class:`Op`."""

    def wrap(impl: Callable[..., Any]) -> Op:
        return Op(name, impl)

    return wrap
