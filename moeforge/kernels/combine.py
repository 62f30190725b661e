"""Combine on the device: ``out[t] = scale * sum_k rows[r(t, k)] * w[t, k]``, k in fixed order.

Rows are in copy order (``r(t, k) = t * top_k + k``), as the block-aligned grouped GEMM writes them,
or anywhere an index says (``r(t, k) = index[t, k]``, -1 for a copy that contributes nothing), as
the expert-parallel combines receive them. Each program owns one token and a slice of the hidden
dimension and sums its ``top_k`` copies in fp32 in order: deterministic, no atomics, one pass.

The backward (:func:`combine_backward`) is one pass too: each program owns one token, writes its copies' row
gradients ``scale * w[t, k] * d_out[t]`` and, where the routing weights need a gradient, their dot products with the
copies' rows ``scale * <d_out[t], rows[r(t, k)]>`` (summed over the hidden dimension in a fixed order), reading the
token's gradient once. By index, the rows no copy reads get zero gradients (the slot-order rows' padding,
:mod:`moeforge.kernels.slot_rows`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from moeforge.kernels import pdl
from moeforge.kernels.bound_launch import LaunchSite
from moeforge.kernels.kernel_op import KernelOp
from moeforge.kernels.sizes import cdiv, next_power_of_2


@triton.jit
def _combine_kernel(
    rows_ptr, weights_ptr, index_ptr, out_ptr,
    H, scale,
    stride_row, stride_out,
    TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_INDEX: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait_for_the_kernel_before(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        if HAS_INDEX:
            source = tl.load(index_ptr + token * TOP_K + k).to(tl.int64)
            # An absent copy (-1) loads nothing: its zeros add nothing, whatever row 0 holds.
            present = (offs * 0 + source) >= 0  # (a vector: the interpreter masks with vectors only)
            row = tl.load(rows_ptr + tl.maximum(source, 0) * stride_row + offs, mask=mask & present, other=0.0)
        else:
            row = tl.load(rows_ptr + (token * TOP_K + k) * stride_row + offs, mask=mask, other=0.0)
        if HAS_WEIGHTS:
            acc += row.to(tl.float32) * tl.load(weights_ptr + token * TOP_K + k)
        else:
            acc += row.to(tl.float32)
    tl.store(out_ptr + token * stride_out + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


def combined(rows: torch.Tensor, weights: Optional[torch.Tensor], top_k: int, scale: float,
             out_dtype: torch.dtype, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``moeforge::combine`` op's implementation: :func:`combine_copies` into a new ``[T, H]`` of
    ``out_dtype`` (``T``: ``index``'s rows, else ``rows``' over ``top_k``)."""
    tokens = index.shape[0] if index is not None else rows.shape[0] // top_k
    out = torch.empty(tokens, rows.shape[1], dtype=out_dtype, device=rows.device)
    return combine_copies(rows, top_k, out, weights, scale, index)


def combine_copies(
    rows: torch.Tensor,
    top_k: int,
    out: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    scale: float = 1.0,
    index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Sum ``rows [T * top_k, H]`` into ``out [T, H]`` (weights ``[T, top_k]`` fp32, optional); with
    ``index [T, top_k]`` (int32 or int64, -1 = absent), copy ``k`` of token ``t`` is ``rows[index[t, k]]``."""
    tokens, hidden = out.shape
    if tokens == 0:
        return out
    block_h = min(next_power_of_2(hidden), 1024)

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        dependent = pdl.pdl_applies(out.device)
        return (dict(TOP_K=top_k, HAS_WEIGHTS=weights is not None, HAS_INDEX=index is not None, BLOCK_H=block_h,
                     PDL=pdl.flag(dependent)),
                dict(num_warps=4 if block_h >= 512 else 2, **pdl.launch_options(dependent)))

    _COMBINE.launch((top_k, weights is None, index is None, out.device), (tokens, cdiv(hidden, block_h)),
                    (rows, weights if weights is not None else rows, index if index is not None else rows, out,
                     hidden, scale, rows.stride(0), out.stride(0)), make)
    return out


_COMBINE = LaunchSite(_combine_kernel)


@triton.jit
def _combine_backward_kernel(
    grad_ptr, rows_ptr, weights_ptr, d_rows_ptr, d_weights_ptr,
    H, scale,
    stride_grad, stride_row, stride_d_row,
    index_ptr, read_ptr,
    TOP_K: tl.constexpr, K_BLOCK: tl.constexpr, HAS_WEIGHTS: tl.constexpr, WEIGHT_GRAD: tl.constexpr,
    HAS_INDEX: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    pdl.wait_for_the_kernel_before(PDL)
    token = tl.program_id(0).to(tl.int64)
    copies = tl.arange(0, K_BLOCK)
    copy_ok = copies < TOP_K
    copy_ids = token * TOP_K + copies
    if HAS_INDEX:  # each copy's row where the index says (-1: absent, no row); the rows read are marked
        copy_rows = tl.load(index_ptr + copy_ids, mask=copy_ok, other=-1).to(tl.int64)
        copy_ok = copy_ok & (copy_rows >= 0)
        tl.store(read_ptr + copy_rows, tl.full((K_BLOCK,), 1, dtype=tl.int8), mask=copy_ok)
    else:
        copy_rows = copy_ids
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + copy_ids, mask=copy_ok, other=0.0).to(tl.float32)
    else:
        w = tl.where(copy_ok, 1.0, 0.0)
    dots = tl.zeros((K_BLOCK, BLOCK_H), dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        offs = start + tl.arange(0, BLOCK_H)
        ok = offs < H
        g = tl.load(grad_ptr + token * stride_grad + offs, mask=ok, other=0.0).to(tl.float32) * scale
        both = copy_ok[:, None] & ok[None, :]
        tl.store(d_rows_ptr + copy_rows[:, None] * stride_d_row + offs[None, :],
                 (g[None, :] * w[:, None]).to(d_rows_ptr.dtype.element_ty), mask=both)
        if WEIGHT_GRAD:
            row = tl.load(rows_ptr + copy_rows[:, None] * stride_row + offs[None, :], mask=both, other=0.0)
            dots += g[None, :] * row.to(tl.float32)
    if WEIGHT_GRAD:
        tl.store(d_weights_ptr + copy_ids, tl.sum(dots, axis=1).to(d_weights_ptr.dtype.element_ty),
                 mask=copies < TOP_K)


@triton.jit
def _zero_unread_rows_kernel(read_ptr, d_rows_ptr, rows, H, stride_d_row, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    # Zeros into the rows no copy read (their mark still 0): ROWS rows a program, most of them read (skipped).
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    unread = tl.load(read_ptr + row, mask=row < rows, other=1) == 0
    if tl.sum(unread.to(tl.int32), axis=0) > 0:
        zeros = tl.zeros((ROWS, BLOCK_H), dtype=d_rows_ptr.dtype.element_ty)
        for start in range(0, H, BLOCK_H):
            offs = start + tl.arange(0, BLOCK_H)
            tl.store(d_rows_ptr + row.to(tl.int64)[:, None] * stride_d_row + offs[None, :], zeros,
                     mask=unread[:, None] & (offs < H)[None, :])


_COMBINE_BACKWARD = LaunchSite(_combine_backward_kernel)
_ZERO_UNREAD_ROWS = LaunchSite(_zero_unread_rows_kernel)
_UNREAD_ROWS = 16  # rows per program of the zeroing pass


def combine_backward(grad_out: torch.Tensor, rows: torch.Tensor, weights: Optional[torch.Tensor], top_k: int,
                     scale: float, weight_grad: bool, index: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gradients of :func:`combine_copies`: ``(d_rows`` of ``rows``' shape and dtype, ``d_weights [T, top_k]``
    in ``weights``' dtype, or ``None`` unless ``weight_grad``) given ``grad_out [T, H]``: with ``r(t, j)`` the row of
    token ``t``'s copy ``j`` (``t * top_k + j``, or ``index[t, j]``), ``d_rows[r(t, j)] = scale * w[t, j] *
    grad_out[t]`` (``w = 1`` without weights; zero for the rows no copy reads) and ``d_weights[t, j] = scale *
    <grad_out[t], rows[r(t, j)]>`` (zero for an absent copy), computed in fp32."""
    tokens, hidden = grad_out.shape
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()  # autograd hands over expanded gradients (stride 0) as they come
    # By index, rows may be read by no copy (the padding slots of rows in slot order): their gradient is zero. The
    # kernel marks the rows it writes, and a second pass writes zeros into the others alone, rather than a pass of
    # zeros over every row first (a full write of [rows, H] where the padding rows are a small part of them).
    d_rows = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    read = torch.zeros(rows.shape[0], dtype=torch.int8, device=rows.device) if index is not None else None
    weight_grad = weight_grad and weights is not None
    d_weights = torch.empty(tokens, top_k, dtype=weights.dtype, device=rows.device) \
        if weight_grad and weights is not None else None
    if tokens == 0 or hidden == 0:
        if d_weights is not None:
            d_weights.zero_()
        return (d_rows.zero_() if index is not None else d_rows), d_weights
    k_block = next_power_of_2(top_k)
    block_h = max(16, min(next_power_of_2(hidden), 4096 // k_block))
    has_weights = weights is not None

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        dependent = pdl.pdl_applies(rows.device)
        return (dict(TOP_K=top_k, K_BLOCK=k_block, HAS_WEIGHTS=has_weights, WEIGHT_GRAD=weight_grad,
                     HAS_INDEX=index is not None, BLOCK_H=block_h, PDL=pdl.flag(dependent)),
                dict(num_warps=4, **pdl.launch_options(dependent)))

    _COMBINE_BACKWARD.launch((top_k, has_weights, weight_grad, index is None, block_h, rows.device), (tokens,), (
        grad_out, rows, weights if weights is not None else rows, d_rows,
        d_weights if d_weights is not None else d_rows,
        hidden, scale, grad_out.stride(0), rows.stride(0), d_rows.stride(0),
        index if index is not None else rows, read if read is not None else rows), make)
    if read is not None and d_rows.shape[0]:
        _zero_unread_rows(read, d_rows)
    return d_rows, d_weights


def _zero_unread_rows(read: torch.Tensor, d_rows: torch.Tensor) -> None:
    count, hidden = d_rows.shape[0], d_rows.shape[-1]
    block_h = max(16, min(next_power_of_2(hidden), 256))

    def make() -> tuple[dict[str, Any], dict[str, Any]]:
        return dict(ROWS=_UNREAD_ROWS, BLOCK_H=block_h), dict(num_warps=4)

    _ZERO_UNREAD_ROWS.launch(("zero", block_h), (cdiv(count, _UNREAD_ROWS),),
                             (read, d_rows, count, hidden, d_rows.stride(0)), make)


def backward_for_op(grad_out: torch.Tensor, rows: torch.Tensor, weights: Optional[torch.Tensor], top_k: int,
                    scale: float, weight_grad: bool, index: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``moeforge::combine_backward`` op's implementation: :func:`combine_backward` with an empty ``d_weights``
    for ``None`` (an op returns tensors)."""
    d_rows, d_weights = combine_backward(grad_out, rows, weights, top_k, scale, weight_grad, index)
    return d_rows, d_weights if d_weights is not None else rows.new_empty(0, dtype=torch.float32)


# What the combine's backward formula calls (moeforge.kernels.backward): the op where it is needed, else the function.
COMBINE_BACKWARD = KernelOp("moeforge::combine_backward", backward_for_op)
# What the grouped GEMM's backward sums a token's row gradients with (the copies of a row read top_k times).
COMBINE = KernelOp("moeforge::combine", combined)
