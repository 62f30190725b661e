"""A kernel callable through its ``torch.library`` custom op, or directly where nothing needs the op.

The custom op is what ``torch.compile`` traces, what autograd differentiates, and what tensor subclasses and
dispatch modes (fake tensors, functionalisation, ``FlopCounterMode``) see. An eager call needs none of that when
it records no gradient and every tensor is a plain one; then the op's dispatcher, autograd wrapper and aliasing
checks are pure host cost, paid by every kernel of a forward (docs/kernels.md, "The eager host path", has the
figures). :class:`KernelOp` calls the implementation
itself in that case and the op in every other one; the outputs are the same tensors either way (the op runs the
same function).

The op is used when any of these holds:

* ``torch.compile`` is tracing (:func:`torch.compiler.is_compiling`);
* a ``TorchDispatchMode`` or a ``TorchFunctionMode`` is active (fake tensors, proxy tracing, ``with
  torch.device(...)``, debugging modes);
* an argument is a tensor of another type than ``torch.Tensor`` or ``nn.Parameter`` (``FakeTensor``,
  ``FunctionalTensor``, ``DTensor``, any subclass), or on the meta device (the op's fake computes its outputs);
* a ``torch.func`` transform (``vmap``, ``grad``) is active: it wraps tensors without changing their type;
* grad mode is on and a tensor argument requires grad: the op's autograd formula runs (or, for an op without one,
  its error on backward).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, Callable, Generic, TypeVar, Union

import torch
from torch import nn

R = TypeVar("R")

_PLAIN = (torch.Tensor, nn.Parameter)


def needs_op(args: Iterable[Any]) -> bool:
    """Whether a call with ``args`` (all its arguments, or those that may be tensors) must go through the custom op
    (see the module docstring)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() \
            or torch._C._is_torch_function_mode_enabled() or _functorch_active():
        return True
    grad = torch.is_grad_enabled()
    for arg in args:
        if isinstance(arg, torch.Tensor) and (type(arg) not in _PLAIN or arg.is_meta or (grad and arg.requires_grad)):
            return True
    return False


# vmap, grad and the other torch.func transforms wrap tensors without changing their Python type.
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


class KernelOp(Generic[R]):
    """A kernel's custom op and ``impl``, the function the op runs; called with the op's arguments, it runs ``impl``
    directly unless :func:`needs_op` says the op is needed. ``op``: the op's qualified name (``"moeforge::combine"``,
    looked up in ``torch.ops`` when called, so that the module defining the kernel need not import the one registering
    its op), or the op itself."""

    __slots__ = ("op", "impl", "tensor_positions")

    def __init__(self, op: Union[str, Callable[..., R]], impl: Callable[..., R]) -> None:
        self.op = op
        self.impl = impl
        # The positions of the parameters annotated as tensors (optional or not): the only ones to look at.
        parameters = inspect.signature(impl).parameters.values()
        self.tensor_positions = tuple(index for index, parameter in enumerate(parameters)
                                      if "Tensor" in str(parameter.annotation))

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        count = len(args)
        tensors = [args[index] for index in self.tensor_positions if index < count]
        if needs_op(tensors + list(kwargs.values()) if kwargs else tensors):
            op = self.op
            if isinstance(op, str):
                namespace, name = op.split("::")
                op = getattr(getattr(torch.ops, namespace), name)
            result: R = op(*args, **kwargs)
            return result
        return self.impl(*args, **kwargs)

    def __repr__(self) -> str:
        return f"KernelOp({self.op!r})"
