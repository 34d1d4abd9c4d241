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

``RLK_NVTX=1`` (read at import; :func:`set_profiler_ranges` at run time) names every primitive call in profiler
timelines: an NVTX range (Nsight Systems) when CUDA is available and a ``torch.profiler`` range, both called
``rlk::<op>_fwd`` / ``rlk::<op>_bwd``. Off by default: then a call costs one flag test.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

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
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    _ranges = enabled


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
        if self._function is not None and torch.is_grad_enabled() and any(
            isinstance(a, Tensor) and a.requires_grad for a in args
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


def define(name: str) -> Callable[[Callable[..., Any]], Op]:
    """Decorator: ``@define("rlk::x_fwd")`` on the body makes the custom op ``rlk::x_fwd`` (schema from the
    annotations, no mutated arguments) and returns its :class:`Op`."""

    def wrap(impl: Callable[..., Any]) -> Op:
        return Op(name, impl)

    return wrap
