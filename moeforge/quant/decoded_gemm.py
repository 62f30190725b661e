"""The torch reference's grouped matmul on quantized expert weights, each expert's weight decoded to fp32
only when its rows are multiplied, as a ``torch.library`` custom op.

The reference never decodes a whole ``[E, N, K]`` weight (at DeepSeek-V3's sizes that is tens of GB in
fp32): a loop over the experts with rows decodes one expert, multiplies its contiguous run of rows and
drops the copy. How many rows each expert has is data, read on the host, which ``torch.compile`` cannot
trace; as a custom op whose fake implementation gives the output's size from the inputs' (``[R, N]``,
whatever the counts), the loop is one opaque node and a quantized layer on the torch backend compiles
with ``fullgraph=True`` (as the unquantized reference does through :mod:`moeforge.stages.grouped_mm`),
with the same memory bound. Eager calls run the loop directly (calling a custom op imports
``torch._dynamo``, a cost a layer that is never compiled should not pay).

A custom op takes tensors and plain values, not functions, so a weight format is named by a string,
one of :data:`FORMATS`:

* ``"scaled"``: FP8-e4m3 or INT8 ``q [E, N, K]`` with fp32 ``scale`` per output channel ``[E, N]`` or per
  128 x 128 block ``[E, ceil(N/128), ceil(K/128)]`` (the W8A8 methods);
* ``"int4"``: moeforge's packed int4 ``qweight [E, N, K/2]`` with ``scales [E, N, K/G]`` and optional
  ``qzeros`` (W4A16).

The quantized weights are data, not trainable: the op's autograd formula gives the rows' gradient
(the same loop multiplying by the decoded weight untransposed) and none for the weight tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from moeforge.quant.int4_packing import dequantize_int4
from moeforge.spec import accumulation_dtype
from moeforge.stages.gemm import DecodedExperts

BLOCK = 128  # weight block edge (rows and columns) of block-scaled weights


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 value of a quantized ``weight [..., N, K]``: ``scale [..., N]`` per channel, or
    ``[..., ceil(N/128), ceil(K/128)]`` per 128 x 128 block."""
    values = weight.float()
    if scale.dim() == weight.dim() - 1:
        return values * scale.float().unsqueeze(-1)
    rows, cols = weight.shape[-2:]
    full = scale.float().repeat_interleave(BLOCK, dim=-2)[..., :rows, :]
    return values * full.repeat_interleave(BLOCK, dim=-1)[..., :cols]


def _scaled(tensors: Sequence[torch.Tensor], expert: int) -> torch.Tensor:
    return dequantize_weight(tensors[0][expert], tensors[1][expert])


def _int4(tensors: Sequence[torch.Tensor], expert: int) -> torch.Tensor:
    zeros = tensors[2][expert] if len(tensors) > 2 else None
    return dequantize_int4(tensors[0][expert], tensors[1][expert], zeros)


# format -> (expert e's fp32 [N, K] from the format's tensors, the weight's (N, K) from their shapes)
FORMATS: dict[str, tuple[Callable[[Sequence[torch.Tensor], int], torch.Tensor],
                         Callable[[Sequence[torch.Tensor]], tuple[int, int]]]] = {
    "scaled": (_scaled, lambda tensors: (int(tensors[0].shape[1]), int(tensors[0].shape[2]))),
    "int4": (_int4, lambda tensors: (int(tensors[0].shape[1]), 2 * int(tensors[0].shape[2]))),
}


def _loop(x: torch.Tensor, counts: torch.Tensor, tensors: Sequence[torch.Tensor], form: str,
          transposed: bool) -> torch.Tensor:
    decode, shape = FORMATS[form]
    rows, cols = shape(tensors)
    dtype = accumulation_dtype(x.dtype)
    out = x.new_empty(x.shape[0], cols if transposed else rows, dtype=dtype)  # the counts cover every row
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            weight = decode(tensors, expert).to(dtype)
            out[start:start + count] = x[start:start + count].to(dtype) @ (weight if transposed else weight.t())
            start += count
    return out


@torch.library.custom_op("moeforge::decoded_grouped_mm", mutates_args=())
def decoded_grouped_mm_op(x: torch.Tensor, counts: torch.Tensor, tensors: list[torch.Tensor], form: str,
                          transposed: bool) -> torch.Tensor:
    """:func:`decoded_grouped_mm` as a custom op (what ``torch.compile`` traces); ``transposed``
    multiplies by the decoded weight itself (``[R, N] -> [R, K]``, the input gradient)."""
    return _loop(x, counts, tensors, form, transposed)


@decoded_grouped_mm_op.register_fake
def _(x: torch.Tensor, counts: torch.Tensor, tensors: list[torch.Tensor], form: str,
      transposed: bool) -> torch.Tensor:
    rows, cols = FORMATS[form][1](tensors)
    return x.new_empty(x.shape[0], cols if transposed else rows, dtype=accumulation_dtype(x.dtype))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, counts, tensors, form, transposed = inputs
    ctx.save_for_backward(counts, *tensors)
    ctx.form, ctx.transposed, ctx.x_dtype = form, transposed, x.dtype


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None, None]:  # noqa: ANN401
    counts, *tensors = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = decoded_grouped_mm_op(grad, counts, tensors, ctx.form, not ctx.transposed).to(ctx.x_dtype)
    return grad_x, None, None, None, None


decoded_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def decoded_grouped_mm(x: torch.Tensor, counts: torch.Tensor, tensors: Sequence[torch.Tensor],
                       form: str) -> torch.Tensor:
    """``y[r] = x[r] @ decode(weight[e(r)]).T`` in fp32 (fp64 for float64 rows) for ``x [R, K]`` with rows
    grouped by expert, ``counts [E]`` rows per expert, the weight in format ``form`` given by ``tensors``
    -> ``[R, N]``. Under ``torch.compile`` the custom op; in eager mode the same loop, called directly
    (autograd differentiates it with respect to ``x``)."""
    if torch.compiler.is_compiling():
        out: torch.Tensor = decoded_grouped_mm_op(x, counts, list(tensors), form, False)
        return out
    return _loop(x, counts, tensors, form, False)


def decoded_experts(form: str, tensors: Sequence[torch.Tensor]) -> DecodedExperts:
    """The experts of a quantized weight (format ``form``, one of :data:`FORMATS`) for the reference
    GEMMs: each expert decoded when its rows are multiplied (experts without rows never are)."""
    decode, shape = FORMATS[form]
    held = tuple(tensors)
    return DecodedExperts(int(held[0].shape[0]), shape(held)[0], lambda expert: decode(held, expert),
                         lambda x, counts: decoded_grouped_mm(x, counts, held, form))
