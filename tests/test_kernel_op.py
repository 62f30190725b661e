"""KernelOp: a kernel called through its custom op where anything needs the op, and directly otherwise.

The direct call skips the op's dispatch (host time only; a call recording a gradient runs under an autograd.Function
with the op's own backward); the op is what torch.compile traces and what tensor subclasses and dispatch modes see.
Each case below is one the op must keep.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from moeforge.kernels.kernel_op import KernelOp, needs_op

CALLS: list[str] = []


def _double(x: torch.Tensor, factor: float) -> torch.Tensor:
    CALLS.append("impl")
    return x * factor


_double_op = torch.library.custom_op("moeforge_test::double", _double, mutates_args=())


@_double_op.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad * ctx.factor, None


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.factor = inputs[1]


_double_op.register_autograd(_backward, setup_context=_setup)


class _Recorded:
    """The op wrapped so that a call through it is recorded before it runs the implementation."""

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        CALLS.append("op")
        out: torch.Tensor = _double_op(*args, **kwargs)
        return out


double = KernelOp(_Recorded(), _double)


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _path(fn: Any) -> str:
    CALLS.clear()
    fn()
    return CALLS[0]


def test_an_eager_call_without_gradients_runs_the_implementation() -> None:
    x = torch.randn(3)
    assert _path(lambda: double(x, 2.0)) == "impl"
    assert torch.equal(double(x, 2.0), x * 2.0)
    with torch.no_grad():
        assert _path(lambda: double(x.requires_grad_(), 2.0)) == "impl"
    with torch.inference_mode():
        assert _path(lambda: double(torch.randn(3), 2.0)) == "impl"


def test_keyword_arguments_reach_either_path() -> None:
    x = torch.randn(3)
    assert _path(lambda: double(x, factor=3.0)) == "impl"
    assert _path(lambda: double(x.requires_grad_(), factor=3.0)) == "op"


def test_a_parameter_is_a_plain_tensor_but_its_gradient_needs_the_op() -> None:
    weight = nn.Parameter(torch.randn(4))
    with torch.no_grad():
        assert _path(lambda: double(weight, 2.0)) == "impl"
    assert _path(lambda: double(weight, 2.0)) == "op"
    (grad,) = torch.autograd.grad(double(weight, 2.0).sum(), [weight])
    assert torch.equal(grad, torch.full((4,), 2.0))


def test_a_frozen_parameter_in_grad_mode_runs_the_implementation() -> None:
    weight = nn.Parameter(torch.randn(4), requires_grad=False)
    assert _path(lambda: double(weight, 2.0)) == "impl"


@pytest.mark.parametrize("mode", ["fake", "flops", "function", "device"])
def test_modes_see_the_op(mode: str) -> None:
    x = torch.randn(3)
    context = {"fake": FakeTensorMode, "flops": lambda: FlopCounterMode(display=False),
               "function": _PassThrough, "device": lambda: torch.device("cpu")}[mode]()
    with context:
        assert needs_op((x,))
        if mode != "fake":
            assert _path(lambda: double(x, 2.0)) == "op"


def test_a_tensor_subclass_sees_the_op() -> None:
    class Tagged(torch.Tensor):
        pass

    tagged = torch.randn(3).as_subclass(Tagged)
    assert needs_op((tagged,)) and not needs_op((torch.randn(3), None, 1, 2.0))


def test_torch_compile_traces_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _path(lambda: double(torch.randn(3), 2.0)) == "op"


def test_meta_tensors_take_the_op_and_its_fake() -> None:
    meta = torch.empty(3, device="meta")
    assert _path(lambda: double(meta, 2.0)) == "op"
    assert double(meta, 2.0).device.type == "meta"


def test_a_torch_func_transform_sees_the_op() -> None:
    seen = []

    def inside(x: torch.Tensor) -> torch.Tensor:
        seen.append(needs_op((x,)))
        return x * 2

    torch.func.vmap(inside)(torch.randn(4, 3))
    assert seen == [True] and not needs_op((torch.randn(3),))


# A differentiable kernel called with its backward: a call recording a gradient runs the implementation under an
# autograd.Function with the op's own setup_context and backward (no dispatch through the op), the same gradients.
def _scaled(x: torch.Tensor, y: torch.Tensor, factor: float = 3.0) -> torch.Tensor:
    CALLS.append("impl")
    return x * y * factor


_scaled_op = torch.library.custom_op("moeforge_test::scaled", _scaled, mutates_args=())
SEEN_NEEDS: list[tuple[bool, ...]] = []


@_scaled_op.register_fake
def _(x: torch.Tensor, y: torch.Tensor, factor: float = 3.0) -> torch.Tensor:
    return torch.empty_like(x)


def _scaled_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, y, factor = inputs  # every input, the defaulted one too
    ctx.save_for_backward(x, y)
    ctx.factor = factor


def _scaled_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    x, y = ctx.saved_tensors
    SEEN_NEEDS.append(tuple(ctx.needs_input_grad))
    return (grad * y * ctx.factor if ctx.needs_input_grad[0] else None,
            grad * x * ctx.factor if ctx.needs_input_grad[1] else None, None)


_scaled_op.register_autograd(_scaled_backward, setup_context=_scaled_setup)


scaled = KernelOp("moeforge_test::scaled", _scaled, differentiable=True)


def _backward_of(out: torch.Tensor) -> str:
    return "direct" if type(out.grad_fn).__name__.startswith("Eager_") else "op"


def test_a_call_recording_a_gradient_runs_the_implementation_under_the_ops_backward() -> None:
    x, y = torch.randn(5), nn.Parameter(torch.randn(5))
    SEEN_NEEDS.clear()
    direct = scaled(x, y, 2.0)
    assert _backward_of(direct) == "direct"
    (grad,) = torch.autograd.grad(direct.sum(), [y])
    through_op = _scaled_op(x, y, 2.0)
    assert _backward_of(through_op) == "op"
    (want,) = torch.autograd.grad(through_op.sum(), [y])
    assert torch.equal(grad, want) and torch.equal(grad, x * 2.0)
    assert SEEN_NEEDS == [(False, True, False)] * 2  # the same needs_input_grad on both paths
    (grad,) = torch.autograd.grad(scaled(x, y).sum(), [y])  # the default factor reached setup_context
    assert torch.equal(grad, x * 3.0)


def test_a_recording_call_still_takes_the_op_with_keywords_modes_or_no_backward_here() -> None:
    x, y = torch.randn(5), nn.Parameter(torch.randn(5))
    assert _backward_of(scaled(x, y, factor=2.0)) == "op"
    with _PassThrough():
        assert _backward_of(scaled(x, y)) == "op"
    assert _path(lambda: double(y, 2.0)) == "op"  # a KernelOp not declared differentiable
    without_registration = KernelOp(_Recorded(), _double, differentiable=True)  # no registered backward found
    assert _path(lambda: without_registration(y, 2.0)) == "op"
    with torch.no_grad():
        assert _path(lambda: scaled(x, y)) == "impl"
