"""A computation without a backward says so when a backward reaches it.

Autograd cannot differentiate a quantized method's experts meaningfully: a cast to FP8 passes gradients
straight through the rounding, a cast to INT8 or a byte-packed row cuts the graph (the output simply lacks
a ``grad_fn``), and quantized weights take no gradient. Left alone, ``loss.backward()`` would give
partial, zero or meaningless gradients without a word. :func:`no_backward` instead gives such an output
a backward node that raises :class:`~moeforge.errors.InferenceOnlyError` with the reason (which names the
method). The forward is unchanged — the same values, a view of the same tensor — and nothing is added
when no gradient can be asked for (grad mode off, or nothing involved requires grad), so inference pays
nothing.

The node is attached to the output *and* to every input that requires grad, so that an output the
computation detached (no ``grad_fn`` of its own) still leads a backward to the error instead of
silently leaving those inputs without gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch

from moeforge.errors import InferenceOnlyError


class _NoBackward(torch.autograd.Function):
    """Identity forward; a backward that raises the reason it was built with."""

    @staticmethod
    def forward(ctx: Any, reason: str, output: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:  # noqa: ANN401
        ctx.reason = reason
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # noqa: ANN401
        raise InferenceOnlyError(ctx.reason)


def records_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd records a computation on ``tensors`` (grad mode on, one of them requires grad; ``None``
    stands for an absent operand)."""
    return torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in tensors)


def no_backward(reason: str, output: torch.Tensor, sources: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """``output`` (same values), whose backward raises :class:`~moeforge.errors.InferenceOnlyError`
    with ``reason`` when gradients are recorded and ``output`` or one of ``sources`` (the computation's
    inputs) requires grad; else ``output`` itself."""
    if not torch.is_grad_enabled() or not output.is_floating_point():
        return output
    needing = [tensor for tensor in sources if tensor.requires_grad]
    if not needing and not output.requires_grad:
        return output
    guarded: torch.Tensor = _NoBackward.apply(reason, output, *needing)  # type: ignore[no-untyped-call]
    return guarded


def payload_tensors(payload: object) -> Iterator[torch.Tensor]:
    """The float tensors a payload carries: its own fields and those of the records it holds (activations,
    the routing decision); a plan's are its dispatcher's business and are not visited."""
    if isinstance(payload, torch.Tensor):
        if payload.is_floating_point():
            yield payload
        return
    if not dataclasses.is_dataclass(payload) or isinstance(payload, type):
        return
    for field in dataclasses.fields(payload):
        value = getattr(payload, field.name)
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                yield value
        elif value is not None and field.name != "plan" and dataclasses.is_dataclass(value):
            # (None first: Dynamo of torch 2.11 cannot trace is_dataclass(None), an absent adapter_ids)
            yield from payload_tensors(value)
