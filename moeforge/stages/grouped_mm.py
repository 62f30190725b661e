"""The torch reference's grouped matmul over expert-sorted rows, as a ``torch.library`` custom op.

The computation is a plain loop over the experts, each multiplying its own contiguous run of rows.
How many rows each expert has is data, known only on the device, so the loop reads the counts on the
host: ``torch.compile`` cannot trace that (it needs every output size from input sizes). As a custom
op with a fake implementation (the output is ``[R, N]`` whatever the counts) the loop is one opaque
node of the graph, so a layer on the torch backend compiles with ``fullgraph=True``; its autograd
formula (input gradient: the same op with the weights transposed; weight gradient: one op per
expert's rows) keeps it differentiable.

Eager calls run the loop directly: calling any custom op makes torch import ``torch._dynamo`` on first
use (about a second, and its import writes ``TORCHINDUCTOR_CACHE_DIR`` into the environment), a cost a
layer that is never compiled should not pay. The ops live in the ``moeforge`` namespace beside the
Triton ones (``moeforge.kernels.ops``) and are defined when this module is first imported.
"""

from __future__ import annotations

from typing import Any

import torch

from moeforge.spec import accumulation_dtype


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``y[r] = x[r] @ weight[e(r)].T`` in fp32 for ``x [R, K]`` with rows grouped by expert,
    ``counts [E]`` (int64) rows per expert, ``weight [E, N, K]`` (any float dtype) -> ``[R, N]`` fp32
    (float64 rows: in fp64, for gradcheck).

    Under ``torch.compile`` this is the custom op; in eager mode the same loop, called directly."""
    if torch.compiler.is_compiling():
        out: torch.Tensor = reference_grouped_mm(x, weight, counts)
        return out
    return _grouped_mm_loop(x, weight, counts)


def _grouped_mm_loop(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    dtype = accumulation_dtype(x.dtype)
    if x.shape[0] == 0 and weight.shape[0]:
        # No rows: an empty product that still depends on the rows and the weights, so that a backward reaches
        # them (zero gradients) — an expert-parallel rank whose experts got no rows joins the backward's exchanges.
        empty: torch.Tensor = x.to(dtype) @ weight[0].to(dtype).t()
        return empty
    out = x.new_empty(x.shape[0], weight.shape[1], dtype=dtype)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            out[start:start + count] = x[start:start + count].to(dtype) @ weight[expert].to(dtype).t()
            start += count
    return out


@torch.library.custom_op("moeforge::reference_grouped_mm", mutates_args=())
def reference_grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_mm` as a custom op (what ``torch.compile`` traces)."""
    return _grouped_mm_loop(x, weight, counts)


@reference_grouped_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1], dtype=accumulation_dtype(x.dtype))


@torch.library.custom_op("moeforge::reference_grouped_mm_weight_grad", mutates_args=())
def reference_grouped_mm_weight_grad(grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``dW[e] = sum over expert e's rows r of grad[r]^T x[r]`` -> ``[E, N, K]`` fp32 (fp64 for float64
    rows; zero for experts without rows): the weight gradient of :func:`reference_grouped_mm`, in a fixed
    order."""
    dtype = accumulation_dtype(x.dtype)
    out = grad.new_zeros(counts.shape[0], grad.shape[1], x.shape[1], dtype=dtype)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            out[expert] = grad[start:start + count].to(dtype).t() @ x[start:start + count].to(dtype)
            start += count
    return out


@reference_grouped_mm_weight_grad.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(counts.shape[0], grad.shape[1], x.shape[1], dtype=accumulation_dtype(x.dtype))


def _setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    x, weight, counts = inputs
    ctx.save_for_backward(x, weight, counts)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, Any, None]:  # noqa: ANN401
    x, weight, counts = ctx.saved_tensors
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_x = reference_grouped_mm(grad, weight.transpose(1, 2), counts).to(x.dtype)
    if ctx.needs_input_grad[1]:
        grad_weight = reference_grouped_mm_weight_grad(grad, x, counts).to(weight.dtype)
    return grad_x, grad_weight, None


reference_grouped_mm.register_autograd(_backward, setup_context=_setup_context)
