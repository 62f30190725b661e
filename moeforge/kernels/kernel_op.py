"""A kernel callable through its ``torch.library`` custom op, or directly where nothing needs the op.

The custom op is what ``torch.compile`` traces, what autograd differentiates, and what tensor subclasses and
dispatch modes (fake tensors, functionalisation, ``FlopCounterMode``) see. An eager call needs none of that when
every tensor is a plain one and no mode or transform is active; then the op's dispatcher, its autograd wrapper and
its aliasing checks are pure host cost, paid by every kernel of a forward (docs/kernels.md, "The eager host path",
has the figures). :class:`KernelOp` calls the implementation itself in that case -- under an
``autograd.Function`` of its own where the call records a gradient (grad mode on, a tensor argument requiring grad),
with the same ``setup_context`` and ``backward`` the op registers -- and the op in every other one; the outputs and
the gradients are the same tensors either way (the op's autograd wrapper is an ``autograd.Function`` running the
same functions).

The op is used when any of these holds:

* ``torch.compile`` is tracing (:func:`torch.compiler.is_compiling`);
* a ``TorchDispatchMode`` or a ``TorchFunctionMode`` is active (fake tensors, proxy tracing, ``with
  torch.device(...)``, debugging modes);
* an argument is a tensor of another type than ``torch.Tensor`` or ``nn.Parameter`` (``FakeTensor``,
  ``FunctionalTensor``, ``DTensor``, any subclass), or on the meta device (the op's fake computes its outputs);
* a ``torch.func`` transform (``vmap``, ``grad``) is active: it wraps tensors without changing their type;
* the call records a gradient and the kernel has no backward of its own here (the op's autograd formula runs, or,
  for an op without one, its error on backward); keyword arguments (an ``autograd.Function`` takes none).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, Callable, Generic, Optional, TypeVar, Union

import torch
from torch import nn

R = TypeVar("R")

_PLAIN = (torch.Tensor, nn.Parameter)


DIRECT, DIRECT_WITH_GRAD, THROUGH_OP = 0, 1, 2  # how a call runs: :func:`call_route`


def call_route(args: Iterable[Any]) -> int:
    """How a call with ``args`` (all its arguments, or those that may be tensors) runs: :data:`THROUGH_OP` where the
    custom op is needed (see the module docstring), else :data:`DIRECT_WITH_GRAD` where it records a gradient (grad
    mode on, a tensor requiring grad), else :data:`DIRECT`."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() \
            or torch._C._is_torch_function_mode_enabled() or _functorch_active():
        return THROUGH_OP
    grad = torch.is_grad_enabled()
    route = DIRECT
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if type(arg) not in _PLAIN or arg.is_meta:
                return THROUGH_OP
            if grad and arg.requires_grad:
                route = DIRECT_WITH_GRAD
    return route


def needs_op(args: Iterable[Any]) -> bool:
    """Whether a call with ``args`` cannot run the implementation plainly: the op is needed, or autograd records the
    call (:func:`call_route`)."""
    return call_route(args) != DIRECT


# vmap, grad and the other torch.func transforms wrap tensors without changing their Python type.
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def _registered_autograd(op: object) -> Optional[tuple[Callable[..., None], Callable[..., Any]]]:
    """``(setup_context, backward)`` registered for the custom op ``op`` (its qualified name or its definition), from
    torch's table of custom ops (``torch._library.custom_ops``: private, present in torch 2.4 to 2.13); ``None``
    where anything is missing."""
    from torch._library import custom_ops

    definition = custom_ops.OPDEFS.get(op) if isinstance(op, str) else op
    setup_context = getattr(definition, "_setup_context_fn", None)
    backward = getattr(definition, "_backward_fn", None)
    return (setup_context, backward) if callable(setup_context) and callable(backward) else None

class KernelOp(Generic[R]):
    """A kernel's custom op and ``impl``, the function the op runs; called with the op's arguments, it runs ``impl``
    directly unless :func:`call_route` says the op is needed. ``op``: the op's qualified name (``"moeforge::combine"``,
    looked up in ``torch.ops`` when called, so that the module defining the kernel need not import the one registering
    its op), or the op itself. ``differentiable``: a call recording a gradient runs ``impl`` under an
    ``autograd.Function`` with the ``setup_context`` and ``backward`` registered for the op
    (``torch.library.register_autograd``, read from torch's table of custom ops at the first such call; where that
    table or the op's entry is missing, the call goes through the op)."""

    __slots__ = ("op", "impl", "tensor_positions", "parameter_count", "defaults", "differentiable", "_function")

    def __init__(self, op: Union[str, Callable[..., R]], impl: Callable[..., R], differentiable: bool = False) -> None:
        self.op = op
        self.impl = impl
        self.differentiable = differentiable
        self._function: Optional[type[torch.autograd.Function]] = None
        # The positions of the parameters annotated as tensors (optional or not): the only ones to look at.
        parameters = list(inspect.signature(impl).parameters.values())
        self.tensor_positions = tuple(index for index, parameter in enumerate(parameters)
                                      if "Tensor" in str(parameter.annotation))
        # The trailing parameters' defaults: an autograd.Function sees every input, as the op's setup_context does.
        self.parameter_count = len(parameters)
        self.defaults = tuple(parameter.default for parameter in parameters
                              if parameter.default is not inspect.Parameter.empty)

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        count = len(args)
        tensors = [args[index] for index in self.tensor_positions if index < count]
        route = call_route(tensors + list(kwargs.values()) if kwargs else tensors)
        if route == DIRECT:
            return self.impl(*args, **kwargs)
        if route == DIRECT_WITH_GRAD and self.differentiable and not kwargs:
            function = self._eager_function()
            if function is not None:
                missing = self.parameter_count - count
                if missing > 0:
                    args = args + self.defaults[len(self.defaults) - missing:]
                result: R = function.apply(*args)  # type: ignore[no-untyped-call]
                return result
        op = self.op
        if isinstance(op, str):
            namespace, name = op.split("::")
            op = getattr(getattr(torch.ops, namespace), name)
        through_op: R = op(*args, **kwargs)
        return through_op

    def _eager_function(self) -> Optional[type[torch.autograd.Function]]:
        """The ``autograd.Function`` running ``impl`` with the op's registered ``setup_context`` and ``backward``
        (made once; ``None`` where they are not found)."""
        if self._function is None:
            found = _registered_autograd(self.op)
            if found is None:  # (not registered yet, or not there: the op serves)
                return None
            setup_context, backward = found
            impl = self.impl

            def forward(ctx: Any, *args: Any) -> Any:
                # (ctx in forward: a Function with a setup_context binds its arguments by inspect.signature per call)
                output = impl(*args)
                setup_context(ctx, args, output)
                return output

            self._function = type(f"Eager_{impl.__name__}", (torch.autograd.Function,), {
                "forward": staticmethod(forward), "backward": staticmethod(backward)})
        return self._function

    def __repr__(self) -> str:
        return f"KernelOp({self.op!r})"
